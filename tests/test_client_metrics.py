"""Per-client metrics: each sampled client's accuracy on its own data before and after local
training, in the compiled round against a per-client computation, and ``clients.jsonl``."""

import json

import jax
import numpy as np
import pytest
from compiled import compiled_fns
from engine_reference import sequential_local_updates

from fedjax_rcl.cli import main
from fedjax_rcl.config import Config
from fedjax_rcl.data.augment import normalize
from fedjax_rcl.experiment import build


def _accuracy(exp, apply, params, model_state, client):
    """NumPy: the share of the client's own samples the model (evaluation mode) gets right."""
    idx = np.asarray(exp.parts[client])
    x = normalize(exp.dataset.train_images[idx], exp.dataset.mean, exp.dataset.std)
    out, _ = apply(params, model_state, x, train=False)
    return float(np.mean(np.argmax(np.asarray(out.logits), -1) == exp.dataset.train_labels[idx]))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"clients_in_parallel": 1}], ids=["vmap", "one-at-a-time"])
def test_accuracy_before_and_after_equals_a_per_client_computation(toy, kw):
    # Uneven clients (the last batch of a client is masked) and an odd batch size.
    cfg = Config(dataset="toy", model="cnn", num_clients=6, participation=0.5,
                 partition="dirichlet", alpha=0.5, balanced=False, local_epochs=1,
                 batch_size=13, client_eval=True, **kw)
    exp = build(cfg, toy)
    clients, results = sequential_local_updates(exp, exp.state)
    _, metrics = jax.jit(exp.run_round)(exp.state, exp.data)
    np.testing.assert_array_equal(np.asarray(metrics["clients"]), clients)
    apply = compiled_fns(exp.model).apply
    before = [_accuracy(exp, apply, exp.state.params, exp.state.model_state, c)
              for c in clients]
    after = [_accuracy(exp, apply, r[0], r[1], c)
             for c, r in zip(clients, results, strict=True)]
    np.testing.assert_allclose(np.asarray(metrics["client_acc_before"]), before, atol=1e-6)
    np.testing.assert_allclose(np.asarray(metrics["client_acc_after"]), after, atol=1e-6)
    assert max(after) > 0 and "acc_after" not in metrics  # only the per-client arrays


@pytest.mark.slow
def test_clients_jsonl_per_round_resumes_cut_back_and_reported(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["algorithm=fedavg", "num_clients=6", "participation=0.5", "local_epochs=1",
            "partition=iid", "eval_every=2", "checkpoint_every=2", "--no-progress"]
    assert main(["train", *args, "rounds=2", "client_metrics=true", f"run_dir={run}"]) == 0
    # A line of a round past the checkpoint, as a killed process would leave it.
    with open(run / "clients.jsonl", "a") as f:
        f.write(json.dumps({"round": 3, "clients": [0], "size": [1], "loss": [9.0]}) + "\n")
    assert main(["resume", str(run), "rounds=4"]) == 0
    lines = [json.loads(x) for x in (run / "clients.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2, 3, 4]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for x in lines:
        assert len(x["clients"]) == len(set(x["clients"])) == 3 and "acc_after" not in x
        assert all(s > 0 for s in x["size"]) and all(np.isfinite(x["loss"]))
    # The metrics line's train_loss is the mean of the block's clients' losses.
    block = [v for x in lines[2:] for v in x["loss"]]
    assert metrics[-1]["train_loss"] == pytest.approx(np.mean(block), rel=1e-5)
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "Spread over clients, rounds 1-4" in text and "| `run` | 12 |" in text

"""MFCL end to end: phase 1 through the engine, phase 2 on the clients' representations, the
linear probe, the command line, and resume in either phase to an identical result."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.algorithms.mfcl import reconstruction_bce
from fedjax_rcl.cli import main
from fedjax_rcl.config import load_config
from fedjax_rcl.mfcl import phase2
from fedjax_rcl.mfcl.probe import linear_probe
from fedjax_rcl.mfcl.run import MFCL_DEFAULTS, resume_mfcl, run_mfcl

# A small run: 96 digits, 3 clients, 2 rounds of phase 1, 3 server epochs.
TINY = ["dataset=digits", "mfcl.train_samples=96", "num_clients=3", "alpha=0.5", "rounds=2",
        "batch_size=8", "checkpoint_every=1", "mfcl.server_epochs=3", "mfcl.server_width=4",
        "mfcl.server_batch_size=32", "mfcl.projection_dim=16", "mfcl.probe_epochs=3"]


def test_reconstruction_bce_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 5, 5, 3)) * 3
    x = rng.uniform(size=(4, 5, 5, 3))
    p = 1 / (1 + np.exp(-logits))
    want = np.mean(-(x * np.log(p) + (1 - x) * np.log(1 - p)))
    got = reconstruction_bce(jnp.asarray(logits, jnp.float32), jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_sample_pool_and_dropout():
    parts = [np.array([0, 1, 2]), np.array([3]), np.array([4, 5])]
    pool = phase2.sample_pool(parts, np.array([0, 2]), rho=2)
    assert pool.tolist() == [[0, 0], [1, 0], [2, 0], [4, 0], [5, 0],
                             [0, 1], [1, 1], [2, 1], [4, 1], [5, 1]]
    key = jax.random.PRNGKey(0)
    assert phase2.kept_clients(key, 50, 0.0).tolist() == list(range(50))
    kept = phase2.kept_clients(key, 2000, 0.3)
    assert 0.65 < len(kept) / 2000 < 0.75  # each client drops out with probability delta
    assert len(phase2.kept_clients(key, 3, 0.999999)) == 1  # never nobody


def test_linear_probe_separates_separable_classes():
    rng = np.random.default_rng(1)
    centres = rng.normal(size=(3, 8)) * 4
    y = rng.integers(0, 3, 600)
    x = centres[y] + rng.normal(size=(600, 8))
    out = linear_probe(x[:500], y[:500], x[500:], y[500:], num_classes=3, epochs=20, lr=1e-2,
                       batch_size=50, key=jax.random.PRNGKey(0))
    assert out["linear_probe_accuracy"] > 0.95
    # Labels unrelated to the features: test accuracy near chance (1/3).
    shuffled = rng.permutation(y)
    out = linear_probe(x[:500], shuffled[:500], x[500:], shuffled[500:], num_classes=3,
                       epochs=20, lr=1e-2, batch_size=50, key=jax.random.PRNGKey(0))
    assert out["linear_probe_accuracy"] < 0.55


def _rows(run):
    """metrics.jsonl without its wall times."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One uninterrupted tiny run (twin normalization)."""
    run = tmp_path_factory.mktemp("mfcl") / "run"
    cfg = load_config(None, [*TINY, f"run_dir={run}"], defaults=MFCL_DEFAULTS)
    result = run_mfcl(cfg, log=lambda s: None)
    return run, result


@pytest.mark.slow
def test_run_writes_both_phases_probe_and_resources(finished):
    run, result = finished
    rows = _rows(run)
    assert [(r["phase"], r.get("round", r.get("epoch"))) for r in rows[:-1]] == [
        (1, 1), (1, 2), (2, 1), (2, 2), (2, 3)]
    assert rows[-1]["phase"] == "probe"
    assert 0.0 <= rows[-1]["linear_probe_accuracy"] <= 1.0
    assert rows[-1] == {k: v for k, v in result.items() if k != "run_dir"}
    assert rows[1]["train_bce"] < rows[0]["train_bce"] or rows[1]["test_bce"] < rows[0]["test_bce"]
    resources = json.loads((run / "resources.json").read_text())
    assert resources  # the figures of MFCL's Eqs. 4-6
    assert "norm: twin" in (run / "config.yaml").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["phase2", "phase1"])
def test_resume_in_either_phase_is_identical(finished, tmp_path, cut):
    """A copy of the finished run cut back to phase 2 epoch 1 (or phase 1 round 1), as an
    interrupt would leave it, resumes to exactly the same metrics and probe."""
    run, _ = finished
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ck = copy / "checkpoints"
    if cut == "phase2":
        for step in ("2", "3"):
            shutil.rmtree(ck / "phase2" / step)
    else:
        shutil.rmtree(ck / "phase2")
        shutil.rmtree(ck / "phase1" / "2")
    cfg = load_config(str(copy / "config.yaml"), [f"run_dir={copy}"])
    resume_mfcl(copy, cfg, log=lambda s: None)
    assert _rows(copy) == _rows(run)


@pytest.mark.slow
def test_command_line_runs_and_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["mfcl", *TINY, "mfcl.server_epochs=1", "norm=group", "mfcl.probe_epochs=1",
            f"run_dir={run}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "linear probe accuracy" in out and "phase 2 epoch 1/1" in out
    # resume of a finished MFCL run dispatches to MFCL and recomputes the same probe.
    before = _rows(run)
    assert main(["resume", str(run), "--no-progress"]) == 0
    assert _rows(run) == before


def test_bad_input_and_train_refuses_mfcl(tmp_path, capsys):
    assert main(["mfcl", "mfcl.rho=0", "mfcl.delta=1.5", "norm=layer",
                 "mfcl.bn_statistics=mean", f"run_dir={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err
    assert "mfcl.rho=0" in err and "mfcl.delta=1.5" in err and "norm" in err
    assert "mfcl.bn_statistics='mean'" in err and "'running' or 'batch'" in err
    assert main(["mfcl", "norm=twin", "mfcl.bn_statistics=batch",
                 f"run_dir={tmp_path / 'x'}"]) == 2
    assert "bn_statistics='batch' applies to a BatchNorm client module" in \
        capsys.readouterr().err
    assert main(["train", "algorithm=mfcl", "model=mfcl_autoencoder", "norm=twin",
                 f"run_dir={tmp_path / 'y'}"]) == 2
    assert "fedjax-rcl mfcl" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_batch_statistics_representations_are_each_clients_own_batches():
    """mfcl.bn_statistics=batch: a BatchNorm client module normalises each client's batches
    of batch_size pairs by their own statistics, never mixing clients; the default (running
    statistics) gives each sample's representation on its own."""
    from fedjax_rcl.experiment import build
    from fedjax_rcl.mfcl.run import client_encoder, mfcl_dataset, represent_all

    cfg = load_config(None, [*TINY, "norm=batch", "mfcl.bn_statistics=batch"],
                      defaults=MFCL_DEFAULTS)
    exp = build(cfg, mfcl_dataset(cfg))
    encode = client_encoder(exp)(exp.state.params, exp.state.model_state)
    kept = np.arange(cfg.num_clients)
    pool = phase2.sample_pool(exp.parts, kept, rho=2)
    sizes = [len(exp.parts[k]) for k in kept]
    assert min(sizes) > 0 and max(sizes) > cfg.batch_size  # several batches per client
    reps = np.asarray(represent_all(exp, encode, pool, sizes * 2))
    p = len(pool)
    assert reps.shape[0] == 2 * p
    # The expected batches, from the clients' parts: each client's draws, batch_size at a time.
    represent = phase2.make_representations(encode, paired=True, blur=False)
    images = jnp.asarray(exp.dataset.train_images)
    key = jax.random.PRNGKey(cfg.seed)
    start = 0
    for size in sizes * 2:
        for s in range(start, start + size, cfg.batch_size):
            e = min(s + cfg.batch_size, start + size)
            rows = pool[s:e]
            want = np.asarray(represent(key, images[rows[:, 0]], jnp.asarray(rows)))
            np.testing.assert_allclose(reps[s:e], want[:e - s], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(reps[p + s:p + e], want[e - s:], rtol=1e-4, atol=1e-4)
        start += size
    # Running statistics: another result, in which a sample does not depend on its batch.
    cfg_running = load_config(None, [*TINY, "norm=batch"], defaults=MFCL_DEFAULTS)
    exp.cfg = cfg_running
    running = client_encoder(exp)(exp.state.params, exp.state.model_state)
    alone = np.asarray(represent_all(exp, running, pool, sizes * 2))
    assert np.abs(alone - reps).max() > 1e-2
    one = np.asarray(phase2.make_representations(running, paired=True, blur=False)(
        key, images[pool[:1, 0]], jnp.asarray(pool[:1])))
    np.testing.assert_allclose(alone[[0, p]], one, rtol=1e-4, atol=1e-4)

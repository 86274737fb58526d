"""Representation analysis during training (``analysis_every``): the local model it analyses is
the one the next round trains, the participation histogram counts the sampled clients, the
metrics land in metrics.jsonl, and the settings are validated and resume-safe."""

import json

import jax
import numpy as np
import pytest

from fedjax_rcl.cli import main
from fedjax_rcl.config import Config, ConfigError, config_digest, load_config
from fedjax_rcl.engine.analysis import analysis_subset
from fedjax_rcl.experiment import build


def _cfg(**kw):
    base = dict(dataset="toy", model="cnn", algorithm="fedavg", num_clients=6,
                participation=1 / 6, partition="iid", local_epochs=1, batch_size=16, rounds=3,
                eval_every=1, analysis_every=1, analysis_images=60)
    base.update(kw)
    return Config(**base)


def test_subset_is_class_balanced_whatever_the_order():
    """An image folder's test set comes class by class: its first images are one class."""
    labels = np.repeat(np.arange(10), [100, 50, 100, 100, 100, 100, 100, 100, 100, 7])
    idx = analysis_subset(labels, 400)
    assert len(idx) == len(set(idx.tolist())) == 400 and np.all(np.diff(idx) > 0)
    counts = np.bincount(labels[idx], minlength=10)
    # 40 per class where the class has them; the short class gives all 7, the rest share.
    assert counts[9] == 7 and counts.min() >= 7 and counts[:9].max() - counts[:9].min() <= 1
    # Within a class, its earliest images; a shuffled order keeps the subset balanced too.
    assert np.array_equal(idx[labels[idx] == 3], np.arange(250, 250 + counts[3]))
    shuffled = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 30))
    assert np.bincount(shuffled[analysis_subset(shuffled, 100)], minlength=10).tolist() == [10] * 10
    assert len(analysis_subset(labels, 10_000)) == len(labels)


@pytest.mark.slow
def test_local_model_is_the_one_the_next_round_trains(toy):
    """One client per round and plain averaging: the next global model IS that client's local
    model, so its analysis equals the local analysis taken before the round."""
    exp = build(_cfg(), toy)
    analyze = exp.analysis(60)
    before = analyze(exp.state)
    after_state, metrics = jax.jit(exp.run_round)(exp.state, exp.data)
    after = analyze(after_state)
    assert before["local_client"] == int(np.asarray(metrics["clients"])[0])
    for k in ("effective_rank", "vci", "trace_within", "trace_between"):
        np.testing.assert_allclose(before[f"local_{k}"], after[f"global_{k}"], rtol=1e-4,
                                   atol=1e-9)
    assert before["global_effective_rank"] != pytest.approx(after["global_effective_rank"])


@pytest.mark.slow
def test_participation_counts_the_sampled_clients(toy):
    exp = build(_cfg(participation=0.5), toy)
    analyze = exp.analysis(60)
    state, step, seen = exp.state, jax.jit(exp.run_round), np.zeros(6, int)
    for _ in range(3):
        state, metrics = step(state, exp.data)
        np.add.at(seen, np.asarray(metrics["clients"]), 1)
    assert analyze(state)["participation"] == seen.tolist()
    assert sum(seen) == 9


@pytest.mark.slow
def test_metrics_jsonl_rows_and_validation(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["dataset=digits", "num_clients=10", "participation=0.5", "local_epochs=1",
            "partition=iid", "algorithm=fedavg", "rounds=4", "analysis_every=2",
            "analysis_images=200", f"run_dir={run}", "--no-progress"]
    assert main(["train", *args]) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert ["global_vci" in r for r in rows] == [False, True, False, True]
    assert rows[-1]["global_effective_rank"] > 1 and 0 <= rows[-1]["local_vci"] <= 1
    for which in ("global", "local"):  # the measures that keep the mean
        last = rows[-1]
        assert last[f"{which}_effective_rank_uncentred"] >= 1
        assert -1 <= last[f"{which}_mean_cosine"] <= 1
        assert 0 <= last[f"{which}_spread_share"] <= 1
    assert sum(rows[-1]["participation"]) == 4 * 5
    with pytest.raises(ConfigError) as e:
        load_config(None, ["eval_every=2", "analysis_every=3", "analysis_images=1"])
    assert "analysis_every=3: must be 0 (off) or a multiple of eval_every=2" in str(e.value)
    assert "analysis_images=1: must be >= 2" in str(e.value)
    # The analysis changes nothing in the run: it may be switched on or off on resume.
    a, b = load_config(None, []), load_config(None, ["analysis_every=5"])
    assert config_digest(a) == config_digest(b)


@pytest.mark.slow  # two runs end to end; the analysis' rows are checked by default
def test_analysis_changes_nothing_in_the_run(tmp_path, capsys):
    """The same run with the analysis on and off: every training and test number identical (the
    analysis reads the states and draws no randomness the round uses)."""
    rows = {}
    for every in (0, 1):
        run = tmp_path / f"run{every}"
        assert main(["train", "dataset=digits", "num_clients=10", "participation=0.3",
                     "local_epochs=1", "algorithm=fedrcl", "rounds=3", f"analysis_every={every}",
                     "analysis_images=100", f"run_dir={run}", "--no-progress"]) == 0, \
            capsys.readouterr().err
        rows[every] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    timing = {"round_s", "elapsed_s", "total_s"}
    for off, on in zip(rows[0], rows[1], strict=True):
        assert "global_vci" in on and "global_vci" not in off
        shared = {k: v for k, v in off.items() if k not in timing}
        assert shared == {k: on[k] for k in shared}

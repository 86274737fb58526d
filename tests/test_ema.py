"""The EMA of the test accuracy is per round (FedRCL's Table 1 measure), whatever the
evaluation cadence; beside it, the mean raw accuracy of the last 10 and 50 rounds; the paper's
configurations evaluate every round; sweeps are summarised per value; titles name the run."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from fedjax_rcl.metrics import RECENT_WINDOWS, ema, recent_mean

ROOT = Path(__file__).resolve().parent.parent


def _reference(acc: np.ndarray, decay: float, gaps: np.ndarray) -> np.ndarray:
    """NumPy float64: ema_0 = acc_0, then ema_i = d**g_i ema_{i-1} + (1 - d**g_i) acc_i, in the
    closed form sum_j w_j acc_j (each evaluation's weight, the product of the later keeps)."""
    acc, out = np.asarray(acc, np.float64), []
    keep = np.float64(decay) ** np.asarray(gaps, np.float64)
    for i in range(len(acc)):
        w = np.array([(1 - keep[j] if j else 1.0) * np.prod(keep[j + 1:i + 1])
                      for j in range(i + 1)])
        out.append(w @ acc[:i + 1])
    return np.array(out)


def _fold(acc, decay, gaps):
    e, out = None, []
    for a, g in zip(acc, gaps, strict=True):
        e = ema(e, float(a), decay, int(g))
        out.append(e)
    return np.array(out)


@pytest.mark.parametrize("decay", [0.9, 0.5, 0.99])
def test_every_round_the_ema_is_the_papers_per_round_ema(decay):
    acc = np.random.default_rng(0).uniform(0, 1, 200)
    ones = np.ones(200, int)
    np.testing.assert_allclose(_fold(acc, decay, ones), _reference(acc, decay, ones),
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("k", [2, 10])
def test_every_k_rounds_one_evaluation_applies_decay_to_the_k(k):
    rng = np.random.default_rng(k)
    acc = rng.uniform(0, 1, 50)
    gaps = np.full(50, k)
    gaps[-1] = 3  # the last block shorter (rounds not a multiple of k)
    got = _fold(acc, 0.9, gaps)
    np.testing.assert_allclose(got, _reference(acc, 0.9, gaps), rtol=1e-12, atol=1e-15)
    # Not the old per-evaluation EMA (decay once per evaluation).
    assert got[1] == pytest.approx(0.9 ** k * acc[0] + (1 - 0.9 ** k) * acc[1], rel=1e-12)
    # A constant accuracy held for k rounds: exactly the per-round EMA over those rounds.
    per_round = _fold(np.r_[acc[:1], np.full(k, 0.7)], 0.9, np.ones(k + 1, int))[-1]
    assert ema(float(acc[0]), 0.7, 0.9, k) == pytest.approx(per_round, rel=1e-12)


def test_means_over_the_last_rounds():
    rng = np.random.default_rng(1)
    acc = rng.uniform(0, 1, 120)
    every = list(enumerate(acc, start=1))
    for w in RECENT_WINDOWS:
        assert recent_mean(every, 120, w) == pytest.approx(acc[-w:].mean(), rel=1e-12)
        assert recent_mean(every, 60, w) == pytest.approx(acc[60 - w:60].mean(), rel=1e-12)
    tenth = [(r, a) for r, a in every if r % 10 == 0]
    assert recent_mean(tenth, 120, 10) == acc[119]  # one evaluation in the last 10 rounds
    assert recent_mean(tenth, 120, 50) == pytest.approx(acc[[79, 89, 99, 109, 119]].mean())
    assert np.isnan(recent_mean([], 5, 10))


@pytest.mark.slow
def test_a_run_writes_the_per_round_ema_the_cadence_and_the_last_rounds_means(tmp_path,
                                                                              capsys):
    """A run evaluated every 3 rounds (7 rounds: blocks of 3, 3, 1), resumed to round 9 (a
    block of 2): every line's EMA is the float64 reference of its accuracies with decay**k,
    ``ema_rounds`` says each k, and the means over the last rounds take the evaluations before
    the resume into account."""
    from fedjax_rcl.cli import main

    run = tmp_path / "run"
    args = ["dataset=digits", "num_clients=10", "participation=0.5", "local_epochs=1",
            "partition=iid", "--no-progress"]
    assert main(["train", *args, "rounds=7", "eval_every=3", f"run_dir={run}"]) == 0
    done = [x for x in capsys.readouterr().out.splitlines() if x.startswith("done:")]
    assert "(evaluated every 3 rounds: 0.9**3 per evaluation, the paper's per-round EMA only at " \
        "eval_every=1;" in done[0]
    assert main(["resume", str(run), "rounds=9", "--no-progress"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [3, 6, 7, 9]
    assert [r["ema_rounds"] for r in rows] == [3, 3, 1, 2]
    acc = np.array([r["test_accuracy"] for r in rows])
    np.testing.assert_allclose([r["test_accuracy_ema"] for r in rows],
                               _reference(acc, 0.9, np.array([3, 3, 1, 2])), rtol=1e-9)
    for i, r in enumerate(rows):
        for w in RECENT_WINDOWS:
            want = np.mean([x["test_accuracy"] for x in rows[:i + 1]
                            if r["round"] - w < x["round"]])
            assert r[f"test_accuracy_last{w}"] == pytest.approx(want, rel=1e-12)


def _resolved(path: Path) -> list[dict]:
    """A config's resolved settings: a run config itself; a suite's base with each run's
    overrides."""
    data = yaml.safe_load(path.read_text())
    if "base" not in data:
        return [data]
    base = yaml.safe_load((ROOT / data["base"]).read_text())
    out = []
    for overrides in data["runs"].values():
        cfg = dict(base)
        for o in overrides:
            k, _, v = o.partition("=")
            cfg[k] = yaml.safe_load(v)
        out.append(cfg)
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "experiments" / "paper").glob("*.yaml"))
                         + sorted((ROOT / "experiments" / "cpu").glob("*.yaml"))
                         + sorted((ROOT / "experiments" / "suites").glob("*.yaml"))
                         + sorted((ROOT / "experiments" / "paper_resnet18_gpu").glob("*.yaml"))
                         + [ROOT / "experiments" / "mfcl" / "paper_cifar10.yaml"],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_configuration_for_a_paper_table_evaluates_every_round(path):
    for cfg in _resolved(path):
        assert cfg.get("eval_every") == 1, path


@pytest.mark.parametrize(
    "path", [ROOT / "experiments" / "paper_resnet18_gpu" / "device_paper_resnet18.sh",
             ROOT / "BENCHMARKS.md"], ids=lambda p: p.name)
def test_the_paper_scale_gpu_commands_evaluate_every_round(path):
    every = re.findall(r"eval_every=(\d+)", path.read_text())
    assert all(k == "1" for k in every), (path, every)


def test_a_sweep_progress_line_gives_each_value_its_own_mean():
    """Two values of beta, two seeds each: mean ± sd over the seeds of each value, never one
    mean over different values."""
    from fedjax_rcl.grid import _by_value

    exps = [SimpleNamespace(cfg=SimpleNamespace(fedrcl=SimpleNamespace(beta=b)))
            for b in (0.5, 0.5, 2.0, 2.0)]
    acc = [0.2, 0.4, 0.6, 0.8]
    lines = [{"test_accuracy": a, "test_accuracy_ema": a / 2} for a in acc]
    text = _by_value(exps, "fedrcl.beta", lines)
    sd = np.std([0.2, 0.4], ddof=1)
    assert text == (f"test acc fedrcl.beta=0.5: 0.3000 ± {sd:.4f} (EMA 0.1500 ± "
                    f"{sd / 2:.4f}, 2 seeds); fedrcl.beta=2.0: 0.7000 ± {sd:.4f} (EMA 0.3500 ± "
                    f"{sd / 2:.4f}, 2 seeds)")
    assert "0.5000" not in text  # the mean over all four runs
    seeds = _by_value(exps[:2], None, lines[:2])
    assert seeds.startswith("test acc 0.3000 ±") and "over 2 seeds" in seeds


def test_accuracy_plot_title_names_the_split_clients_and_seed(tmp_path, monkeypatch):
    from fedjax_rcl import plots, training
    from fedjax_rcl.config import CoreConfig

    seen = {}
    monkeypatch.setattr(plots, "plot_metrics", lambda *a, **k: seen.update(k))
    cfg = CoreConfig(num_clients=100, alpha=0.3, seed=2)
    training.plot_run(tmp_path, cfg)
    assert "Dirichlet alpha 0.3 · 100 clients · seed 2" in seen["title"]
    training.plot_run(tmp_path, CoreConfig(partition="iid", num_clients=20, seed=0))
    assert "IID · 20 clients · seed 0" in seen["title"]


def test_a_suite_table_keeps_an_ema_at_another_cadence_out_of_the_papers_comparison(tmp_path):
    """Three runs beside the paper's values, one evaluated every 10th round: its EMA is marked
    † and left out of the rank correlation with the paper (two runs remain: none computed)."""
    pytest.importorskip("matplotlib")
    from fedjax_rcl import suite as suite_tool

    for name, level, every in (("a", 0.2, 1), ("b", 0.4, 1), ("c", 0.5, 10)):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        d.joinpath("metrics.jsonl").write_text("".join(
            json.dumps({"round": r, "test_accuracy": level, "test_accuracy_ema": level}) + "\n"
            for r in range(every, 31, every)))
    suite = {"base": "base.yaml", "runs_dir": str(tmp_path / "runs"), "rounds": 30,
             "report_rounds": [30], "runs": {"a": ["algorithm=fedavg"], "b": ["algorithm=fedrcl"],
                                             "c": ["algorithm=moon"]},
             "paper": {"a": {"500R": 70.0}, "b": {"500R": 80.0}, "c": {"500R": 75.0}}}
    text = suite_tool.table(suite, tmp_path / "out")
    assert "| c | algorithm=moon | 30 | 0.5000† |" in text
    assert "| a | algorithm=fedavg | 30 | 0.2000 |" in text
    assert "† Not evaluated every round" in text and text.count("†") == 2
    assert "Spearman" not in text  # 2 runs left at the per-round cadence: too few to rank

"""The benchmark tools keep their promises about the checkout."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_round_no_append_writes_nothing_into_the_checkout(tmp_path):
    before = sorted((ROOT / "benchmarks").iterdir())
    out = tmp_path / "round.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_round.py"), "--models",
                           "cnn", "--algorithms", "fedavg", "--clients", "1", "--modes", "vmap",
                           "--no-append", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted((ROOT / "benchmarks").iterdir()) == before
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["mode"], r["clients"]) for r in rows] == [("cnn", "vmap", 1)]
    assert rows[0]["round_s"] > 0


def _row(model, clients, mode, speed):
    return {"model": model, "clients": clients, "mode": mode, "batch": 50, "precision": "fp32",
            "round_s": 1.0 / speed, "client_steps_per_s": speed}


def test_fit_layout_reads_the_table_and_refits_the_threshold():
    """A synthetic CPU table: MOON's CNN fastest side by side, ResNet-10 at width 16 one at a
    time; the fit is the geometric mean of their step GFLOP, and the default's ratio to the best
    layout is computed per client count."""
    sys.path.insert(0, str(ROOT / "tools"))
    from fit_layout import analyse, markdown, step_gflop

    rows = [_row("cnn", 5, "side-by-side", 200), _row("cnn", 5, "one-at-a-time", 150),
            _row("cnn", 5, "sequential", 140),
            _row("resnet10:16", 5, "side-by-side", 10), _row("resnet10:16", 5, "one-at-a-time", 14),
            _row("resnet10:16", 5, "sequential", 14.5)]
    result = analyse({"machine": "test, 2 cores, cpu, jax", "rows": rows})
    assert result["platform"] == "cpu"
    cnn, r10 = result["models"]["cnn"], result["models"]["resnet10:16"]
    assert cnn["verdict"] == "side-by-side" and r10["verdict"] == "one-at-a-time"
    assert cnn["gflop"] == pytest.approx(step_gflop("cnn", 50))
    assert result["fitted"] == pytest.approx((cnn["gflop"] * r10["gflop"]) ** 0.5)
    # The package's default on a CPU picks each model's best compiled layout here.
    assert cnn["default"] == "side-by-side" and cnn["ratio"][5] == 1.0
    assert r10["default"] == "one-at-a-time"
    assert r10["ratio"][5] == pytest.approx(14 / 14.5)  # the Python loop was best
    assert "| resnet10:16 |" in markdown(result)


def test_gpu_check_merges_its_layout_stages(tmp_path):
    """tools/gpu_check.py measures layouts in stages (one bench_round.py run each, the most
    telling first) and merges them into one layouts.json that fit_layout reads; the merged rows
    keep every stage's rows in order and say which stage measured them."""
    sys.path.insert(0, str(ROOT / "tools"))
    from fit_layout import analyse
    from gpu_check import _merge_layouts

    machine = "test, 16 cores, gpu (test), jax"
    stage0 = [_row("cnn", 10, "side-by-side", 300), _row("cnn", 10, "one-at-a-time", 200)]
    stage1 = [_row("resnet10:16", 10, "side-by-side", 9), _row("resnet10:16", 10,
                                                              "one-at-a-time", 12)]
    paths = []
    for i, rows in enumerate([stage0, stage1]):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps({"machine": machine, "matmul_peak_gflops": 1.0,
                                         "rows": rows}))
    dest = tmp_path / "layouts.json"
    _merge_layouts([], dest)  # no stage finished: nothing written
    assert not dest.exists()
    _merge_layouts(paths, dest)
    merged = json.loads(dest.read_text())
    assert merged["machine"] == machine
    assert [(r["model"], r["mode"], r["stage"]) for r in merged["rows"]] == [
        ("cnn", "side-by-side", 0), ("cnn", "one-at-a-time", 0),
        ("resnet10:16", "side-by-side", 1), ("resnet10:16", "one-at-a-time", 1)]
    result = analyse(merged)
    assert result["platform"] == "gpu"
    assert result["models"]["cnn"]["verdict"] == "side-by-side"
    assert result["models"]["resnet10:16"]["verdict"] == "one-at-a-time"


def test_mfcl_bn_evidence_measures_against_loops():
    """tools/mfcl_bn_evidence.py's measures against explicit loops on random data: class
    composition per client, the distance of a client's BN statistics from the running ones,
    the between-client share of the sum of squares, the per-channel spatial summary."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "tools"))
    from mfcl_bn_evidence import between_share, class_composition, statistics_distance, summarise

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 60)
    parts = [np.arange(0, 25), np.arange(25, 26), np.arange(26, 60)]
    got = class_composition(labels, parts, 4)
    for info, idx in zip(got, parts, strict=True):
        counts = [int(np.sum(labels[idx] == k)) for k in range(4)]
        assert info["n"] == len(idx)
        assert info["classes"] == sum(c > 0.01 * len(idx) for c in counts)
        assert info["majority_share"] == max(counts) / len(idx)
    mc, mr = rng.normal(size=8), rng.normal(size=8)
    vc, vr = rng.uniform(0.1, 3, 8), rng.uniform(0.1, 3, 8)
    shift, logv = statistics_distance(mc, vc, mr, vr)
    want = [abs(mc[i] - mr[i]) / vr[i] ** 0.5 for i in range(8)]
    assert shift == pytest.approx(sum(want) / 8, rel=1e-12)
    want = [abs(np.log(vc[i] / vr[i])) for i in range(8)]
    assert logv == pytest.approx(sum(want) / 8, rel=1e-12)
    x, g = rng.normal(size=(30, 5)), rng.integers(0, 3, 30)
    m = x.mean(0)
    between = sum(np.sum(g == k) * np.sum((x[g == k].mean(0) - m) ** 2) for k in range(3))
    within = sum(np.sum((x[i] - x[g == g[i]].mean(0)) ** 2) for i in range(30))
    assert between_share(x, g) == pytest.approx(between / (between + within), rel=1e-10)
    assert between_share(x, np.zeros(30, int)) == pytest.approx(0.0, abs=1e-12)
    z = rng.normal(size=(3, 4, 5, 2))
    s = summarise(z)
    for i in range(3):
        for c in range(2):
            assert s[i, c] == pytest.approx(z[i, :, :, c].mean())
            assert s[i, 2 + c] == pytest.approx(z[i, :, :, c].std())

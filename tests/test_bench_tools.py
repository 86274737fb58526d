"""The benchmark tools keep their promises: ``tools/bench_round.py`` writes nothing into the
checkout with ``--no-append``; the layout tables it writes are analysed and merged as
``tools/fit_layout.py`` and ``tools/gpu_check.py`` need (``fedjax_rcl.engine.layout``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedjax_rcl.engine import layout

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
    assert rows[0]["round_s"] > 0 and rows[0]["minor_faults"] >= 0


def _row(model, clients, mode, speed):
    return {"model": model, "clients": clients, "mode": mode, "batch": 50, "precision": "fp32",
            "round_s": 1.0 / speed, "client_steps_per_s": speed}


def test_layout_table_analysis_refits_the_threshold():
    """A synthetic CPU table (``fedjax_rcl.engine.layout.analyse_table``, what
    ``tools/fit_layout.py`` prints): MOON's CNN fastest side by side, ResNet-10 at width 16 one
    at a time; the fit is the geometric mean of their step GFLOP, and the default's ratio to the
    best layout is computed per client count."""
    gflop = {"cnn": 0.196, "resnet10:16": 4.85}  # their training steps at batch 50
    rows = [_row("cnn", 5, "side-by-side", 200), _row("cnn", 5, "one-at-a-time", 150),
            _row("cnn", 5, "sequential", 140),
            _row("resnet10:16", 5, "side-by-side", 10), _row("resnet10:16", 5, "one-at-a-time", 14),
            _row("resnet10:16", 5, "sequential", 14.5)]
    asked = []

    def step_gflop(spec, batch):
        asked.append((spec, batch))
        return gflop[spec]

    result = layout.analyse_table({"machine": "test, 2 cores, cpu, jax", "rows": rows},
                                  step_gflop)
    assert result["platform"] == "cpu"
    assert sorted(asked) == [("cnn", 50), ("resnet10:16", 50)]  # each model once, its batch
    cnn, r10 = result["models"]["cnn"], result["models"]["resnet10:16"]
    assert cnn["verdict"] == "side-by-side" and r10["verdict"] == "one-at-a-time"
    assert cnn["gflop"] == 0.196
    assert result["fitted"] == pytest.approx((0.196 * 4.85) ** 0.5)
    assert result["threshold"] == layout.SIDE_BY_SIDE_BELOW_GFLOP["cpu"]
    # The package's default on a CPU picks each model's best compiled layout here.
    assert cnn["default"] == "side-by-side" and cnn["ratio"][5] == 1.0
    assert r10["default"] == "one-at-a-time"
    assert r10["ratio"][5] == pytest.approx(14 / 14.5)  # the Python loop was best


def test_layout_tables_measured_in_stages_merge_in_order():
    """tools/gpu_check.py measures layouts in stages (one bench_round.py run each, the most
    telling first) and merges them into one layouts.json (``layout.merge_tables``) that the
    analysis reads; the merged rows keep every stage's rows in order and say which stage
    measured them."""
    machine = "test, 16 cores, gpu (test), jax"
    stage0 = [_row("cnn", 10, "side-by-side", 300), _row("cnn", 10, "one-at-a-time", 200)]
    stage1 = [_row("resnet10:16", 10, "side-by-side", 9), _row("resnet10:16", 10,
                                                              "one-at-a-time", 12)]
    docs = [{"machine": machine, "matmul_peak_gflops": 1.0, "rows": rows}
            for rows in (stage0, stage1)]
    assert layout.merge_tables([]) is None  # no stage finished: nothing to write
    merged = layout.merge_tables(docs)
    assert merged["machine"] == machine
    assert [(r["model"], r["mode"], r["stage"]) for r in merged["rows"]] == [
        ("cnn", "side-by-side", 0), ("cnn", "one-at-a-time", 0),
        ("resnet10:16", "side-by-side", 1), ("resnet10:16", "one-at-a-time", 1)]
    assert [r["stage"] for r in layout.merge_tables(docs[1:], [1])["rows"]] == [1, 1]
    result = layout.analyse_table(merged, lambda spec, batch: {"cnn": 0.196,
                                                               "resnet10:16": 4.85}[spec])
    assert result["platform"] == "gpu"
    assert result["models"]["cnn"]["verdict"] == "side-by-side"
    assert result["models"]["resnet10:16"]["verdict"] == "one-at-a-time"


def test_bench_pfl_gives_pfl_the_time_left_to_start_within_its_budget():
    """A short budget (the GPU speed script's pfl part) must end with ours measured and pfl
    reported as not answering, not with the command stopped from outside: pfl's start may
    take what is left of the budget less the passes' 20 s, at least 30 s, at most 10 min."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from bench_pfl import _start_timeout
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert _start_timeout(float("inf"), 5.0) == 600.0
    assert _start_timeout(120.0, 30.0) == 70.0
    assert _start_timeout(40.0, 30.0) == 30.0

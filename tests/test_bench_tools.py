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

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

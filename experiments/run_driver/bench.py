"""Rounds per second of one compiled single run, for two checkouts of the package, alternating.

Each trial is a fresh process (a package cannot be imported twice under one name) that runs
``fedjax_rcl.train(None, "rounds=20", "num_clients=10", "participation=0.5",
"local_epochs=1", "dataset=digits", "run_dir=...")`` and reads its ``metrics.jsonl``: the
loop's rounds per second after compiling (``rounds / elapsed_s`` of the last line: the loop's
clock starts after the compile) and the median ``round_s`` (one round and its evaluation).
The checkouts take turns, so drift of a shared machine falls on both alike::

    python experiments/run_driver/bench.py before=/tmp/before after=/tmp/after --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TRIAL = r"""
import json, sys
import fedjax_rcl
run_dir = sys.argv[1]
fedjax_rcl.train(None, "rounds=20", "num_clients=10", "participation=0.5", "local_epochs=1",
                 "dataset=digits", f"run_dir={run_dir}")
rows = [json.loads(x) for x in open(f"{run_dir}/metrics.jsonl")]
last = rows[-1]
print(json.dumps({"rounds": last["round"], "elapsed_s": last["elapsed_s"],
                  "rounds_per_s": last["round"] / last["elapsed_s"],
                  "median_round_s": sorted(r["round_s"] for r in rows)[len(rows) // 2]}))
"""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def trial(root: str, scratch: Path, name: str) -> dict:
    """One run of ``TRIAL`` with the package at ``root``."""
    run_dir = scratch / name
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", TRIAL, str(run_dir)], env=env, check=True,
                         capture_output=True, text=True, cwd=scratch)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="+", help="LABEL=PATH of a checkout's root")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args(argv)
    checkouts = [c.split("=", 1) for c in args.checkouts]
    results: dict[str, list[dict]] = {label: [] for label, _ in checkouts}
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.trials):
            for label, root in checkouts:
                r = trial(root, Path(scratch), f"{label}-{i}")
                results[label].append(r)
                print(f"trial {i + 1} {label}: {r['rounds_per_s']:.2f} rounds/s, median "
                      f"round {r['median_round_s']:.3f} s", flush=True)
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores visible)")
    for label, rows in results.items():
        rates = [r["rounds_per_s"] for r in rows]
        print(f"{label}: {statistics.median(rates):.2f} rounds/s median of "
              f"{', '.join(f'{x:.2f}' for x in rates)}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

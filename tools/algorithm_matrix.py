"""Every client algorithm with FedAvg's server, and FedRCL with every server optimizer, on the
default digits job from the command line; the best and last accuracy of each in one table.

    python tools/algorithm_matrix.py --rounds 30 --out experiments/results/algorithm_matrix

Each run is ``fedjax-rcl train rounds=N algorithm=A server.optimizer=S run_dir=...``; the
table (Markdown) and the per-run metrics are written under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path


def _runs(algorithms, optimizers):
    for a in algorithms:
        yield a, "fedavg"
    for s in optimizers:
        if s != "fedavg":
            yield "fedrcl", s


def main() -> None:
    from fedjax_rcl import registry

    registry.load_builtins()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default="experiments/results/algorithm_matrix")
    ap.add_argument("--only", nargs="+", help="algorithm names (default: every registered)")
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every run")
    args = ap.parse_args()
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    rows = []
    trainable = [n for n, e in registry.ALGORITHMS.items() if e.command == "train"]
    for algorithm, server in _runs(args.only or trainable,
                                   list(registry.SERVER_OPTIMIZERS)):
        name = f"{algorithm}-{server}"
        run_dir = out / "runs" / name
        if (run_dir / "metrics.jsonl").is_file():
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        cmd = ["fedjax-rcl", "train", f"rounds={args.rounds}", f"algorithm={algorithm}",
               f"server.optimizer={server}", f"run_dir={run_dir}", "checkpoint_every=0",
               *args.extra, "--no-progress"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"{name}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}", flush=True)
            rows.append((algorithm, server, None, None, None, wall, " ".join(cmd)))
            continue
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        best = max(m["test_accuracy"] for m in metrics)
        last = metrics[-1]
        rows.append((algorithm, server, best, last["test_accuracy"],
                     last["test_accuracy_ema"], wall, " ".join(cmd)))
        print(f"{name}: best {best:.4f} last {last['test_accuracy']:.4f} ({wall:.0f} s)",
              flush=True)
    cpu = platform.processor() or platform.machine()
    lines = [f"# Every algorithm on the default digits job, {args.rounds} rounds",
             "", f"`python tools/algorithm_matrix.py --rounds {args.rounds}` "
             f"({time.strftime('%Y-%m-%d')}, {cpu}, Python {sys.version.split()[0]}); "
             "each run is the command in the last column (defaults: 20 clients, 25 %, "
             "Dirichlet 0.3, 5 local epochs, the small CNN).", "",
             "| algorithm | server | best acc | last acc | last EMA | wall s | command |",
             "|---|---|---|---|---|---|---|"]
    fmt = lambda x: "failed" if x is None else f"{x:.4f}"
    for a, s, best, last, ema, wall, cmd in rows:
        lines.append(f"| {a} | {s} | {fmt(best)} | {fmt(last)} | {fmt(ema)} | {wall:.0f} | "
                     f"`{cmd}` |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

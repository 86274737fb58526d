"""Several seeds as one compiled program against one process per seed: wall time and peak memory.

    python tools/bench_grid.py                                   # the digits job, seeds 0 1 2
    CIFAR10_JPEG_ZIP=path/to/cifar10-jpeg.zip python tools/bench_grid.py \\
        --config experiments/cifar10_resnet10w16.yaml --rounds 3 algorithm=fedrcl

Both ways run the same runs through the command line, each in a fresh process: ``fedjax-rcl
train CONFIG 'seeds=[0,1,2]'`` (one process, one program) and ``fedjax-rcl train CONFIG
seed=s`` for each seed, one after another. Wall time is the whole command (start-up, data,
compile, rounds, checkpoints); peak memory is each process's maximum resident set. JAX's
persistent compilation cache is off (``FEDJAX_RCL_JAX_CACHE=0``), so every process compiles, as
on a fresh machine; with it on, the second and third separate processes would read the first's
program. The order of the ways alternates over ``--passes``. ``--runs-in-parallel 1 0`` times
the one program both ways: runs one after another inside it (1, the CPU's choice) and all side
by side (0, ``vmap``; what an accelerator that one small run leaves idle may want).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], env: dict) -> tuple[float, float]:
    """Wall seconds and peak RSS (GB) of ``python -m fedjax_rcl`` with ``args``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fedjax_rcl", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"fedjax-rcl {' '.join(args)} failed:\n{err[-2000:]}")
    return wall, usage.ru_maxrss / 2**20  # KiB -> GiB


def machine() -> str:
    """The processor as ``bench_round`` names it (model, family, AVX-512, cores, versions)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_round import machine as described

    return described()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value for every run")
    ap.add_argument("--config", help="a config YAML (default: the built-in digits job)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--json", type=Path,
                    help="also write the results here (rewritten after every timing)")
    ap.add_argument("--runs-in-parallel", type=int, nargs="+", default=[1],
                    help="the one program's runs_in_parallel, one way each (1: one after "
                         "another; 0: all side by side)")
    args = ap.parse_args(argv)
    env = {**os.environ, "FEDJAX_RCL_JAX_CACHE": "0"}
    base = ["train", "--no-progress", *([args.config] if args.config else []),
            *args.overrides, f"rounds={args.rounds}"]
    seeds = "[" + ",".join(map(str, args.seeds)) + "]"
    ways = [("grid" if k == 1 else f"grid runs_in_parallel={k}", k)
            for k in args.runs_in_parallel] + [("separate", None)]
    rows, med = [], {}

    def summarise() -> None:
        for way, _ in ways:
            walls = [r["wall_s"] for r in rows if r["way"] == way]
            if walls:
                med[way] = {"wall_s": statistics.median(walls),
                            "peak_rss_gb": max(r["peak_rss_gb"] for r in rows
                                               if r["way"] == way)}
        if args.json:  # after every timing, so a run cut short keeps what it measured
            args.json.write_text(json.dumps(
                {"machine": machine(), "config": args.config, "overrides": args.overrides,
                 "seeds": args.seeds, "rounds": args.rounds, "rows": rows, "medians": med},
                indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        for p in range(args.passes):
            for way, k in ways if p % 2 == 0 else ways[::-1]:
                if k is not None:
                    wall, rss = _run([*base, f"seeds={seeds}", f"runs_in_parallel={k}",
                                      f"run_dir={tmp}/g{k}-{p}"], env)
                else:
                    wall, rss = 0.0, 0.0
                    for s in args.seeds:
                        w, r = _run([*base, f"seed={s}", f"run_dir={tmp}/s{p}-{s}"], env)
                        wall, rss = wall + w, max(rss, r)
                rows.append({"pass": p, "way": way, "wall_s": wall, "peak_rss_gb": rss})
                print(f"pass {p}: {way:8s} {wall:7.1f} s, peak RSS {rss:.2f} GB", flush=True)
                summarise()
    sep = med["separate"]
    for way, _ in ways[:-1]:
        m = med[way]
        print(f"{len(args.seeds)} seeds x {args.rounds} rounds ({args.config or 'digits job'} "
              f"{' '.join(args.overrides)}): one program ({way}) {m['wall_s']:.1f} s, "
              f"{m['peak_rss_gb']:.2f} GB; separate processes {sep['wall_s']:.1f} s, "
              f"{sep['peak_rss_gb']:.2f} GB each; separate / one program: "
              f"{sep['wall_s'] / m['wall_s']:.2f}x  [{machine()}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

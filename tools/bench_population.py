"""Client populations from a thousand to a million: start-up, seconds a round, peak memory and
where the per-client state lives, for a stateless algorithm (FedAvg) and stateful ones (MOON,
SCAFFOLD), 10 and 100 clients a round.

    python tools/bench_population.py [--populations 1000 10000 100000 1000000] \
        [--per-round 10 100] [--algorithms fedavg moon scaffold] [--rounds 3]

Each case is its own process on synthetic 16x16 RGB images, ``--samples`` per client (an
equal split, so every population's clients hold the same data and a round's work is the same),
MOON's small CNN, one local epoch of one batch, ``partition_version=2``. A case whose
per-client table cannot be held stops before compiling with the run's own one-line message
(``refused``). With ``--client-states disk`` (or ``auto``) each case has a temporary run
directory, where a disk table keeps its files; the bytes they hold are reported.
Reported: the seconds from the start of ``build`` to the first round's start (partition,
data placement, table, compilation), the median seconds of the rounds after the first, the
process's peak resident memory and the start-up line's description of the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def synthetic(n: int, size: int = 16):
    import numpy as np

    from fedjax_rcl.data import ImageDataset

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    y = (np.arange(n) % 10).astype(np.int32)
    return ImageDataset("synthetic", x, y, x[:1000], y[:1000], tuple(map(str, range(10))),
                        (0.5, 0.5, 0.5), (0.29, 0.29, 0.29), True)


def worker(algorithm: str, population: int, per_round: int, rounds: int,
           samples: int, where: str, sampling: int) -> dict:
    data = synthetic(population * samples)
    run_dir = tempfile.mkdtemp(prefix="bench-population-") if where in ("auto", "disk") else None
    try:
        return _case(data, algorithm, population, per_round, rounds, samples, where, sampling,
                     run_dir)
    finally:
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


def _case(data, algorithm, population, per_round, rounds, samples, where, sampling, run_dir):
    import jax
    import numpy as np

    from fedjax_rcl.config import Config
    from fedjax_rcl.experiment import build
    from fedjax_rcl.training import compile_program
    from fedjax_rcl.validation import ConfigError

    cfg = Config(dataset="synthetic", model="cnn", algorithm=algorithm, num_clients=population,
                 participation=per_round / population, partition="iid", local_epochs=1,
                 batch_size=samples, partition_version=2, augment=False,
                 client_states=where, sampling_version=sampling, run_dir=run_dir)
    row = {"algorithm": algorithm, "population": population, "per_round": per_round,
           "client_states": where, "sampling_version": sampling}
    t0 = time.perf_counter()
    try:
        exp = build(cfg, data)
    except ConfigError as e:
        return {**row, "refused": str(e), "startup_s": time.perf_counter() - t0,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    advance = compile_program(exp).advance
    startup = time.perf_counter() - t0
    state, times = exp.state, []
    for _ in range(rounds):
        t = time.perf_counter()
        state, _ = advance(state, 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    placed = exp.cfg.client_states  # auto resolved
    store = Path(run_dir) / "client_table" if run_dir else None
    return {**row, "placed": placed, "startup_s": startup,
            "round_s": float(np.median(times[1:] or times)),
            "first_round_s": times[0], "table": exp.layout.split("client states ")[-1]
            if "client states" in exp.layout else "none",
            "rows_held": int(getattr(exp.table, "count", 0))
            if placed in ("sparse", "disk") else None,
            "disk_gb": sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) / 1e9
            if store and store.exists() else None,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    ap.add_argument("--populations", type=int, nargs="+",
                    default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--per-round", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--algorithms", nargs="+", default=["fedavg", "moon", "scaffold"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=2, help="training images per client")
    ap.add_argument("--client-states", default="device",
                    choices=["auto", "device", "host", "sparse", "disk"],
                    help="where a stateful algorithm's per-client table lives")
    ap.add_argument("--sampling-version", type=int, default=1, choices=[1, 2],
                    help="the client sampler (2: cost independent of the population)")
    ap.add_argument("--out", help="also write the rows as JSON lines here")
    args = ap.parse_args()
    if args.worker:
        a, p, m, r, n, where, sampling = args.worker
        print(json.dumps(worker(a, int(p), int(m), int(r), int(n), where, int(sampling))))
        return
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}")
    rows = []
    for algorithm in args.algorithms:
        for population in args.populations:
            for per_round in args.per_round:
                if per_round > population:
                    continue
                proc = subprocess.run([sys.executable, __file__, "--worker", algorithm,
                                       str(population), str(per_round), str(args.rounds),
                                       str(args.samples), args.client_states,
                                       str(args.sampling_version)],
                                      capture_output=True, text=True)
                if proc.returncode:
                    print(proc.stderr[-1500:], file=sys.stderr)
                    continue
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("\n| algorithm | clients | a round | start-up s | s / round | peak RSS GB | state |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        state = (f"refused: {r['refused'].split(': ', 1)[-1][:60]}..." if "refused" in r
                 else r["table"] + (f"; {r['rows_held']:,} rows held after {args.rounds} rounds"
                                    if r.get("rows_held") is not None else "")
                 + (f"; {r['disk_gb']:.2f} GB in files" if r.get("disk_gb") else ""))
        print(f"| {r['algorithm']} | {r['population']:,} | {r['per_round']} | "
              f"{r['startup_s']:.1f} | {r.get('round_s', float('nan')):.2f} | "
              f"{r['peak_rss_gb']:.2f} | {state} |")


if __name__ == "__main__":
    main()

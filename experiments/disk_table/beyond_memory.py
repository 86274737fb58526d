"""MOON's per-client table larger than this machine's memory, held on disk.

A million clients, 100 a round, MOON's CNN on synthetic 16x16 images (2 per client, one local
step a round: the population benchmark's case, ``tools/bench_population.py``), run for enough
rounds that the rows of the clients who trained outgrow host memory. ``client_states=auto``
chooses where the table lives from the estimate made before anything is built; the start-up
line says what it chose. Every ``--chunk`` rounds one JSON line: rounds done, seconds a round
over the chunk, rows held, bytes in the table's files, the process's resident memory and the
machine's available memory.

    python experiments/disk_table/beyond_memory.py --rounds 1500 --run-dir ~/.cache/x \
        --out experiments/disk_table/beyond_memory.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

import jax
import numpy as np

from fedjax_rcl.config import Config
from fedjax_rcl.data import ImageDataset
from fedjax_rcl.experiment import build
from fedjax_rcl.training import compile_program


def synthetic(n: int, size: int = 16) -> ImageDataset:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    y = (np.arange(n) % 10).astype(np.int32)
    return ImageDataset("synthetic", x, y, x[:1000], y[:1000], tuple(map(str, range(10))),
                        (0.5, 0.5, 0.5), (0.29, 0.29, 0.29), True)


def meminfo(key: str, path: str = "/proc/meminfo") -> float:
    """A /proc value in GB (kB there)."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--population", type=int, default=1_000_000)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1500)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--client-states", default="auto", help="auto (the run's estimate) or a place")
    ap.add_argument("--run-dir", required=True, help="where the table's files go (removed after)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    run_dir = Path(args.run_dir).expanduser()
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = Config(dataset="synthetic", model="cnn", algorithm="moon",
                 num_clients=args.population, participation=args.per_round / args.population,
                 partition="iid", local_epochs=1, batch_size=args.samples, partition_version=2,
                 augment=False, client_states=args.client_states, sampling_version=2,
                 rounds=args.rounds, run_dir=str(run_dir))
    out = open(args.out, "w")

    def emit(row: dict) -> None:
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row), flush=True)

    t0 = time.perf_counter()
    exp = build(cfg, synthetic(args.population * args.samples))
    advance = compile_program(exp).advance
    emit({"machine": platform.processor() or platform.machine(),
          "cpus": len(jax.devices()), "host_memory_gb": meminfo("MemTotal"),
          "startup_s": time.perf_counter() - t0, "placed": exp.cfg.client_states,
          "layout": exp.layout, "jax": jax.__version__})
    store = run_dir / "client_table" / "store"
    state, done = exp.state, 0
    try:
        while done < args.rounds:
            n = min(args.chunk, args.rounds - done)
            t = time.perf_counter()
            state, _ = advance(state, n)
            jax.block_until_ready(state)
            done += n
            emit({"rounds": done, "s_per_round": (time.perf_counter() - t) / n,
                  "rows_held": getattr(exp.table, "count", None),
                  "store_gb_allocated": sum(f.stat().st_blocks * 512 for f in store.iterdir())
                  / 1e9 if store.exists() else 0.0,
                  "rss_gb": meminfo("VmRSS", "/proc/self/status"),
                  "mem_available_gb": meminfo("MemAvailable")})
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

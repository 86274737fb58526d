"""Peak memory of MOON's per-client state table on device vs in host memory.

    python tools/bench_memory.py [--model resnet18] [--clients 100]

Each choice runs in its own process: build the run (the table holds every client's previous
local model, initialised to the global model), then one round with one sampled client of 100
samples and one local epoch. Reports the table's size and the process's peak RSS. On a CPU both
live in the same RAM, so the difference is the copies the device-resident table costs (the
broadcast at initialisation, the scatter inside the round); on a GPU/TPU the host choice keeps
the whole table out of accelerator memory and moves only the sampled rows.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(model: str, clients: int, where: str) -> dict:
    import jax
    import numpy as np
    from bench_round import fake_cifar

    from fedjax_rcl.config import Config
    from fedjax_rcl.experiment import build
    from fedjax_rcl.training import compile_program

    cfg = Config(dataset="fake", model=model, algorithm="moon", num_clients=clients,
                 participation=1 / clients, partition="iid", local_epochs=1, batch_size=50,
                 client_states=where)
    exp = build(cfg, fake_cifar(100 * clients))
    table = exp.table.rows if where == "host" else exp.state.client_states
    table_gb = sum(np.asarray(x).nbytes for x in jax.tree.leaves(table)) / 2**30
    advance = compile_program(exp).advance
    t = time.perf_counter()
    state, _ = advance(exp.state, 1)
    jax.block_until_ready(state)
    return {"where": where, "model": model, "clients": clients, "table_gb": table_gb,
            "round_s": time.perf_counter() - t,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.worker[2])))
        return
    rows = []
    for where in ("device", "host"):
        proc = subprocess.run([sys.executable, __file__, "--worker", args.model,
                               str(args.clients), where], capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-2000:])
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    text = ("| model | clients | client_states | table GB | peak RSS GB | one round s |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(
                f"| {r['model']} | {r['clients']} | {r['where']} | {r['table_gb']:.2f} | "
                f"{r['peak_rss_gb']:.2f} | {r['round_s']:.1f} |" for r in rows))
    print(text)
    if not args.no_append:
        with open(ROOT / "benchmarks" / "HISTORY.md", "a") as f:
            f.write(f"\n## MOON client-state table: device vs host ({time.strftime('%Y-%m-%d')})"
                    f"\n\n`python tools/bench_memory.py --model {args.model} --clients "
                    f"{args.clients}` (one round, one client of 100 samples, one epoch).\n\n"
                    + text + "\n")


if __name__ == "__main__":
    main()

"""Max-pooling as a reshape and a max (the package's) against the maximum of the window's
strided slices, in MOON's CNN rounds, alternating in one run.

The per-kernel profile (README) has the pooling's YNNPACK reduce fusions at 1-4 GB/s. The
maximum of the k*k strided slices (``x[:, i::k, j::k]``) is the same function (values; the
gradient on inputs without ties) as an element-wise chain that XLA fuses as a loop, not a
reduction. Each setting runs `tools/bench_round.py`'s worker (the compiled round, its default
client layout, the paper's local work) in a fresh process, the CNN's pooling replaced for the
``slices`` setting; prints the medians and the paired ratios and writes them as JSON.

    python experiments/small_model_speed/pool_ab.py --passes 2 --json pool_ab.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def slice_max_pool(x, window: int):
    """``nn.pool.max_pool`` as the maximum of the window's strided slices."""
    import jax.numpy as jnp

    b, h, w, c = x.shape
    ho, wo = h // window, w // window
    x = x[:, : ho * window, : wo * window]
    parts = [x[:, i::window, j::window] for i in range(window) for j in range(window)]
    return functools.reduce(jnp.maximum, parts)


def _worker(spec: dict, pool: str) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    if pool == "slices":
        import fedjax_rcl.models.cnn as cnn

        cnn.max_pool = slice_max_pool
    from bench_round import worker

    print(json.dumps(worker(spec)), flush=True)


def run(spec: dict, pool: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec), "--pool", pool]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ),
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--algorithms", nargs="+", default=["fedavg", "moon", "fedrcl"])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--pool", default="reshape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(json.loads(args.worker), args.pool)
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_round import machine

    pools = ("reshape", "slices")
    times: dict = {(a, p): [] for a in args.algorithms for p in pools}
    for k in range(args.passes):
        for a in args.algorithms:
            for p in pools:
                spec = {"model": "cnn", "algorithm": a, "clients": args.clients,
                        "mode": "vmap", "repeats": 3}
                r = run(spec, p)
                times[(a, p)].append(r["round_s"])
                print(f"pass {k} {a:7s} {p:8s} {r['round_s']:.3f} s a round", flush=True)
    rows = []
    for a in args.algorithms:
        d, n = times[(a, "reshape")], times[(a, "slices")]
        ratios = [y / x for x, y in zip(d, n, strict=True)]
        rows.append({"algorithm": a, "reshape_s": d, "slices_s": n,
                     "median_reshape_s": statistics.median(d),
                     "median_slices_s": statistics.median(n), "paired_ratios": ratios})
        print(f"{a:7s} reshape {statistics.median(d):.3f} s, slices {statistics.median(n):.3f}"
              " s, slices/reshape per pass " + ", ".join(f"{r:.2f}" for r in ratios))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "model": "cnn",
                                         "clients": args.clients, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

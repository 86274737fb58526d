"""Where one compiled round's time goes, by kernel category (convolutions, matrix products,
element-wise fusions, copies) and by operation: the round ``tools/bench_round.py`` times, run
once under the JAX profiler and summarised by ``fedjax_rcl.bench.trace_summary``.

    python tools/profile_round.py                       # FedRCL, ResNet-18, 5 clients
    python tools/profile_round.py --model cnn --clients 10 --json out.json

Synthetic CIFAR-shaped images (speed only); ``--clients`` of 100 take part, each with 100
samples, one local epoch of batch 50 (ResNet-18's CPU setting in ``bench_round.py``): two
steps, the first of which finds caches and fresh buffers cold; ``--local-epochs`` gives each
client more steps, so that an operation's time is that of a step in a long round.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
from bench_round import (  # this folder: the benchmark's synthetic images, the machine
    copy_bandwidth_gbs,
    fake_cifar,
    machine,
    matmul_peak_gflops,
)

from fedjax_rcl.bench import trace_summary
from fedjax_rcl.config import Config
from fedjax_rcl.experiment import build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--algorithm", default="fedrcl")
    p.add_argument("--norm", default="group")
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--clients-in-parallel", type=int, default=1,
                   help="the round's client layout (0: the cost model's choice)")
    p.add_argument("--local-epochs", type=int, default=1,
                   help="local epochs of two steps each (1: the profiles in BENCHMARKS.md)")
    p.add_argument("--top", type=int, default=15, help="operations listed")
    p.add_argument("--json", help="write the whole summary here")
    args = p.parse_args()

    cfg = Config(dataset="fake", model=args.model, algorithm=args.algorithm, norm=args.norm,
                 num_clients=100, participation=args.clients / 100, partition="iid",
                 local_epochs=args.local_epochs, batch_size=50,
                 clients_in_parallel=args.clients_in_parallel)
    exp = build(cfg, fake_cifar(100 * 100))
    compiled = jax.jit(exp.run_round).lower(exp.state, exp.data).compile(exp.compiler_options)
    jax.block_until_ready(compiled(exp.state, exp.data))  # warm-up: kernels picked, memory held
    with tempfile.TemporaryDirectory() as log_dir:
        summary = trace_summary.profile(
            lambda: jax.block_until_ready(compiled(exp.state, exp.data)), compiled.as_text(),
            log_dir, top=max(args.top, 400))
    shares = summary["shares"]
    print(f"{args.algorithm}, {args.model} ({args.norm} norm), {args.clients} clients: "
          f"{summary['wall_s']:.3f} s")
    for k, v in summary["seconds"].items():
        print(f"  {k:12s} {v:8.3f} s  {100 * shares[k]:5.1f} %  "
              f"({summary['counts'][k]} operations run)")
    print(f"  idle share of the span: {100 * summary['idle_share_of_span']:.1f} %")
    shared = summary["overlapped_s"]
    print("  time shared with another thread's operations (the cores not to themselves): "
          + ", ".join(f"{k} {shared[k]:.3f} s of {summary['seconds'][k]:.3f} s"
                      for k in ("convolution", "elementwise") if summary["seconds"][k]))
    peak, bandwidth, cached = matmul_peak_gflops(), copy_bandwidth_gbs(), copy_bandwidth_gbs(2)
    print(f"the machine: float32 matmul peak {peak:.1f} GFLOP/s, memory bandwidth "
          f"{bandwidth:.1f} GB/s (in a 2 MiB working set {cached:.1f} GB/s)")
    for k in ("convolution", "matmul", "elementwise", "copy"):
        gb = f"{summary['gb_s'][k]:6.1f} GB/s ({100 * summary['gb_s'][k] / bandwidth:5.1f} %)"
        print(f"  {k:12s} " + (f"{summary['gflop_s'][k]:6.1f} GFLOP/s ("
                                f"{100 * summary['gflop_s'][k] / peak:4.1f} % of peak), "
                                if k in ("convolution", "matmul") else "") + gb)
    print("costliest operations (per run: FLOPs, bytes; over the call: GFLOP/s, GB/s):")
    for o in summary["top_ops"][:args.top]:
        rates = (f"  {o['flops']:>11,d} {o['bytes']:>11,d}  {o['gflop_s']:6.1f} "
                 f"{o['gb_s']:6.1f}" if "flops" in o else "")
        print(f"  {o['op']:32s} {o['category']:12s} {o['s']:.4f} s over {o['count']:5d} runs"
              + rates + (f"  {o['what']}" if o.get("what") else ""))
    if args.json:
        summary.pop("trace", None)
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "machine": machine(), "matmul_peak_gflops": peak,
                       "copy_bandwidth_gbs": bandwidth,
                       "copy_bandwidth_2mib_gbs": cached, **summary}, f, indent=1)


if __name__ == "__main__":
    main()

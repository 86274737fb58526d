"""Step time of each CPU-scale model candidate for FedRCL experiments (FedRCL fidelity issue).

For each model (name, width) and algorithm, the compiled round of ONE client doing 10 local
steps of batch 50 (one local epoch of a 500-sample client, the paper's client size) is timed,
plus the evaluation of 10,000 test images; the table gives ms per client-step and the implied
time of one paper round (5 clients x 5 epochs x 10 steps + evaluation). All configurations run
in one process, alternating over ``--passes`` passes (medians), so their ratios are taken
under the same machine conditions.

    python tools/bench_models.py                 # the default candidates
    python tools/bench_models.py --passes 3 --append   # and append it to benchmarks/HISTORY.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CANDIDATES = (("cnn", None), ("resnet10", 16), ("resnet18", 16), ("resnet10", 32),
              ("resnet18", 32), ("resnet18", 64))


def _params(state) -> int:
    import jax

    return sum(x.size for x in jax.tree.leaves(state.params))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--algorithms", nargs="+", default=["fedavg", "fedrcl"])
    ap.add_argument("--models", nargs="+", default=[f"{m}:{w or ''}" for m, w in CANDIDATES],
                    help="name:width, e.g. resnet10:16 (empty width: the model's default)")
    ap.add_argument("--append", action="store_true",
                    help="append the table to benchmarks/HISTORY.md")
    args = ap.parse_args()

    import jax
    from bench_round import convolutions, fake_cifar, machine

    from fedjax_rcl.config import Config
    from fedjax_rcl.experiment import build

    data = fake_cifar(100 * 500)
    built = {}
    for spec in args.models:
        name, _, width = spec.partition(":")
        for algorithm in args.algorithms:
            cfg = Config(dataset="fake", model=name, width=int(width) if width else None,
                         algorithm=algorithm, num_clients=100, participation=0.01,
                         partition="iid", local_epochs=1, batch_size=50)
            exp = build(cfg, data)
            t = time.perf_counter()
            step = exp.compile_rounds(1)
            compile_s = time.perf_counter() - t
            state, _ = step(exp.state, 1)  # warm-up
            jax.block_until_ready(state)
            jax.block_until_ready(exp.evaluate(state.params, state.model_state, exp.test))
            built[(spec, algorithm)] = dict(exp=exp, step=step, state=state, train=[], eval=[],
                                            compile_s=compile_s, params=_params(state))
            print(f"built {spec} {algorithm} (compile {compile_s:.1f} s)", flush=True)

    for _ in range(args.passes):
        for key, b in built.items():
            t = time.perf_counter()
            b["state"], _ = b["step"](b["state"], 1)
            jax.block_until_ready(b["state"])
            b["train"].append(time.perf_counter() - t)
            if key[1] == args.algorithms[0]:
                exp = b["exp"]
                t = time.perf_counter()
                jax.block_until_ready(exp.evaluate(b["state"].params, b["state"].model_state,
                                                   exp.test))
                b["eval"].append((time.perf_counter() - t) * 10_000 / int(exp.test.mask.sum()))

    evals = {spec: statistics.median(built[(spec, args.algorithms[0])]["eval"])
             for spec in args.models}
    rows = []
    lines = ["| model | width | parameters | algorithm | ms / client-step (batch 50) | "
             "eval 10k images s | paper round s (5 clients x 50 steps + eval) | compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for (spec, algorithm), b in built.items():
        name, _, width = spec.partition(":")
        step_ms = statistics.median(b["train"]) / 10 * 1e3
        rows.append(dict(model=name, width=int(width) if width else None, algorithm=algorithm,
                         parameters=b["params"], ms_per_client_step=step_ms,
                         eval_10k_s=evals[spec], compile_s=b["compile_s"],
                         train_passes_s=b["train"]))
        lines.append(f"| {name} | {width or 'default'} | {b['params']:,} | {algorithm} | "
                     f"{step_ms:.1f} | {evals[spec]:.1f} | {250 * step_ms / 1e3 + evals[spec]:.0f}"
                     f" | {b['compile_s']:.1f} |")
    header = (f"\n## Model candidates for CPU-scale FedRCL ({time.strftime('%Y-%m-%d')}; "
              f"{machine()})\n\n`python tools/bench_models.py "
              f"{' '.join(sys.argv[1:])}`; convolutions: {convolutions()}; medians of "
              f"{args.passes} passes in rotation, one process.\n\n")
    text = header + "\n".join(lines) + "\n"
    print(text)
    (ROOT / "benchmarks" / f"models-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps({"machine": machine(), "convolutions": convolutions(), "rows": rows},
                   indent=1))
    if args.append:
        with open(ROOT / "benchmarks" / "HISTORY.md", "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()

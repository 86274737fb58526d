"""The client-layout table and the cost model's fit, from ``tools/bench_round.py --json`` files.

    python tools/bench_round.py --no-append --json lay.json --algorithms fedavg \\
        --models cnn pfl_cnn resnet10:16 resnet18 --clients 1 5 10 50 \\
        --modes side-by-side side-by-side-patches one-at-a-time sequential
    python tools/fit_layout.py lay.json [--md table.md]

For every model: one client's training-step GFLOP (counted by ``fedjax_rcl.engine.layout`` from
the model's program, at the benchmark's batch), client-steps/s of every measured layout at every
client count, the layout the default (``clients_in_parallel=0``) picks on that platform, and
its speed as a fraction of the best measured layout (the acceptance: >= 0.95). Then the
threshold ``layout.fit_threshold`` derives from the table (the geometric mean of the largest
step whose best compiled layout is side by side and the smallest whose best is one at a time),
beside the one the package uses. A model whose two compiled layouts are within 5 % of each
other at every client count constrains nothing. The analysis is
``fedjax_rcl.engine.layout.analyse_table``; this script counts the GFLOP and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def step_gflop(spec: str, batch: int) -> float:
    """One client's training step of model spec ``name`` or ``name:width`` at ``batch``."""
    import jax
    import numpy as np

    from fedjax_rcl.experiment import training_step_gflop
    from fedjax_rcl.models import get_model, model_fns

    name, _, width = spec.partition(":")
    kw = {"width": int(width)} if width else {}
    m = model_fns(get_model(name, num_classes=10, **kw))
    params, state = m.init(jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3)))
    return training_step_gflop(m, params, state, (32, 32, 3), batch)


def analyse(doc: dict, platform: str | None = None) -> dict:
    """``fedjax_rcl.engine.layout.analyse_table`` with the models' step GFLOP counted here."""
    from fedjax_rcl.engine import layout

    return layout.analyse_table(doc, step_gflop, platform)


def markdown(result: dict) -> str:
    from fedjax_rcl.engine.layout import APART, SIDE

    modes = [SIDE, "side-by-side-patches", "side-by-side-native", APART, "sequential"]
    lines = [f"Machine: {result['machine']}", "",
             "| model | step GFLOP | clients | " + " | ".join(modes)
             + " | default | default / best |",
             "|---|---|---|" + "---|" * len(modes) + "---|---|"]
    for spec, m in result["models"].items():
        for k, speeds in sorted(m["speed"].items()):
            best = max(speeds.values())
            cells = [f"**{speeds[x]:.1f}**" if x in speeds and speeds[x] == best
                     else (f"{speeds[x]:.1f}" if x in speeds else "") for x in modes]
            ratio = m["ratio"].get(k)
            lines.append(f"| {spec} | {m['gflop']:.3g} | {k} | " + " | ".join(cells)
                         + f" | {m['default']} | {'' if ratio is None else f'{ratio:.2f}'} |")
    fitted = result["fitted"]
    lines += ["", "Client-steps/s (best of each row in bold). Per model, the compiled layout "
              "within 5 % of the best at every client count > 1: "
              + ", ".join(f"{s}: {m['verdict']}" for s, m in result["models"].items()) + ".",
              f"Threshold fitted to this table: "
              f"{'not separable / one kind only' if fitted is None else f'{fitted:.3g} GFLOP'};"
              f" the package's for {result['platform']}: {result['threshold']} GFLOP."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", type=Path, help="bench_round.py --json outputs (one "
                    "machine; later files add rows)")
    ap.add_argument("--platform", choices=("cpu", "gpu", "tpu"),
                    help="default: read from the files' machine line")
    ap.add_argument("--md", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    from fedjax_rcl.engine.layout import merge_tables

    doc = merge_tables([json.loads(p.read_text()) for p in args.json])
    text = markdown(analyse(doc, args.platform))
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

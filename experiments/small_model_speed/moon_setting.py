"""MOON's Table 1 setting: seconds a round with the small CNNs' no-YNNPACK switch and with XLA's
default fusions, alternating, fresh processes.

The setting is `experiments/paper/moon_table1_cifar10.yaml`'s (10 parties, all every round,
batch 64, MOON mu 5 on `moon_cnn`, SGD with momentum; CIFAR-10 from the JPEG zip named by
$CIFAR10_JPEG_ZIP), one local epoch instead of ten (a round of ten epochs is ten of these:
the same steps, one after another). XLA's default is
given as `--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_REDUCE` in `XLA_FLAGS`
(the same programs as no flag at all before the switch: `ynn_types.json`), which wins over the
model's option; the switch is the model's option alone.

    CIFAR10_JPEG_ZIP=/path/cifar10-jpeg.zip \
        python experiments/small_model_speed/moon_setting.py --passes 2 --json moon_setting.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"xla-default": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_REDUCE",
            "switch": ""}


def worker(spec: dict) -> None:
    import jax

    from fedjax_rcl.config import load_config
    from fedjax_rcl.experiment import build

    cfg = load_config(str(ROOT / "experiments/paper/moon_cifar10_cnn.yaml"),
                      [f"algorithm={spec['algorithm']}", "local_epochs=1", "rounds=3",
                       f"dataset=imagefolder:{os.environ['CIFAR10_JPEG_ZIP']}"])
    exp = build(cfg)
    t0 = time.perf_counter()
    advance = exp.compile_rounds(1)
    compile_s = time.perf_counter() - t0
    state = exp.state
    times = []
    for _ in range(spec["rounds"]):
        t = time.perf_counter()
        state, _ = advance(state, 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    print(json.dumps({"compile_s": compile_s, "round_s": times,
                      "compiler_options": exp.compiler_options}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds a process (the first "
                    "is reported apart: warm-up)")
    ap.add_argument("--algorithm", default="moon")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_round import machine

    out = {"machine": machine(), "algorithm": args.algorithm, "passes": []}
    for p in range(args.passes):
        row = {}
        for name, flag in SETTINGS.items():
            env = dict(os.environ)
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
            spec = {"algorithm": args.algorithm, "rounds": args.rounds}
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                  capture_output=True, text=True, env=env, check=True)
            row[name] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(p, name, row[name], flush=True)
        out["passes"].append(row)
    last = {k: [r[k]["round_s"][-1] for r in out["passes"]] for k in SETTINGS}
    out["ratio_switch_over_default"] = [s / d for s, d in
                                        zip(last["switch"], last["xla-default"], strict=True)]
    out["median_round_s"] = {k: statistics.median(v) for k, v in last.items()}
    print(json.dumps({k: out[k] for k in ("ratio_switch_over_default", "median_round_s")}))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

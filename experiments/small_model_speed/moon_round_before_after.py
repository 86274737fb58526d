"""MOON's Table 1 round (`experiments/paper/moon_cifar10_cnn.yaml`: 10 parties of CIFAR-10,
all every round, 10 local epochs of batch 64, mu 5, `moon_cnn`) as issue 68 found it and as the
package runs it now, in one run: fresh processes in rotation, one round timed after compiling.

- ``before``: the clients side by side (the cost model's choice then), XLA's default fusions
  (YNNPACK's, `--xla_cpu_experimental_ynn_fusion_type=reduce`, which the user's `XLA_FLAGS`
  gives back over the model's option) and libgomp's default spin (`GOMP_SPINCOUNT=300000`
  alone, libgomp's own value, which keeps the model's thread settings out);
- ``spin``: one client after another, no YNNPACK fusions, OpenMP's spin, and XLA's fusions of
  the convolutions' bias, ReLU and pool (the first ``after``, 2026-11-30);
- ``batched``: the bias + ReLU + pool kernel (``fedjax_rcl.nn.pool.bias_relu_max_pool``), the
  convolutions and pools taking all the clients in one call, the layout the cost model then
  picks (side by side since its refit to those), every convolution on oneDNN (the second
  ``after``, 2026-11-30; ``nn.narrow_conv.MODE="off"``);
- ``narrow``: as ``batched``, with ``fedjax_rcl.nn.narrow_conv``'s kernel for the convolutions
  with few output channels: conv1's forward, conv2's input gradient (the third ``after``,
  2026-11-30; ``data.augment.KERNEL="off"``);
- ``after``: the defaults (as ``narrow``, with the training augmentation on the CPU kernel of
  ``fedjax_rcl.data.augment``: bitwise the same images).

``before`` and ``spin`` run the pools as XLA's fusions and the convolutions under vmap as one
FFI call per client (``_kernels_then``, in their processes); all but ``narrow`` and ``after``
run every convolution on oneDNN; all but ``after`` the augmentation as XLA's gather.

    CIFAR10_JPEG_ZIP=/path/cifar10-jpeg.zip \\
        python experiments/small_model_speed/moon_round_before_after.py --passes 2 --json out.json
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {  # name: (environment, config overrides, the package's kernels then)
    "before": ({"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=reduce",
                "GOMP_SPINCOUNT": "300000"}, ["clients_in_parallel=10"], "then"),
    "spin": ({}, ["clients_in_parallel=1"], "then"),
    "batched": ({}, [], "batched"),
    "narrow": ({}, [], "narrow"),
    "after": ({}, [], "now"),
}


def _kernels_then() -> None:
    """This process's pools as XLA's fusions, and its convolutions under vmap one FFI call per
    client (XLA's loop), as the package ran them before the pool kernel and the one-call change."""
    from fedjax_rcl.nn import onednn, pool

    pool.resolve_impl = lambda *_: "xla"
    call = onednn.call

    def sequential(target, *args, vmap_method="sequential", **kwargs):
        return call(target, *args, vmap_method="sequential", **kwargs)

    onednn.call = sequential
CLEAR = ("XLA_FLAGS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def child(name: str) -> None:
    import jax

    from fedjax_rcl.config import load_config
    from fedjax_rcl.experiment import build
    from fedjax_rcl.training import compile_program

    if SETTINGS[name][2] == "then":
        _kernels_then()
    if SETTINGS[name][2] in ("then", "batched"):
        from fedjax_rcl.nn import narrow_conv

        narrow_conv.MODE = "off"  # every convolution on oneDNN, as before that kernel
    if SETTINGS[name][2] != "now":
        from fedjax_rcl.data import augment

        augment.KERNEL = "off"  # XLA's gather, as before the augmentation kernel
    cfg = load_config(str(ROOT / "experiments/paper/moon_cifar10_cnn.yaml"),
                      ["algorithm=moon", "rounds=2", *SETTINGS[name][1],
                       f"dataset=imagefolder:{os.environ['CIFAR10_JPEG_ZIP']}"])
    exp = build(cfg)
    t = time.perf_counter()
    advance = compile_program(exp).advance
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    state, _ = advance(exp.state, 1)
    jax.block_until_ready(state)
    print(json.dumps({"setting": name, "layout": exp.layout, "compile_s": round(compile_s, 2),
                      "round_s": round(time.perf_counter() - t, 2),
                      "env": {k: os.environ.get(k) for k in CLEAR}}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--child", choices=sorted(SETTINGS))
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    rows = []
    for p in range(args.passes):
        for name in args.settings:
            env = SETTINGS[name][0]
            run_env = {k: v for k, v in os.environ.items() if k not in CLEAR} | env
            out = subprocess.run([sys.executable, __file__, "--child", name], env=run_env,
                                 capture_output=True, text=True, check=True).stdout
            rows.append({"pass": p + 1, **json.loads(out.splitlines()[-1])})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

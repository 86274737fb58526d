"""The oneDNN convolutions under vmap (clients side by side): XLA's loop over the clients, one
FFI call each (``vmap_method="sequential"``, the package before) against one call for all the
clients that loops over them on slices of the stacked buffers (``"expand_dims"``, now), in
MOON's Table 1 setting cut to one local epoch, one fresh process per call: the seconds of two
rounds after compiling.

    CIFAR10_JPEG_ZIP=/path/cifar10-jpeg.zip python \\
        experiments/small_model_speed/batched_conv_calls.py {sequential,batched} ALGORITHM \\
        [KEY=VALUE ...]     # e.g. fedavg model=cnn clients_in_parallel=10
"""

import json
import os
import sys
import time
from pathlib import Path

import jax

from fedjax_rcl.nn import onednn

ROOT = Path(__file__).resolve().parents[2]


def main(setting: str, algorithm: str, overrides: list[str]) -> None:
    from fedjax_rcl.config import load_config
    from fedjax_rcl.experiment import build
    from fedjax_rcl.training import compile_program

    if setting == "sequential":  # the convolutions' calls as before: one per client
        call = onednn.call

        def sequential(target, *args, vmap_method="sequential", **kwargs):
            if target in onednn.TARGETS:
                vmap_method = "sequential"
            return call(target, *args, vmap_method=vmap_method, **kwargs)

        onednn.call = sequential
    cfg = load_config(str(ROOT / "experiments/paper/moon_cifar10_cnn.yaml"),
                      [f"algorithm={algorithm}", "local_epochs=1", "rounds=3",
                       f"dataset=imagefolder:{os.environ['CIFAR10_JPEG_ZIP']}", *overrides])
    exp = build(cfg)
    advance = compile_program(exp).advance
    state, times = exp.state, []
    for _ in range(2):
        t = time.perf_counter()
        state, _ = advance(state, 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    print(json.dumps({"setting": setting, "algorithm": algorithm, "overrides": overrides,
                      "layout": exp.layout, "round_s": times}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])

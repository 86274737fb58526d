"""MOON's Table 1 setting (`experiments/paper/moon_cifar10_cnn.yaml`: 10 parties, all every
round, batch 64, `moon_cnn`) cut to one local epoch, with the clients side by side (the cost
model's choice, `clients_in_parallel=0`) and one after another (`1`), or any other layout: the
seconds of two rounds after compiling, one fresh process per call.

    CIFAR10_JPEG_ZIP=/path/cifar10-jpeg.zip \
        python experiments/small_model_speed/layout_moon_setting.py CLIENTS_IN_PARALLEL ALGORITHM
"""

import json
import os
import sys
import time
from pathlib import Path

import jax

from fedjax_rcl.config import load_config
from fedjax_rcl.experiment import build
from fedjax_rcl.training import compile_program

ROOT = Path(__file__).resolve().parents[2]


def time_rounds(algorithm: str, overrides: list[str]):
    """MOON's setting with ``algorithm``, one local epoch, ``overrides`` on top: the built
    experiment, the seconds to compile its round, and the seconds of two rounds after that
    (also what `pool_kernel.py` and `batched_conv_calls.py` time)."""
    cfg = load_config(str(ROOT / "experiments/paper/moon_cifar10_cnn.yaml"),
                      [f"algorithm={algorithm}", "local_epochs=1", "rounds=3",
                       f"dataset=imagefolder:{os.environ['CIFAR10_JPEG_ZIP']}", *overrides])
    exp = build(cfg)
    t = time.perf_counter()
    advance = compile_program(exp).advance
    compile_s = time.perf_counter() - t
    state, times = exp.state, []
    for _ in range(2):
        t = time.perf_counter()
        state, _ = advance(state, 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    return exp, compile_s, times


def main() -> None:
    in_parallel, algorithm = sys.argv[1], sys.argv[2]
    exp, compile_s, times = time_rounds(algorithm, [f"clients_in_parallel={in_parallel}"])
    print(json.dumps({"algorithm": algorithm, "clients_in_parallel": int(in_parallel),
                      "layout": exp.layout, "compile_s": compile_s, "round_s": times}))


if __name__ == "__main__":
    main()

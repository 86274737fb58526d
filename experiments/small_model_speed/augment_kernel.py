"""The training augmentation on the CPU kernel (``data.augment``, ``csrc/augment.cc``) against
XLA's gather fusion: its time in a local-training-like step, and whether rounds with it are
bitwise the rounds without it.

    python experiments/small_model_speed/augment_kernel.py step
        # ten clients side by side, a batch of 50 CIFAR-shaped uint8 images each gathered by
        # index, augmented (FedRCL's transform: rotation, zero-padded crop, flip; MOON's:
        # reflect-padded crop, flip) and fed to MOON's CNN's first convolution, inside a scan
        # of 20 steps: us a step with XLA's gather ("xla"), the kernel ("kernel"), and no
        # augmentation at all ("none": the convolution on a ready input), 2 passes each
    python experiments/small_model_speed/augment_kernel.py bench
        # tools/bench_round.py's CNN round (5 of 100 clients side by side, 500 synthetic images
        # each, 5 local epochs of batch 50; FedAvg, FedRCL and MOON with `cnn`), compiled with
        # XLA's gather and with the kernel in one process, timed alternately: s a round
    python experiments/small_model_speed/augment_kernel.py rounds
        # two rounds of FedAvg (cnn, FedRCL's transform) and MOON (moon_cnn, MOON's transform)
        # on synthetic images, 10 of 20 clients, two local epochs, compiled with each model's
        # options: whether the server states are bitwise the same with and without the kernel
"""

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.data import augment

TRANSFORMS = {"fedrcl": dict(max_degrees=10.0, crop_padding=4, pad_mode="zero"),
              "moon": dict(max_degrees=0.0, crop_padding=4, pad_mode="reflect")}
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)


def step() -> None:
    import fedjax_rcl.models  # noqa: F401  (registers the models)
    from fedjax_rcl import registry
    from fedjax_rcl.nn import conv, onednn

    onednn.set_thread_env(dict(registry.model("moon_cnn").cpu_thread_env))
    rng = np.random.default_rng(0)
    data = jnp.asarray(rng.integers(0, 256, (10000, 32, 32, 3), dtype=np.uint8))
    idx = jnp.asarray(rng.integers(0, 10000, (20, 10, 50)), jnp.int32)
    w = jnp.asarray(rng.standard_normal((10, 5, 5, 3, 6)), jnp.float32)

    def program(name, what):
        def body(acc, t):
            keys = jax.random.split(jax.random.fold_in(jax.random.key(0), t), 10)
            if what == "none":
                x = jnp.zeros((10, 50, 32, 32, 3), jnp.float32) + t
            else:
                x = jax.vmap(lambda k, i: augment.augment_batch(
                    k, data[i], mean=MEAN, std=STD, **TRANSFORMS[name]))(keys, idx[t])
            y = jax.vmap(lambda x, w: conv.onednn_narrow_conv_general_dilated(
                x, w, (1, 1), ((0, 0), (0, 0))))(x, w)
            return acc + y[:, :, 0, 0, 0].sum(), None

        augment.KERNEL = "off" if what == "xla" else "auto"  # read when traced
        try:
            return jax.jit(lambda: jax.lax.scan(body, 0.0, jnp.arange(20))[0]).lower().compile()
        finally:
            augment.KERNEL = "auto"

    for name in TRANSFORMS:
        row = {"transform": name, "clients": 10, "batch": 50}
        for _ in range(2):
            for what in ("none", "xla", "kernel"):
                f = program(name, what)
                jax.block_until_ready(f())
                times = []
                for _ in range(7):
                    t = time.perf_counter()
                    for _ in range(5):
                        r = f()
                    jax.block_until_ready(r)
                    times.append((time.perf_counter() - t) / 5 / 20 * 1e6)
                row.setdefault(f"{what}_us_per_step", []).append(round(sorted(times)[1], 1))
        print(json.dumps(row), flush=True)


def bench() -> None:
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from bench_round import fake_cifar  # the benchmark's synthetic images

    from fedjax_rcl.config import Config
    from fedjax_rcl.experiment import build

    for algorithm in ("fedavg", "fedrcl", "moon"):
        runs = {}
        for mode in ("off", "auto"):
            augment.KERNEL = mode  # read when the round is traced (compile_rounds traces it)
            cfg = Config(dataset="fake", model="cnn", algorithm=algorithm, num_clients=100,
                         participation=0.05, partition="iid", local_epochs=5, batch_size=50,
                         eval_every=1)
            exp = build(cfg, fake_cifar(100 * 500))
            step = exp.compile_rounds(1)
            state, _ = step(exp.state, 1)  # warm-up
            jax.block_until_ready(state)
            runs[mode] = [step, state, []]
        augment.KERNEL = "auto"
        for _ in range(5):
            for mode in ("off", "auto"):
                step, state, times = runs[mode]
                t = time.perf_counter()
                state, _ = step(state, 1)
                jax.block_until_ready(state)
                times.append(round(time.perf_counter() - t, 4))
                runs[mode][1] = state
        off, on = (statistics.median(runs[m][2]) for m in ("off", "auto"))
        print(json.dumps({"algorithm": algorithm, "model": "cnn", "clients": 5,
                          "xla_round_s": runs["off"][2], "kernel_round_s": runs["auto"][2],
                          "kernel_over_xla_median": round(on / off, 3)}), flush=True)


def rounds() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from bench_round import fake_cifar  # the benchmark's synthetic images

    from fedjax_rcl.config import Config
    from fedjax_rcl.experiment import build

    for model, algorithm, extra in (("cnn", "fedavg", {}),
                                    ("moon_cnn", "moon", {"transforms": "moon"})):
        states = {}
        for mode in ("off", "auto"):
            augment.KERNEL = mode  # read when the round is traced
            cfg = Config(dataset="fake", model=model, algorithm=algorithm, num_clients=20,
                         participation=0.5, partition="iid", local_epochs=2, batch_size=50,
                         **extra)
            exp = build(cfg, fake_cifar(20 * 100))
            lowered = jax.jit(exp.run_round).lower(exp.state, exp.data)
            calls = lowered.as_text().count("fedjax_augment_images")
            compiled = lowered.compile(exp.compiler_options)
            state = exp.state
            for _ in range(2):
                out = compiled(state, exp.data)
                state = out[0] if isinstance(out, tuple) else out
            states[mode] = ([np.asarray(x) for x in jax.tree.leaves(state)], calls)
        augment.KERNEL = "auto"
        same = all(np.array_equal(a, b) for a, b in zip(states["off"][0], states["auto"][0],
                                                        strict=True))
        print(json.dumps({"model": model, "algorithm": algorithm, "rounds": 2,
                          "kernel_calls_in_round": {m: states[m][1] for m in states},
                          "bitwise_same_state": same}), flush=True)


if __name__ == "__main__":
    {"step": step, "bench": bench, "rounds": rounds}[sys.argv[1]]()

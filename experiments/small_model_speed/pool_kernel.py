"""The bias + ReLU + max-pool kernel (`fedjax_rcl.nn.pool.bias_relu_max_pool`, impl="kernel")
against XLA's fusions of the same formula (impl="xla"), alone and in MOON's Table 1 round.

    python experiments/small_model_speed/pool_kernel.py alone
        # forward, and forward + both gradients, jitted, at the CNNs' pool shapes (us a call),
        # with the small CNNs' OpenMP settings
    CIFAR10_JPEG_ZIP=/path/cifar10-jpeg.zip \
        python experiments/small_model_speed/pool_kernel.py round IMPL ALGORITHM [KEY=VALUE ...]
        # MOON's setting cut to one local epoch (layout_moon_setting.py), the cost model's
        # layout unless overridden (model=cnn clients_in_parallel=10: side by side), one
        # fresh process per call: the seconds of two rounds after compiling

"before" is impl="xla": the model's graph as it was (the convolution's bias added, ReLU and
the reshape-and-max, which XLA fuses), chosen by replacing `pool.resolve_impl` in this process.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.nn import pool

SHAPES = [(50, 28, 28, 6), (50, 10, 10, 16), (64, 28, 28, 6), (64, 10, 10, 16),
          (10, 32, 32, 32), (10, 16, 16, 64), (50, 28, 28, 64)]


def _best3(f, *args, reps=200):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            r = f(*args)
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t) / reps * 1e6)
    return sorted(times)[:3]


def alone() -> None:
    import fedjax_rcl.models  # noqa: F401  (registers the models)
    from fedjax_rcl import registry
    from fedjax_rcl.nn import onednn

    # The OpenMP settings a process training the small CNNs runs with (their model entries').
    onednn.set_thread_env(dict(registry.model("moon_cnn").cpu_thread_env))
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        y = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        b = jnp.asarray(rng.standard_normal(shape[-1:]), jnp.float32) * 0.3
        dp = jnp.asarray(rng.standard_normal((shape[0], shape[1] // 2, shape[2] // 2,
                                              shape[3])), jnp.float32)
        row = {"shape": shape}
        for impl in ("xla", "kernel"):
            fwd = jax.jit(lambda y, b, impl=impl: pool.bias_relu_max_pool(y, b, 2, impl))
            grad = jax.jit(jax.grad(lambda y, b, impl=impl, dp=dp: jnp.sum(
                pool.bias_relu_max_pool(y, b, 2, impl) * dp), (0, 1)))
            row[impl] = {"forward_us": _best3(fwd, y, b), "forward_backward_us": _best3(grad, y, b)}
        print(json.dumps(row), flush=True)


def in_round(impl: str, algorithm: str, overrides: list[str]) -> None:
    from layout_moon_setting import time_rounds  # this folder's script

    pool.resolve_impl = lambda *_: impl  # every pool of this process's programs
    exp, _, times = time_rounds(algorithm, overrides)
    print(json.dumps({"impl": impl, "algorithm": algorithm, "overrides": overrides,
                      "layout": exp.layout, "round_s": times}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "alone":
        alone()
    else:
        in_round(sys.argv[2], sys.argv[3], sys.argv[4:])

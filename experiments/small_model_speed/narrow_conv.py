"""The positions-in-lanes convolution kernel (`fedjax_rcl.nn.narrow_conv`) against oneDNN's
kernels at the shapes it takes, alone and in MOON's Table 1 round.

    python experiments/small_model_speed/narrow_conv.py alone
        # MOON's CNN's two convolutions, batch 50, one client and ten side by side (vmap,
        # a kernel each): forward, and forward + both gradients, jitted (us a call), with the
        # small CNNs' OpenMP settings; narrow_conv.MODE "off" (oneDNN for every pass) or "auto";
        # the gradients the model takes (conv1's kernel; conv2's input and kernel)
    CIFAR10_JPEG_ZIP=/path/cifar10-jpeg.zip \\
        python experiments/small_model_speed/narrow_conv.py round MODE ALGORITHM [KEY=VALUE ...]
        # MOON's setting cut to one local epoch (layout_moon_setting.py), the cost model's
        # layout unless overridden, one fresh process per call: the seconds of two rounds
        # after compiling, with narrow_conv.MODE = MODE in this process's programs
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.nn import conv, narrow_conv

# (input, kernel, the gradients the model takes): MOON's CNN's conv1 (its forward on the
# kernel; the images take no gradient) and conv2 (its input gradient on the kernel: 6 output
# channels).
SHAPES = [((50, 32, 32, 3), (5, 5, 3, 6), (1,)), ((50, 14, 14, 6), (5, 5, 6, 16), (0, 1))]
VALID = ((0, 0), (0, 0))


def _best3(f, *args, reps=100):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            r = f(*args)
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t) / reps * 1e6)
    return [round(v, 1) for v in sorted(times)[:3]]


def alone() -> None:
    import fedjax_rcl.models  # noqa: F401  (registers the models)
    from fedjax_rcl import registry
    from fedjax_rcl.nn import onednn

    onednn.set_thread_env(dict(registry.model("moon_cnn").cpu_thread_env))
    rng = np.random.default_rng(0)
    f = conv.onednn_narrow_conv_general_dilated
    for xs, ws, wrt in SHAPES:
        for clients in (1, 10):
            x = jnp.asarray(rng.standard_normal((clients, *xs)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((clients, *ws)), jnp.float32)
            row = {"x": xs, "w": ws, "clients": clients}
            for mode in ("off", "auto"):
                narrow_conv.MODE = mode  # read when traced: each jit below traces under it

                def fwd(x, w):
                    return jax.vmap(lambda x, w: f(x, w, (1, 1), VALID))(x, w)

                def loss(x, w):
                    return jnp.sum(fwd(x, w) ** 2)

                row[mode] = {"forward_us": _best3(jax.jit(fwd), x, w),
                             "forward_backward_us": _best3(jax.jit(jax.grad(loss, wrt)), x, w)}
            narrow_conv.MODE = "auto"
            print(json.dumps(row), flush=True)


def in_round(mode: str, algorithm: str, overrides: list[str]) -> None:
    from layout_moon_setting import time_rounds  # this folder's script

    narrow_conv.MODE = mode  # every convolution this process's programs trace
    exp, _, times = time_rounds(algorithm, overrides)
    print(json.dumps({"mode": mode, "algorithm": algorithm, "overrides": overrides,
                      "layout": exp.layout, "round_s": times}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "alone":
        alone()
    else:
        in_round(sys.argv[2], sys.argv[3], sys.argv[4:])

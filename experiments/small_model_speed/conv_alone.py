"""MOON's CNN's two convolutions timed alone (jitted, 100 calls each) with each of the package's
CPU implementations: the forward pass, and the forward with both gradients, at batch 50 and 64.
Beside the round's profile (`per_kernel_xeon/`), what the same oneDNN calls reach outside a
round. Run with the CNNs' XLA option:

    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= \
        python experiments/small_model_speed/conv_alone.py
"""

import jax
import numpy as np
from jax import lax
from pool_vjp import seconds_per_call  # this folder's script, beside it on sys.path

from fedjax_rcl.nn import conv

IMPLS = {"onednn": conv.onednn_conv_general_dilated, "rows": conv.row_conv_general_dilated,
         "patches": conv.patch_conv_general_dilated, "native": lax.conv_general_dilated}
NHWC = ("NHWC", "HWIO", "NHWC")


def main() -> None:
    rng = np.random.default_rng(0)
    for batch in (50, 64):
        for xs, ws in [((batch, 32, 32, 3), (5, 5, 3, 6)), ((batch, 14, 14, 6), (5, 5, 6, 16))]:
            x = rng.standard_normal(xs, dtype=np.float32)
            w = rng.standard_normal(ws, dtype=np.float32)
            out = (xs[0], xs[1] - 4, xs[2] - 4, ws[3])
            g = rng.standard_normal(out, dtype=np.float32)
            flop = 2 * np.prod(out) * np.prod(ws[:3])
            print(f"x{list(xs)} * w{list(ws)}")
            for name, f in IMPLS.items():
                forward = jax.jit(lambda a, b, f=f: f(a, b, (1, 1), "VALID",
                                                      dimension_numbers=NHWC))
                both = jax.jit(lambda a, b, d, f=f: jax.vjp(
                    lambda u, v: f(u, v, (1, 1), "VALID", dimension_numbers=NHWC), a, b)[1](d))
                tf = seconds_per_call(forward, x, w, n=100)
                tb = seconds_per_call(both, x, w, g, n=100)
                print(f"  {name:8s} forward {tf * 1e6:7.1f} us ({flop / tf / 1e9:5.1f} GFLOP/s)"
                      f"  forward + both gradients {tb * 1e6:7.1f} us"
                      f" ({3 * flop / tb / 1e9:5.1f} GFLOP/s)")


if __name__ == "__main__":
    main()

"""Convolutions with few output channels, the image's positions in the vector lanes (CPU).

A direct convolution kernel that keeps channels in the vector lanes (oneDNN's, in the NHWC
layout) fills 6 of 16 lanes when a layer has 6 output channels: MOON's CNN's first
convolution forward, and its second convolution's input gradient (a convolution with 6 output
channels). ``csrc/narrow_conv.cc`` computes such a stride-1 convolution with 16 output
positions of a row in each vector instead, the product ``[C_out, K] x [K, positions]`` formed
in registers (each output channel's row accumulators stay there while the taps stream past),
never as a patch matrix in memory. It is built with the oneDNN convolutions
(``fedjax_rcl.nn.onednn``), with a path per instruction set (``isa``: 16-, 8- or 4-float
vectors), and runs where ``applies`` says: float32, stride 1, at most ``MAX_CHANNELS`` output
channels and ``MAX_WIDTH`` output positions a row, on a CPU with AVX2 or AVX-512 (measured
faster than oneDNN's kernels there: ``experiments/small_model_speed/README.md``, "Positions in
the lanes: a kernel").

The sums run over (input channel, kernel row, kernel column) in one fixed order, so a result
does not depend on the thread count or on the clients beside it under ``vmap``; against
oneDNN's kernels the floats differ at the rounding level (another order of the same sums).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.nn import onednn

MAX_CHANNELS = 8  # output channels a tile keeps in registers (csrc: kMaxCout)
MAX_WIDTH = 32    # output positions a row (csrc: kMaxWidth)
ISAS = ("baseline", "avx2", "avx512")  # the kernel's paths (csrc: Isa)
FAST_ISAS = ("avx2", "avx512")  # those measured faster than oneDNN at MOON's CNN's shapes

# "auto": the kernel wherever ``applies``; "off": never (oneDNN's kernels everywhere). Read
# when a convolution is traced: a benchmark's switch for timing one against the other in one
# process.
MODE = "auto"


@functools.cache
def isa() -> str | None:
    """The path the kernel runs on this CPU (``ISAS``: its widest vectors, capped by
    ``$FEDJAX_NARROW_CONV_ISA`` when that names a narrower one), None without the extension."""
    if not onednn.available():
        return None
    return ISAS[onednn.library().FedjaxNarrowConvIsa()]


def applies(out_channels: int, out_width: int, strides: Sequence[int],
            padding: Sequence[tuple[int, int]], dtype) -> bool:
    """Whether a convolution (or an input gradient, seen as the convolution it is) with these
    output channels and output row width runs on this kernel: float32, stride 1, padding
    ``>= 0``, at most ``MAX_CHANNELS`` channels and ``MAX_WIDTH`` positions a row, in
    ``MODE="auto"``, where the extension builds and runs its AVX2 or AVX-512 path."""
    return (MODE == "auto" and np.dtype(dtype) == np.float32 and tuple(strides) == (1, 1)
            and all(p >= 0 for pair in padding for p in pair)
            and 1 <= out_channels <= MAX_CHANNELS and 1 <= out_width <= MAX_WIDTH
            and isa() in FAST_ISAS)


def resolve(dtype) -> str:
    """``"kernel"`` where ``conv_impl="cpu"`` convolutions of ``dtype`` run this kernel for the
    shapes it takes (float32, a CPU backend where the extension builds and runs a path of
    ``FAST_ISAS``, ``MODE="auto"``), else ``"off"``: what a run's ``environment.jsonl``
    records."""
    on = (MODE == "auto" and np.dtype(dtype) == np.float32 and jax.default_backend() == "cpu"
          and isa() in FAST_ISAS)
    return "kernel" if on else "off"


def _call(target: str, x: jax.Array, w: jax.Array, out_shape, pad_top: int,
          pad_left: int) -> jax.Array:
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"narrow_conv computes float32 only; got {x.dtype}, {w.dtype}")
    # Under vmap one call takes every client: leading axes on each operand, 1 where shared.
    return onednn.call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32), x, w,
                       vmap_method="expand_dims", pad_top=np.int64(pad_top),
                       pad_left=np.int64(pad_left))


def conv(x: jax.Array, w: jax.Array, padding: Sequence[tuple[int, int]]) -> jax.Array:
    """``y = conv(x, w)`` with stride 1: NHWC ``x`` ``[N, H, W, C_in]``, HWIO ``w``, explicit
    ``((top, bottom), (left, right))`` zero padding, each ``>= 0``."""
    kh, kw, _, cout = w.shape
    (pt, pb), (pl, pr) = padding
    if min(pt, pb, pl, pr) < 0:
        raise ValueError(f"narrow_conv: padding must be >= 0; got {padding}")
    out = (x.shape[0], x.shape[1] + pt + pb - kh + 1, x.shape[2] + pl + pr - kw + 1, cout)
    return _call("fedjax_narrow_conv_forward", x, w, out, pt, pl)


def input_grad(dy: jax.Array, w: jax.Array, input_shape: Sequence[int],
               padding: Sequence[tuple[int, int]]) -> jax.Array:
    """The input gradient of ``conv(x, w, padding)`` (stride 1) for output gradient ``dy``: the
    stride-1 convolution of ``dy`` padded by ``k - 1 - p`` a side with the flipped kernel, its
    input and output channels exchanged. Each of those paddings must be ``>= 0``."""
    kh, kw = w.shape[:2]
    (pt, _), (pl, _) = padding
    flipped = ((kh - 1 - pt, input_shape[1] + pt - dy.shape[1]),
               (kw - 1 - pl, input_shape[2] + pl - dy.shape[2]))
    if min(p for pair in flipped for p in pair) < 0:
        raise ValueError(f"narrow_conv: the input gradient needs padding <= k - 1; got {padding}")
    return _call("fedjax_narrow_conv_backward_data", dy, w, tuple(input_shape), flipped[0][0],
                 flipped[1][0])

"""Convolution as image patches times a weight matrix, and PyTorch-style conv/dense factories.

Why a second convolution: on XLA:CPU, ``lax.conv_general_dilated`` inside ``lax.scan`` runs its
weight-gradient convolutions through a slow generic path (jax-ml/jax#12868), and under ``vmap``
over a client axis of parameters it becomes a grouped convolution that is 4-5x slower per client.
Written as ``k*k`` shifted strided slices concatenated along channels ("patches") and one matmul,
the same convolution is a plain GEMM inside ``scan`` and a batched GEMM under ``vmap``: on a 2-core
CPU a MOON-CNN client step dropped from 70 ms to 11 ms (see ``../shared/NOTES.md``). On GPU/TPU the
native convolution is the right choice; ``resolve_conv_impl("auto")`` picks by platform.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

CONV_IMPLS = ("auto", "patches", "native")


def patch_conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers=None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision=None,
    preferred_element_type=None,
) -> jax.Array:
    """A drop-in for ``lax.conv_general_dilated`` (2-D, NHWC x HWIO) built from patches.

    .. math::
        y[b, i, j, o] = \\sum_{p, q, c} x_{pad}[b, s_h i + p, s_w j + q, c] \\, w[p, q, c, o]

    computed as ``concat_{p,q}(x_pad[:, p::s_h, q::s_w, :]) @ w.reshape(k_h k_w C_in, C_out)``.
    The concatenation order ``(p, q, c)`` is exactly the row-major order of an HWIO kernel, so the
    kernel reshape is free. Memory: about ``k_h * k_w`` times the input activations.

    Supports what the models here use: explicit or string padding, any stride, no dilation,
    ``feature_group_count == 1``. Anything else raises ``ValueError`` at trace time.

    Args:
      lhs: input ``[B, H, W, C_in]``.
      rhs: kernel ``[k_h, k_w, C_in, C_out]``.
      window_strides: ``(s_h, s_w)``.
      padding: ``"VALID"``, ``"SAME"`` or ``((lo_h, hi_h), (lo_w, hi_w))``.
      lhs_dilation, rhs_dilation: must be ``None`` or all ones.
      dimension_numbers: must describe NHWC x HWIO -> NHWC (Flax's default for NHWC input).
      feature_group_count, batch_group_count: must be 1.
      precision, preferred_element_type: passed to the matmul.

    Returns:
      ``[B, H_out, W_out, C_out]``.
    """
    if lhs.ndim != 4 or rhs.ndim != 4:
        raise ValueError(f"patch convolution is 2-D only; got lhs {lhs.shape}, rhs {rhs.shape}")
    if feature_group_count != 1 or batch_group_count != 1:
        raise ValueError("patch convolution does not support grouped convolutions")
    for name, dil in (("lhs_dilation", lhs_dilation), ("rhs_dilation", rhs_dilation)):
        if dil is not None and any(d != 1 for d in dil):
            raise ValueError(f"patch convolution does not support {name}={tuple(dil)}")
    if dimension_numbers is not None:
        dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        if tuple(dn.lhs_spec) != (0, 3, 1, 2) or tuple(dn.rhs_spec) != (3, 2, 0, 1):
            raise ValueError(f"patch convolution expects NHWC x HWIO, got {dimension_numbers}")

    kh, kw, cin, cout = rhs.shape
    if lhs.shape[-1] != cin:
        raise ValueError(f"input has {lhs.shape[-1]} channels, kernel expects {cin}")
    sh, sw = window_strides
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(lhs.shape[1:3], (kh, kw), (sh, sw), padding)
    (ph0, ph1), (pw0, pw1) = padding
    x = jnp.pad(lhs, ((0, 0), (ph0, ph1), (pw0, pw1), (0, 0)))
    hp, wp = x.shape[1], x.shape[2]
    ho, wo = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"kernel {kh}x{kw} does not fit the padded input {hp}x{wp}")
    cols = [
        lax.slice(
            x,
            (0, p, q, 0),
            (x.shape[0], p + sh * (ho - 1) + 1, q + sw * (wo - 1) + 1, cin),
            (1, sh, sw, 1),
        )
        for p in range(kh)
        for q in range(kw)
    ]
    patches = cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=-1)
    return jnp.dot(
        patches,
        rhs.reshape(kh * kw * cin, cout),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )


def resolve_conv_impl(conv_impl: str, platform: str | None = None) -> str:
    """Maps ``"auto"`` to ``"patches"`` on CPU and ``"native"`` on GPU/TPU."""
    if conv_impl not in CONV_IMPLS:
        raise ValueError(f"conv_impl={conv_impl!r}: allowed {CONV_IMPLS}")
    if conv_impl != "auto":
        return conv_impl
    platform = platform or jax.default_backend()
    return "patches" if platform == "cpu" else "native"


def _conv_fn(conv_impl: str):
    impl = resolve_conv_impl(conv_impl)
    return patch_conv_general_dilated if impl == "patches" else lax.conv_general_dilated


# PyTorch's default for Conv2d/Linear weights: kaiming_uniform(a=sqrt(5)), i.e. U(+-1/sqrt(fan_in)).
torch_kernel_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_bias_init(fan_in: int):
    """PyTorch's default bias init for Conv2d/Linear: U(+-1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def torch_conv(
    in_features: int,
    features: int,
    kernel_size: int,
    *,
    stride: int = 1,
    padding: int = 0,
    use_bias: bool = True,
    conv_impl: str = "auto",
    name: str | None = None,
) -> nn.Conv:
    """A Flax ``Conv`` that behaves like ``torch.nn.Conv2d``: symmetric padding, PyTorch init.

    Flax's ``'SAME'`` pads a stride-2 3x3 convolution (0, 1); PyTorch's ``padding=1`` pads (1, 1).
    The explicit pair keeps the two identical.
    """
    return nn.Conv(
        features,
        (kernel_size, kernel_size),
        strides=(stride, stride),
        padding=((padding, padding), (padding, padding)),
        use_bias=use_bias,
        kernel_init=torch_kernel_init,
        bias_init=torch_bias_init(in_features * kernel_size * kernel_size),
        conv_general_dilated=_conv_fn(conv_impl),
        name=name,
    )


def torch_dense(in_features: int, features: int, *, name: str | None = None) -> nn.Dense:
    """A Flax ``Dense`` initialised like ``torch.nn.Linear``."""
    return nn.Dense(
        features,
        kernel_init=torch_kernel_init,
        bias_init=torch_bias_init(in_features),
        name=name,
    )


__all__ = [
    "CONV_IMPLS",
    "patch_conv_general_dilated",
    "resolve_conv_impl",
    "torch_bias_init",
    "torch_conv",
    "torch_dense",
    "torch_kernel_init",
]

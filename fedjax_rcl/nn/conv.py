"""Convolutions for every backend, and PyTorch-style conv/dense factories.

All are drop-ins for ``lax.conv_general_dilated`` (2-D, NHWC x HWIO) that Flax's ``Conv`` takes
through its ``conv_general_dilated=`` argument; ``conv_impl`` picks one (``resolve_conv_impl``).

Why more than XLA's native convolution: on XLA:CPU, ``lax.conv_general_dilated`` inside
``lax.scan`` runs its weight-gradient convolutions through a slow generic path (jax-ml/jax#12868),
and under ``vmap`` over a client axis of parameters it becomes a grouped convolution, several
times slower per client (BENCHMARKS.md). On CPU (``"cpu"``, the default there):

- ``onednn_conv_general_dilated``: oneDNN's direct kernels (the library behind PyTorch's CPU
  convolutions) for the forward pass and both gradients, called through XLA's FFI
  (``fedjax_rcl.nn.onednn``), the fastest of the three on every CPU and model measured
  (BENCHMARKS.md); as the CPU's choice (``onednn_narrow_conv_general_dilated``) with the
  forward passes and input gradients that have few output channels and narrow rows on a
  kernel that puts image positions in the vector lanes (``fedjax_rcl.nn.narrow_conv``).
- Without the oneDNN extension, exact matmul formulations that XLA runs well: ``k*k`` shifted
  strided slices concatenated along channels ("patches") times the kernel, or, for layers with
  few input channels, whole image rows times a banded weight matrix (``rows``,
  ``prefers_rows``).

On GPU/TPU the native convolution is the right choice for one model at a time; with clients
side by side on a GPU (per-client weights under ``vmap``) the patch formulation is
(``resolve_conv_impl``, which ``conv_impl="auto"`` uses, picks by platform and layout).

Which one runs is not a property of the model: every convolution layer (``torch_conv``) calls
``conv_general_dilated``, which reads the implementation in force while it is traced
(``implementation``, a context the engine sets around each program it traces:
``fedjax_rcl.models.model_fns``) and picks the function per convolution (``choose``: by its
shape, groups and operand type). The compiled program bakes the choice in; the same model and
parameters serve evaluation with one implementation and local training with another.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedjax_rcl import registry
from fedjax_rcl.nn import narrow_conv, onednn

CONV_IMPLS = ("auto", "cpu", "onednn", "patches", "rows", "native")


def _runs_here(conv_impl: str) -> str | None:
    """Why ``conv_impl`` cannot run here, or None: ``onednn`` needs the CPU backend and the
    oneDNN extension (built here, once)."""
    if conv_impl != "onednn":
        return None
    if jax.default_backend() != "cpu":
        return (f"conv_impl='onednn': runs on the CPU only; the default backend is "
                f"{jax.default_backend()} (use auto or native)")
    if not onednn.available():
        return (f"conv_impl='onednn': unavailable here: {onednn.unavailable_reason()} "
                "(use auto, which falls back to the matmul convolutions)")
    return None


registry.register_choices("conv_impl", CONV_IMPLS, check=_runs_here)


def _check(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
           feature_group_count, batch_group_count, what):
    """Checks what the convolutions here support; returns explicit padding."""
    if lhs.ndim != 4 or rhs.ndim != 4:
        raise ValueError(f"{what} convolution is 2-D only; got lhs {lhs.shape}, rhs {rhs.shape}")
    if feature_group_count != 1 or batch_group_count != 1:
        raise ValueError(f"{what} convolution does not support grouped convolutions")
    for name, dil in (("lhs_dilation", lhs_dilation), ("rhs_dilation", rhs_dilation)):
        if dil is not None and any(d != 1 for d in dil):
            raise ValueError(f"{what} convolution does not support {name}={tuple(dil)}")
    if dimension_numbers is not None:
        dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
        if tuple(dn.lhs_spec) != (0, 3, 1, 2) or tuple(dn.rhs_spec) != (3, 2, 0, 1):
            raise ValueError(f"{what} convolution expects NHWC x HWIO, got {dimension_numbers}")
    kh, kw, cin, _ = rhs.shape
    if lhs.shape[-1] != cin:
        raise ValueError(f"input has {lhs.shape[-1]} channels, kernel expects {cin}")
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(lhs.shape[1:3], (kh, kw), tuple(window_strides), padding)
    padding = tuple((int(lo), int(hi)) for lo, hi in padding)
    for axis, k, s, (lo, hi) in ((1, kh, window_strides[0], padding[0]),
                                 (2, kw, window_strides[1], padding[1])):
        if (lhs.shape[axis] + lo + hi - k) // s + 1 <= 0:
            raise ValueError(f"kernel {kh}x{kw} does not fit the padded input "
                             f"{lhs.shape[1] + sum(padding[0])}x{lhs.shape[2] + sum(padding[1])}")
    return padding


def _prepare(lhs, rhs, window_strides, padding, *check_args):
    """``_check``, then the padded input and the output size."""
    (ph0, ph1), (pw0, pw1) = _check(lhs, rhs, window_strides, padding, *check_args)
    kh, kw = rhs.shape[:2]
    sh, sw = window_strides
    x = jnp.pad(lhs, ((0, 0), (ph0, ph1), (pw0, pw1), (0, 0)))
    ho, wo = (x.shape[1] - kh) // sh + 1, (x.shape[2] - kw) // sw + 1
    return x, ho, wo


def _patches(x: jax.Array, kh: int, kw: int, strides: Sequence[int], ho: int, wo: int):
    """``[B, H_pad, W_pad, C] -> [B, H_out, W_out, k_h k_w C]``, taps in HWIO order."""
    sh, sw = strides
    b, _, _, cin = x.shape
    cols = [
        lax.slice(x, (0, p, q, 0), (b, p + sh * (ho - 1) + 1, q + sw * (wo - 1) + 1, cin),
                  (1, sh, sw, 1))
        for p in range(kh)
        for q in range(kw)
    ]
    return cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=-1)


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

    The gradient is hand-written (``_patch_conv_bwd``): the input gradient is col2im or, for
    stride 1, the patch convolution of the output gradient with the flipped kernel, whichever
    writes fewer values (``input_grad_rule``; autodiff's col2im for layers of equal widths
    XLA:CPU fused badly, benchmarks/HISTORY.md).

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
    padding = _check(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                     dimension_numbers, feature_group_count, batch_group_count, "patch")
    return _patch_conv(lhs, rhs, tuple(window_strides), padding, precision,
                       preferred_element_type, tuple(lhs.shape), jnp.dtype(lhs.dtype))


def _padded_patches(x, kh, kw, strides, padding):
    xp = jnp.pad(x, ((0, 0), *padding, (0, 0)))
    ho, wo = (xp.shape[1] - kh) // strides[0] + 1, (xp.shape[2] - kw) // strides[1] + 1
    return _patches(xp, kh, kw, strides, ho, wo)


def _patch_matmul(x, w, strides, padding, precision, preferred_element_type):
    kh, kw, cin, cout = w.shape
    patches = _padded_patches(x, kh, kw, strides, padding)
    y = jnp.dot(patches, w.reshape(kh * kw * cin, cout), precision=precision,
                preferred_element_type=preferred_element_type)
    return y, patches


# The input's shape and dtype travel as static arguments, not as a residual: residuals are
# values a jitted forward pass returns, and a ShapeDtypeStruct has none (the gradient of a
# jitted apply then failed to lower).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _patch_conv(x, w, strides, padding, precision, preferred_element_type, x_shape, x_dtype):
    return _patch_matmul(x, w, strides, padding, precision, preferred_element_type)[0]


def _patch_conv_fwd(x, w, strides, padding, precision, preferred_element_type, x_shape,
                    x_dtype):
    y, patches = _patch_matmul(x, w, strides, padding, precision, preferred_element_type)
    return y, (patches, w)


def _patch_conv_bwd(strides, padding, precision, preferred_element_type, x_shape, x_dtype,
                    residuals, g):
    """Hand-written gradient. The input gradient is one of two exact formulations, whichever
    writes fewer values (``input_grad_rule``):

    * ``"flipped"`` (stride 1 only): the convolution of ``g`` with the flipped, in/out-swapped
      kernel, done as patches: ``k_h k_w C_out`` values per input position. Autodiff's col2im
      fused badly on XLA:CPU (with FedRCL's feature-level losses a ResNet-18 step was markedly
      slower; BENCHMARKS.md), and for ``C_in == C_out`` this rule is kept.
    * ``"col2im"``: ``g @ w^T`` as ``k_h k_w C_in`` values per output position, each tap
      shifted back to the input's place and summed (the transpose of the patch extraction).
      A layer that widens (``C_in < C_out``) writes less so: pfl-research's conv2 (32 -> 64,
      valid) 0.44 times as much, and a memory-bound round pays for what it writes.
    """
    patches, w = residuals
    x = jax.ShapeDtypeStruct(x_shape, x_dtype)
    kh, kw, cin, cout = w.shape
    g = g.astype(patches.dtype)
    dw = lax.dot_general(patches, g, (((0, 1, 2), (0, 1, 2)), ((), ())),
                         precision=precision).reshape(w.shape).astype(w.dtype)
    if input_grad_rule(x.shape, g.shape, w.shape, strides, padding) == "flipped":
        wt = jnp.flip(w, (0, 1)).transpose(0, 1, 3, 2)
        dx = _patch_matmul(g, wt, (1, 1), _flipped_pads(kh, kw, padding), precision, None)[0]
    else:  # the k_h k_w taps summed in float32 at least, as the matmul above accumulates
        acc = jnp.promote_types(x.dtype, jnp.float32)
        extract = functools.partial(_padded_patches, kh=kh, kw=kw, strides=strides,
                                    padding=padding)
        cols = jnp.dot(g, w.reshape(-1, cout).T, precision=precision,
                       preferred_element_type=acc)
        dx = jax.linear_transpose(extract, jax.ShapeDtypeStruct(x.shape, acc))(cols)[0]
    return dx.astype(x.dtype), dw


def _flipped_pads(kh: int, kw: int, padding) -> tuple[tuple[int, int], ...]:
    """The padding of the output gradient whose stride-1 patch convolution with the flipped
    kernel is the input gradient."""
    return tuple((k - 1 - lo, k - 1 - hi) for k, (lo, hi) in zip((kh, kw), padding, strict=True))


# The input-gradient rule of the patch convolution: "auto" (fewer values written), or
# "flipped" / "col2im" wherever each is exact; a benchmark's switch for timing one against the
# other in one process (read when a gradient is traced).
INPUT_GRAD_RULE = "auto"


def input_grad_rule(x_shape, g_shape, w_shape, strides, padding) -> str:
    """``"flipped"`` or ``"col2im"``: how ``_patch_conv_bwd`` forms the input gradient.

    The flipped-kernel patches exist only for stride 1 with padding at most ``k - 1`` a side;
    where both exist, ``"auto"`` takes the one that writes fewer values:
    ``k_h k_w C_out H_in W_in`` (patches of ``g`` at the input's size) against
    ``k_h k_w C_in H_out W_out`` (``g @ w^T`` at the output's size), and ``"flipped"`` on a
    tie (XLA:CPU's col2im fusion, above).
    """
    kh, kw, cin, cout = w_shape
    if tuple(strides) != (1, 1) or not all(
            0 <= p <= k - 1 for k, pair in zip((kh, kw), _flipped_pads(kh, kw, padding),
                                               strict=True) for p in pair):
        return "col2im"
    if INPUT_GRAD_RULE != "auto":
        return INPUT_GRAD_RULE
    flipped = cout * x_shape[1] * x_shape[2]
    col2im = cin * g_shape[1] * g_shape[2]
    return "col2im" if col2im < flipped else "flipped"


_patch_conv.defvjp(_patch_conv_fwd, _patch_conv_bwd)


def onednn_conv_general_dilated(
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
    *,
    narrow: bool = False,
) -> jax.Array:
    """The same convolution run by oneDNN's direct kernels (CPU; ``fedjax_rcl.nn.onednn``).

    Forward, input gradient and kernel gradient are each one oneDNN primitive called through
    XLA's FFI: no patches, no col2im. The function is differentiable (``custom_vjp``); under
    ``vmap`` each call takes all the mapped elements at once. ``narrow``: the forward pass and
    the input gradient run the positions-in-lanes kernel instead where it applies
    (``fedjax_rcl.nn.narrow_conv``: few output channels, narrow rows; float32), as
    ``onednn_narrow_conv_general_dilated`` does. Same arguments and support as
    ``patch_conv_general_dilated``; the operands are float32, or bfloat16 / float16 where the
    CPU has the instructions (``onednn.supports``), the result of their type (oneDNN
    accumulates in float32); ``precision`` and ``preferred_element_type`` must be left at
    their defaults.
    """
    padding = _check(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                     dimension_numbers, feature_group_count, batch_group_count, "oneDNN")
    if lhs.dtype != rhs.dtype or not onednn.supports(lhs.dtype):
        raise ValueError(f"oneDNN convolution here takes float32 (or a low type this CPU "
                         f"supports) operands of one type; got {lhs.dtype}, {rhs.dtype}")
    if preferred_element_type not in (None, lhs.dtype):
        raise ValueError("oneDNN convolution returns its operands' type")
    strides = tuple(window_strides)
    if rhs.shape[:2] == (1, 1) and strides != (1, 1) and padding == ((0, 0), (0, 0)):
        # A strided 1x1 convolution reads every stride-th pixel: take them here and run a
        # stride-1 convolution. oneDNN 3.2's AVX2 1x1 kernel-gradient path for strided inputs
        # ("reduce to unit stride") corrupts memory when the input channels are not a multiple
        # of its 8-channel block (seen with 4 channels: wrong gradients, heap errors).
        lhs = lhs[:, ::strides[0], ::strides[1], :]
        strides = (1, 1)
    return _onednn_conv(lhs, rhs, strides, padding, narrow)


def _forward(x, w, strides, padding, narrow: bool):
    if narrow and narrow_conv.applies(w.shape[-1], _out_width(x, w, strides, padding), strides,
                                      padding, x.dtype):
        return narrow_conv.conv(x, w, padding)
    return onednn.conv_forward(x, w, strides, padding)


def _out_width(x, w, strides, padding) -> int:
    (pl, pr) = padding[1]
    return (x.shape[2] + pl + pr - w.shape[1]) // strides[1] + 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _onednn_conv(x, w, strides, padding, narrow):
    return _forward(x, w, strides, padding, narrow)


def _onednn_conv_fwd(x, w, strides, padding, narrow):
    return _forward(x, w, strides, padding, narrow), (x, w)


def _onednn_conv_bwd(strides, padding, narrow, residuals, g):
    x, w = residuals
    kh, kw, cin, _ = w.shape
    if narrow and narrow_conv.applies(cin, x.shape[2], strides, _flipped_pads(kh, kw, padding),
                                      x.dtype):
        dx = narrow_conv.input_grad(g, w, x.shape, padding)
    else:
        dx = onednn.conv_backward_data(g, w, x.shape, strides, padding)
    return dx, onednn.conv_backward_weights(x, g, w.shape, strides, padding)


_onednn_conv.defvjp(_onednn_conv_fwd, _onednn_conv_bwd)


def onednn_narrow_conv_general_dilated(*args, **kwargs) -> jax.Array:
    """The CPU's convolution with the oneDNN extension (``conv_impl="cpu"``): oneDNN's kernels,
    except the forward passes and input gradients with few output channels and narrow rows,
    which run ``fedjax_rcl.nn.narrow_conv``'s kernel (``narrow_conv.applies``: where it was
    measured faster). ``onednn_conv_general_dilated`` with ``narrow=True``."""
    return onednn_conv_general_dilated(*args, narrow=True, **kwargs)


def _column_selector(kw: int, wp: int, wo: int, sw: int) -> np.ndarray:
    """``S[q, x, j] = 1`` iff input column ``x`` feeds output column ``j`` through tap ``q``."""
    sel = np.zeros((kw, wp, wo), np.float32)
    for q in range(kw):
        sel[q, sw * np.arange(wo) + q, np.arange(wo)] = 1.0
    return sel


def row_conv_general_dilated(
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
    """The same convolution as whole image rows times a banded (Toeplitz) weight matrix.

    Each output row ``i`` is a function of ``k_h`` whole padded input rows, each flattened to
    ``W_pad * C_in`` numbers:

    .. math::
        y[b, i, (j, o)] = \\sum_{p} x_{pad}[b, s_h i + p, (x, c)] \\, T_p[(x, c), (j, o)],
        \\qquad T_p[(x, c), (j, o)] = \\sum_q [x = s_w j + q] \\, w[p, q, c, o].

    The banded matrix ``T`` is built from the kernel by one small einsum with a constant 0/1
    selector, so gradients flow back to ``w`` through it. Why: with few input channels, the
    patch convolution's ``k_h k_w`` strided copies have a minor dimension of ``C_in`` floats and
    XLA:CPU copies them slowly (MOON's conv1: 25 copies with 3-channel rows, most of its step's
    time), and its matmul has only ``C_out`` columns. Here the only copies are ``k_h`` slices of
    whole rows and the matmul has ``W_out * C_out`` columns; the price is ``W_pad / k_w`` times
    the multiply-adds (zeros of the band), so it only pays for narrow inputs (see
    ``cpu_conv_general_dilated``). Same arguments and support as ``patch_conv_general_dilated``.
    """
    x, ho, wo = _prepare(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
                         dimension_numbers, feature_group_count, batch_group_count, "row")
    kh, kw, cin, cout = rhs.shape
    sh, sw = window_strides
    b, _, wp, _ = x.shape
    sel = _column_selector(kw, wp, wo, sw).astype(rhs.dtype)
    band = jnp.einsum("pqco,qxj->pxcjo", rhs, sel).reshape(kh * wp * cin, wo * cout)
    rows_in = x.reshape(b, x.shape[1], wp * cin)
    rows = [
        lax.slice(rows_in, (0, p, 0), (b, p + sh * (ho - 1) + 1, wp * cin), (1, sh, 1))
        for p in range(kh)
    ]
    stacked = rows[0] if kh == 1 else jnp.concatenate(rows, axis=-1)
    y = jnp.dot(stacked, band, precision=precision, preferred_element_type=preferred_element_type)
    return y.reshape(b, ho, wo, cout)


def prefers_rows(input_shape: Sequence[int], kernel_shape: Sequence[int],
                 window_strides: Sequence[int] = (1, 1),
                 padding: str | Sequence[tuple[int, int]] = ((0, 0), (0, 0))) -> bool:
    """The CPU rule without oneDNN: rows for few input channels, when the band wastes at most
    8x the work.

    The bound separates the layers measured (BENCHMARKS.md): rows win for MOON's conv1 (3->6
    channels, 32 wide, 6.4x the multiply-adds) and conv2 (6->16, 14 wide, 2.8x), and lose for
    ResNet's 3->64 stem (34 wide, 11x) and every layer with 64+ input channels.
    """
    kh, kw, cin, _ = kernel_shape
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(tuple(input_shape[1:3]), (kh, kw), tuple(window_strides),
                                      padding)
    wp = input_shape[2] + sum(padding[1])
    return cin <= 16 and wp <= 8 * kw


def cpu_conv_general_dilated(lhs, rhs, window_strides, padding, *args, **kwargs) -> jax.Array:
    """The fastest convolution on CPU: oneDNN's direct kernels (with ``narrow_conv``'s where it
    applies) when the extension is available (``onednn.available()``) for the operands' type
    (``onednn.supports``: float32, and bfloat16 / float16 on CPUs with those instructions),
    else per layer the row (``prefers_rows``) or patch convolution (``choose``)."""
    impl = _per_shape("cpu", lhs, rhs, window_strides, padding)
    return impl(lhs, rhs, window_strides, padding, *args, **kwargs)


def onednn_usable() -> bool:
    """``onednn.available()``, with a warning (shown once per process) when it is not."""
    if onednn.available():
        return True
    warnings.warn(f"oneDNN convolutions unavailable ({onednn.unavailable_reason()}); using the "
                  "slower matmul convolutions on CPU", OneDnnFallbackWarning, stacklevel=2)
    return False


class OneDnnFallbackWarning(UserWarning):
    """The CPU convolutions fell back from oneDNN to the matmul formulations."""


def resolve_conv_impl(conv_impl: str, platform: str | None = None, *,
                      batched_weights: bool = False) -> str:
    """The convolutions ``conv_impl`` names; ``"auto"`` picks by platform and layout:

    * CPU: ``"cpu"`` (oneDNN, else rows or patches);
    * GPU, when the weights carry a batch axis (``batched_weights``: several clients, or runs,
      side by side under ``vmap``, each with its own weights): ``"patches"``. XLA lowers a
      convolution ``vmap``-ed over its weights to a grouped convolution, one group per client,
      which the GPU's convolution library runs far below a dense one; the patch formulation
      makes the client axis the batch of plain matrix products (BENCHMARKS.md, "Clients side
      by side on a GPU", measures the difference);
    * otherwise (GPU one model at a time, TPU): ``"native"``, XLA's own convolution.

    ``platform``: default JAX's backend.
    """
    if conv_impl not in CONV_IMPLS:
        raise ValueError(f"conv_impl={conv_impl!r}: allowed {CONV_IMPLS}")
    if conv_impl != "auto":
        return conv_impl
    platform = platform or jax.default_backend()
    if platform == "cpu":
        return "cpu"
    return "patches" if platform == "gpu" and batched_weights else "native"


_CONV_FNS = {
    "cpu": cpu_conv_general_dilated,
    "patches": patch_conv_general_dilated,
    "rows": row_conv_general_dilated,
    "native": lax.conv_general_dilated,
    "onednn": onednn_conv_general_dilated,
}


def _per_shape(name: str, lhs, rhs, window_strides, padding,
               feature_group_count: int = 1) -> Callable:
    """The function that runs one convolution under the resolved implementation ``name``.

    The per-shape rules live here and only here: ``native`` runs XLA's convolution for every
    layer; otherwise grouped and depthwise convolutions run ``grouped_conv_general_dilated``
    (the formulations above are dense only); ``cpu`` takes oneDNN for the operand types it
    supports (its forward pass and input gradient on ``narrow_conv``'s kernel where
    ``narrow_conv.applies`` to them: the one rule for that kernel), else rows for narrow inputs
    (``prefers_rows``), else patches.
    """
    if name == "native":
        return lax.conv_general_dilated
    if feature_group_count > 1:
        return grouped_conv_general_dilated
    if name != "cpu":
        return _CONV_FNS[name]
    if lhs.dtype == rhs.dtype and onednn_usable() and onednn.supports(lhs.dtype):
        return onednn_narrow_conv_general_dilated
    if prefers_rows(lhs.shape, rhs.shape, window_strides, padding):
        return row_conv_general_dilated
    return patch_conv_general_dilated


def choose(conv_impl: str, lhs, rhs, window_strides, padding,
           feature_group_count: int = 1) -> Callable:
    """The function (a drop-in for ``lax.conv_general_dilated``) that ``conv_impl`` runs a
    convolution of operands ``lhs`` (NHWC) and ``rhs`` (HWIO) with: ``conv_impl`` resolved
    for this platform (``resolve_conv_impl``), then by the convolution's shape
    (``_per_shape``)."""
    return _per_shape(resolve_conv_impl(conv_impl), lhs, rhs, window_strides, padding,
                      feature_group_count)


_IMPLEMENTATION: contextvars.ContextVar[str] = contextvars.ContextVar("conv_impl",
                                                                      default="auto")


@contextlib.contextmanager
def implementation(conv_impl: str) -> Iterator[None]:
    """The convolutions (``CONV_IMPLS``) that every ``conv_general_dilated`` traced inside
    runs; outside any, ``"auto"``.

    Read when a convolution is traced, not when it runs: set it inside the function that is
    traced (``under``), or around a trace that cannot have been cached under another setting.
    Scopes nest; the innermost holds.
    """
    resolve_conv_impl(conv_impl)  # an unknown name fails here, not at the first convolution
    token = _IMPLEMENTATION.set(conv_impl)
    try:
        yield
    finally:
        _IMPLEMENTATION.reset(token)


def current_implementation() -> str:
    """The ``conv_impl`` in force (``implementation``)."""
    return _IMPLEMENTATION.get()


def under(conv_impl: str, fn: Callable) -> Callable:
    """``fn`` with each call -- so each trace of it, whatever the caller's jit cache holds --
    under ``implementation(conv_impl)``."""

    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        with implementation(conv_impl):
            return fn(*args, **kwargs)

    return scoped


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                         rhs_dilation=None, dimension_numbers=None,
                         feature_group_count: int = 1, batch_group_count: int = 1,
                         precision=None, preferred_element_type=None) -> jax.Array:
    """The convolution of every layer here (``torch_conv``): ``lax.conv_general_dilated``'s
    arguments and result, computed by the function ``choose`` picks for the implementation in
    force (``implementation``) and this convolution's shape."""
    fn = choose(current_implementation(), lhs, rhs, window_strides, padding,
                feature_group_count)
    return fn(lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
              rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
              feature_group_count=feature_group_count, batch_group_count=batch_group_count,
              precision=precision, preferred_element_type=preferred_element_type)


def _nhwc_hwio(lhs, rhs, dimension_numbers) -> bool:
    if dimension_numbers is None:
        return False  # lax's default is NCHW x OIHW
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    return (tuple(dn.lhs_spec) == (0, 3, 1, 2) and tuple(dn.rhs_spec) == (3, 2, 0, 1)
            and tuple(dn.out_spec) == (0, 3, 1, 2))


def grouped_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                                 rhs_dilation=None, dimension_numbers=None,
                                 feature_group_count: int = 1, batch_group_count: int = 1,
                                 precision=None, preferred_element_type=None) -> jax.Array:
    """Grouped NHWC x HWIO convolutions without XLA:CPU's grouped-convolution path.

    * depthwise (``feature_group_count == C_in``, one input channel per group: MobileNetV2's
      and ShuffleNet's 3x3 convolutions): a sum over the ``kh * kw`` window offsets of strided
      slices times the per-channel tap,
      ``y[b,i,j,c] = sum_{u,v} x_pad[b, s i + u, s j + v, c] w[u, v, 0, c]``, which is
      elementwise work the CPU vectorises (and differentiates) well;
    * pointwise (1x1) with ``g`` groups: ``g`` matmuls batched in one ``einsum``;
    * anything else: ``lax.conv_general_dilated`` (correct everywhere).

    Same arguments and result as ``lax.conv_general_dilated`` (checked to 1e-5 in tests).
    """
    g = feature_group_count
    plain = (batch_group_count == 1 and _nhwc_hwio(lhs, rhs, dimension_numbers)
             and all(d == 1 for d in (lhs_dilation or (1, 1)))
             and all(d == 1 for d in (rhs_dilation or (1, 1))))
    kh, kw, cin_g, cout = rhs.shape
    if plain and g > 1 and cin_g == 1 and cout == lhs.shape[-1] == g:
        if isinstance(padding, str):
            padding = lax.padtype_to_pads(lhs.shape[1:3], (kh, kw), tuple(window_strides),
                                          padding)
        (t, b), (left, r) = padding
        x = jnp.pad(lhs, ((0, 0), (t, b), (left, r), (0, 0)))
        sh, sw = window_strides
        ho = (x.shape[1] - kh) // sh + 1
        wo = (x.shape[2] - kw) // sw + 1
        taps = [x[:, u:u + sh * (ho - 1) + 1:sh, v:v + sw * (wo - 1) + 1:sw, :] * rhs[u, v, 0]
                for u in range(kh) for v in range(kw)]
        return sum(taps[1:], taps[0])
    if (plain and g > 1 and kh == kw == 1 and tuple(window_strides) == (1, 1)
            and (isinstance(padding, str) or all(p == (0, 0) for p in padding))):
        bsz, h, w, cin = lhs.shape
        x = lhs.reshape(bsz, h, w, g, cin // g)
        k = rhs.reshape(cin_g, g, cout // g)
        y = jnp.einsum("bhwgi,igo->bhwgo", x, k, precision=precision,
                       preferred_element_type=preferred_element_type)
        return y.reshape(bsz, h, w, cout)
    return lax.conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation,
                                    rhs_dilation, dimension_numbers, g, batch_group_count,
                                    precision, preferred_element_type)


# PyTorch's default for Conv2d/Linear weights: kaiming_uniform(a=sqrt(5)), i.e. U(+-1/sqrt(fan_in)).
torch_kernel_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_bias_init(fan_in: int):
    """PyTorch's default bias init for Conv2d/Linear: U(+-1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class SplitBiasConv(nn.Conv):
    """An ``nn.Conv`` built with ``use_bias=False`` that also owns the ``bias`` parameter and
    returns ``(conv(x), bias)`` unsummed, for a next step that adds the bias in its own pass
    (``fedjax_rcl.nn.pool.bias_relu_max_pool``). Its parameters have ``nn.Conv``'s names and
    shapes and are created in its order, so a model's parameters, initial values and
    checkpoints are the same as with the biased layer."""

    @nn.compact
    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = super().__call__(inputs)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        return y, bias.astype(jnp.result_type(y, bias))


def torch_conv(
    in_features: int,
    features: int,
    kernel_size: int,
    *,
    stride: int = 1,
    padding: int = 0,
    use_bias: bool = True,
    groups: int = 1,
    kernel_init=None,
    split_bias: bool = False,
    name: str | None = None,
) -> nn.Conv:
    """A Flax ``Conv`` that behaves like ``torch.nn.Conv2d``: symmetric padding, PyTorch init.

    Flax's ``'SAME'`` pads a stride-2 3x3 convolution (0, 1); PyTorch's ``padding=1`` pads (1, 1).
    The explicit pair keeps the two identical. It computes with ``conv_general_dilated``: the
    implementation in force when it is traced (``implementation``); ``groups > 1`` gives
    grouped and depthwise convolutions. ``kernel_init`` overrides PyTorch's default
    initialisation. ``split_bias``: a ``SplitBiasConv``, returning ``(conv(x), bias)``.
    """
    if split_bias and not use_bias:
        raise ValueError("torch_conv: split_bias needs use_bias")
    return (SplitBiasConv if split_bias else nn.Conv)(
        features,
        (kernel_size, kernel_size),
        strides=(stride, stride),
        padding=((padding, padding), (padding, padding)),
        use_bias=use_bias and not split_bias,
        feature_group_count=groups,
        kernel_init=kernel_init or torch_kernel_init,
        bias_init=torch_bias_init(in_features // groups * kernel_size * kernel_size),
        conv_general_dilated=conv_general_dilated,
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
    "SplitBiasConv",
    "choose",
    "conv_general_dilated",
    "cpu_conv_general_dilated",
    "current_implementation",
    "grouped_conv_general_dilated",
    "implementation",
    "onednn_conv_general_dilated",
    "onednn_narrow_conv_general_dilated",
    "patch_conv_general_dilated",
    "prefers_rows",
    "resolve_conv_impl",
    "row_conv_general_dilated",
    "torch_bias_init",
    "torch_conv",
    "torch_dense",
    "torch_kernel_init",
    "under",
]

"""Group normalization (Wu & He, ECCV 2018) with its analytic gradient.

For a sample ``n`` and a group ``g`` of ``C/G`` channels over ``M = spatial x C/G`` values,

    x̂ = (x - μ) / σ,   μ = mean(x),   σ = sqrt(mean((x - μ)²) + ε),   y = γ x̂ + β,

with the two-pass variance (PyTorch's ``nn.GroupNorm``, the FedRCL reference's norm, is as
exact). Its gradient, with ``g = γ dy`` the gradient reaching x̂:

    dx = (g - mean(g) - x̂ mean(g x̂)) / σ,   dγ = Σ dy x̂,   dβ = Σ dy.

All four sums come from two per-(sample, channel) sums over the spatial positions, Σ dy and
Σ dy x̂, so the backward pass is one reduction over the activations and one element-wise pass
(what PyTorch's ``native_group_norm_backward`` does). Differentiating the forward formula
instead (Flax's ``nn.GroupNorm``) reduces over the activations about four times, for the
mean, the variance and their adjoints; in a ResNet-18 round on a CPU those reductions were
the largest cost outside the convolutions. Statistics and the gradient are computed in at
least float32 whatever the input's type; the output has the input's type.

``relu=True`` returns ``max(y, 0)`` and masks the incoming gradient inside the same passes (a
ReLU after a norm is every ResNet block's first half).

Two implementations of the same equations (``impl``): ``"xla"``, the formulas above compiled
by XLA, on every platform and type; ``"kernel"``, float32 C++ kernels on the CPU
(``csrc/group_norm.cc``, built with the oneDNN convolutions by ``fedjax_rcl.nn.onednn``): XLA's
CPU reductions read materialised inputs, so the compiled formulas still write and reread the
activation about ten times, where the kernels pass over it twice forward (statistics, output)
and twice backward (the two sums, the input gradient). The kernels accumulate in double and
compute the variance in one pass (exact to float32 unless |mean| / sd exceeds about 1e4).
``"auto"`` takes the kernels for float32 on a CPU where they can be built, XLA otherwise.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.nn import onednn

IMPLS = ("auto", "xla", "kernel")


def _grouped(x: jax.Array, num_groups: int) -> jax.Array:
    """``[N, ..., C]`` -> ``[N, S, G, C/G]`` (S: every position between N and C)."""
    return x.reshape(x.shape[0], -1, num_groups, x.shape[-1] // num_groups)


def _compute_type(x: jax.Array):
    return jnp.promote_types(x.dtype, jnp.float32)


def _xla_forward(x, scale, bias, num_groups, epsilon, relu):
    f32 = _compute_type(x)
    xg = _grouped(x, num_groups).astype(f32)
    mean = jnp.mean(xg, axis=(1, 3), keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xg - mean), axis=(1, 3), keepdims=True) + epsilon)
    gamma = scale.astype(f32).reshape(num_groups, -1)
    beta = bias.astype(f32).reshape(num_groups, -1)
    y = (xg - mean) * rstd * gamma + beta
    if relu:
        y = jnp.maximum(y, 0)
    return y.astype(x.dtype).reshape(x.shape), mean[:, 0, :, 0], rstd[:, 0, :, 0]


def _xla_backward(x, scale, bias, mean, rstd, dy, num_groups, relu):
    f32 = _compute_type(x)
    mean, rstd = mean[:, None, :, None], rstd[:, None, :, None]
    xg = _grouped(x, num_groups).astype(f32)
    dyg = _grouped(dy, num_groups).astype(f32)
    xhat = (xg - mean) * rstd
    gamma = scale.astype(f32).reshape(num_groups, -1)
    if relu:  # the forward's test: (x - mean) * rstd * gamma + beta > 0
        beta = bias.astype(f32).reshape(num_groups, -1)
        dyg = jnp.where(xhat * gamma + beta > 0, dyg, 0)
    sum_dy = jnp.sum(dyg, axis=1)  # [N, G, C/G]
    sum_dy_xhat = jnp.sum(dyg * xhat, axis=1)
    m = xg.shape[1] * xg.shape[3]
    mean_g = (jnp.sum(sum_dy * gamma, axis=-1) / m)[:, None, :, None]
    mean_g_xhat = (jnp.sum(sum_dy_xhat * gamma, axis=-1) / m)[:, None, :, None]
    dx = (rstd * (dyg * gamma - mean_g - xhat * mean_g_xhat)).astype(x.dtype).reshape(x.shape)
    dscale = jnp.sum(sum_dy_xhat, axis=0).reshape(scale.shape).astype(scale.dtype)
    dbias = jnp.sum(sum_dy, axis=0).reshape(bias.shape).astype(bias.dtype)
    return dx, dscale, dbias


def _kernel_forward(x, scale, bias, num_groups, epsilon, relu):
    stats = jax.ShapeDtypeStruct((x.shape[0], num_groups), jnp.float32)
    return onednn.call("fedjax_group_norm_forward",
                       (jax.ShapeDtypeStruct(x.shape, x.dtype), stats, stats), x, scale, bias,
                       groups=np.int64(num_groups), epsilon=np.float64(epsilon),
                       relu=np.int64(relu))


def _kernel_backward(x, scale, bias, mean, rstd, dy, num_groups, relu):
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, scale, bias))
    return onednn.call("fedjax_group_norm_backward", shapes, x, dy, scale, bias, mean, rstd,
                       groups=np.int64(num_groups), relu=np.int64(relu))


def _all_float32(*arrays) -> bool:
    return all(a.dtype == jnp.float32 for a in arrays)


def resolve_impl(impl: str, x: jax.Array, scale: jax.Array, bias: jax.Array) -> str:
    """``"kernel"`` or ``"xla"``: what ``impl`` means for these operands here."""
    if impl not in IMPLS:
        raise ValueError(f"group_norm: impl={impl!r}; allowed {IMPLS}")
    if impl != "auto":
        return impl
    on_cpu = jax.default_backend() == "cpu"
    return "kernel" if _all_float32(x, scale, bias) and on_cpu and onednn.available() else "xla"


def _forward(x, scale, bias, num_groups, epsilon, relu, impl):
    fwd = _kernel_forward if impl == "kernel" else _xla_forward
    y, mean, rstd = fwd(x, scale, bias, num_groups, epsilon, relu)
    return y, (x, scale, bias, mean, rstd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _group_norm(x, scale, bias, num_groups, epsilon, relu, impl):
    return _forward(x, scale, bias, num_groups, epsilon, relu, impl)[0]


def _backward(num_groups, epsilon, relu, impl, residuals, dy):
    bwd = _kernel_backward if impl == "kernel" else _xla_backward
    return tuple(bwd(*residuals, dy, num_groups, relu))


_group_norm.defvjp(_forward, _backward)


def group_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, num_groups: int,
               epsilon: float = 1e-5, relu: bool = False, impl: str = "auto") -> jax.Array:
    """``γ (x - μ)/σ + β`` over groups of channels, then ``max(·, 0)`` if ``relu`` (see the
    module docstring).

    Args:
      x: ``[N, ..., C]``; statistics are per sample and per group of ``C / num_groups``
        consecutive channels, over every axis but the first.
      scale, bias: ``[C]``.
      num_groups: divides ``C``.
      epsilon: added to the variance.
      relu: apply a ReLU to the output (and its mask to the gradient) in the same passes.
      impl: ``"auto"``, ``"xla"`` or ``"kernel"`` (the CPU kernels; float32 only).
    """
    if x.ndim < 2 or num_groups <= 0 or x.shape[-1] % num_groups:
        raise ValueError(f"group_norm: num_groups={num_groups} must divide the channels of an "
                         f"input [N, ..., C]; got shape {x.shape}")
    impl = resolve_impl(impl, x, scale, bias)
    if impl == "kernel" and not _all_float32(x, scale, bias):
        raise ValueError("group_norm: impl='kernel' computes float32 only; got "
                         f"{x.dtype}, {scale.dtype}, {bias.dtype}")
    return _group_norm(x, scale, bias, num_groups, float(epsilon), bool(relu), impl)


class GroupNorm(nn.Module):
    """``group_norm`` as a layer: parameters ``scale`` (ones) and ``bias`` (zeros) of shape
    ``[C]`` in ``param_dtype``, the names and shapes of Flax's ``nn.GroupNorm``.

    Attributes:
      num_groups: groups of channels (divides the channel count).
      epsilon: added to the variance (PyTorch's 1e-5 by default).
      param_dtype: the parameters' type.
    """

    num_groups: int = 2
    epsilon: float = 1e-5
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, relu: bool = False) -> jax.Array:
        """The normalised ``x``; with ``relu``, ``max(·, 0)`` of it in the same passes."""
        channels = x.shape[-1]  # group_norm checks that num_groups divides them
        scale = self.param("scale", nn.initializers.ones, (channels,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (channels,), self.param_dtype)
        return group_norm(x, scale, bias, self.num_groups, self.epsilon, relu)

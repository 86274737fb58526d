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
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp


def _grouped(x: jax.Array, num_groups: int) -> jax.Array:
    """``[N, ..., C]`` -> ``[N, S, G, C/G]`` (S: every position between N and C)."""
    return x.reshape(x.shape[0], -1, num_groups, x.shape[-1] // num_groups)


def _compute_type(x: jax.Array):
    return jnp.promote_types(x.dtype, jnp.float32)


def _forward(x, scale, bias, num_groups, epsilon):
    f32 = _compute_type(x)
    xg = _grouped(x, num_groups).astype(f32)
    mean = jnp.mean(xg, axis=(1, 3), keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xg - mean), axis=(1, 3), keepdims=True) + epsilon)
    gamma = scale.astype(f32).reshape(num_groups, -1)
    beta = bias.astype(f32).reshape(num_groups, -1)
    y = ((xg - mean) * rstd * gamma + beta).astype(x.dtype).reshape(x.shape)
    return y, (x, scale, bias, mean, rstd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def group_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, num_groups: int,
               epsilon: float = 1e-5) -> jax.Array:
    """``γ (x - μ)/σ + β`` over groups of channels (see the module docstring).

    Args:
      x: ``[N, ..., C]``; statistics are per sample and per group of ``C / num_groups``
        consecutive channels, over every axis but the first.
      scale, bias: ``[C]``.
      num_groups: divides ``C``.
      epsilon: added to the variance.
    """
    return _forward(x, scale, bias, num_groups, epsilon)[0]


def _backward(num_groups, epsilon, residuals, dy):
    x, scale, bias, mean, rstd = residuals
    f32 = _compute_type(x)
    xg = _grouped(x, num_groups).astype(f32)
    dyg = _grouped(dy, num_groups).astype(f32)
    xhat = (xg - mean) * rstd
    sum_dy = jnp.sum(dyg, axis=1)  # [N, G, C/G]
    sum_dy_xhat = jnp.sum(dyg * xhat, axis=1)
    gamma = scale.astype(f32).reshape(num_groups, -1)
    m = xg.shape[1] * xg.shape[3]
    mean_g = (jnp.sum(sum_dy * gamma, axis=-1) / m)[:, None, :, None]
    mean_g_xhat = (jnp.sum(sum_dy_xhat * gamma, axis=-1) / m)[:, None, :, None]
    dx = (rstd * (dyg * gamma - mean_g - xhat * mean_g_xhat)).astype(x.dtype).reshape(x.shape)
    dscale = jnp.sum(sum_dy_xhat, axis=0).reshape(scale.shape).astype(scale.dtype)
    dbias = jnp.sum(sum_dy, axis=0).reshape(bias.shape).astype(bias.dtype)
    return dx, dscale, dbias


group_norm.defvjp(_forward, _backward)


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
    def __call__(self, x: jax.Array) -> jax.Array:
        channels = x.shape[-1]
        if x.ndim < 2 or self.num_groups <= 0 or channels % self.num_groups:
            raise ValueError(f"GroupNorm: num_groups={self.num_groups} must divide the "
                             f"channels of an input [N, ..., C]; got shape {x.shape}")
        scale = self.param("scale", nn.initializers.ones, (channels,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (channels,), self.param_dtype)
        return group_norm(x, scale, bias, self.num_groups, self.epsilon)

"""Twin Normalization (MFCL): group normalization with statistics shared by two views."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
Dtype = Any
Initializer = nn.initializers.Initializer


def _check_group_size(group_size: Any) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}.")


VARIANCES = ("pooled", "views")


def _check_variance(variance: Any) -> None:
    if variance not in VARIANCES:
        raise ValueError(f"variance={variance!r}: allowed {VARIANCES}.")


def _standardize(x: Array, group_size: int, eps: float, paired: bool = True,
                 variance: str = "pooled") -> Array:
    """Twin-normalises ``x`` and returns it in the compute dtype (at least float32).

    With ``paired=False`` every row is its own sample (statistics over one view: GroupNorm),
    which is what a twin pair of identical views would give; evaluation uses it.
    """
    x = jnp.asarray(x)
    _check_group_size(group_size)
    _check_variance(variance)
    if x.ndim < 2:
        raise ValueError(
            f"twin_norm expects x of shape [2K, ..., C] (e.g. [2K, H, W, C]), got {x.shape}."
        )
    rows, channels = x.shape[0], x.shape[-1]
    views = 2 if paired else 1
    if paired and rows % 2:
        raise ValueError(
            f"twin_norm needs view pairs: the batch axis must hold 2K rows, row i and row i+K "
            f"being two views of one sample, got {rows} rows in x of shape {x.shape}. Stack the "
            "two augmented views along the batch axis (jnp.concatenate([v1, v2])); use "
            "GroupNorm for batches that are not view pairs."
        )
    if channels % group_size:
        raise ValueError(
            f"twin_norm group_size={group_size} must divide the channel count C={channels} "
            f"(x of shape {x.shape}); choose a divisor of {channels}."
        )
    compute_dtype = jnp.promote_types(x.dtype, jnp.float32)
    # [2K, *S, C] -> [view, sample, *S, group, within-group].
    grouped = x.astype(compute_dtype).reshape(
        views, rows // views, *x.shape[1:-1], channels // group_size, group_size
    )
    within = (*range(2, grouped.ndim - 2), grouped.ndim - 1)  # one view's group values
    if variance == "views":
        # Each view's own moments, averaged over the two views (the paper's listing).
        view_mean = jnp.mean(grouped, axis=within, keepdims=True)
        var = jnp.mean(jnp.mean(jnp.square(grouped - view_mean), axis=within, keepdims=True),
                       axis=0, keepdims=True)
        centered = grouped - jnp.mean(view_mean, axis=0, keepdims=True)
    else:
        mean = jnp.mean(grouped, axis=(0, *within), keepdims=True)
        centered = grouped - mean
        var = jnp.mean(jnp.square(centered), axis=(0, *within), keepdims=True)
    return (centered / jnp.sqrt(var + eps)).reshape(x.shape)


def twin_norm(x: Array, *, group_size: int, eps: float = 1e-5,
              variance: str = "pooled") -> Array:
    r"""Normalises each sample's two views jointly, per group of ``group_size`` channels.

    ``x`` holds 2K rows: rows i and i+K are two augmented views of sample i. For sample i and
    channel group g (``group_size`` consecutive channels), :math:`\Omega_{i,g}` is the set of
    all :math:`2\,H W\,|g|` values of group g in rows i and i+K:

    .. math::
      \mu_{i,g} = \frac{1}{|\Omega_{i,g}|} \sum_{v \in \Omega_{i,g}} v, \qquad
      \sigma^2_{i,g} = \frac{1}{|\Omega_{i,g}|} \sum_{v \in \Omega_{i,g}} (v - \mu_{i,g})^2,
      \qquad
      \hat x = \frac{x - \mu_{i,g}}{\sqrt{\sigma^2_{i,g} + \epsilon}} .

    ``variance="views"`` is the paper's code listing (its Table 18) instead of its Eq. 2: the
    same joint mean (the average of the two views' means), but the variance is the average of
    the two views' own variances, each about its own view's mean,
    :math:`\tfrac12(\sigma^2_{i,1,g} + \sigma^2_{i,2,g})`; Eq. 2's pooled variance is that plus
    :math:`\tfrac14(\mu_{i,1,g} - \mu_{i,2,g})^2`, so the two agree when the views' means do.

    Statistics are computed in at least float32 (two-pass population variance); the result has
    the dtype of ``x`` (float32 for integer inputs). A batch that is not made of view pairs
    (odd row count) or a ``group_size`` that does not divide C raises ``ValueError`` at trace
    time.

    Paper: Motamedi & Kim, "Modular Federated Contrastive Learning with Twin Normalization for
    Resource-limited Clients", TMLR (MFCL, Eq. 2). TN is GroupNorm whose statistics span both
    views of a sample, so they do not depend on the rest of the batch (unlike BatchNorm) and
    the two views are normalised identically.

    Args:
      x: ``[2K, H, W, C]`` (any ``[2K, ..., C]``) view pairs stacked as ``[views_1; views_2]``.
      group_size: channels per group; must divide C.
      eps: added to the variance.
      variance: ``"pooled"`` (Eq. 2) or ``"views"`` (the paper's Table 18 listing).

    Returns:
      ``[2K, H, W, C] -> [2K, H, W, C]``.
    """
    x = jnp.asarray(x)
    out_dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
    return _standardize(x, group_size, eps, variance=variance).astype(out_dtype)


class TwinNorm(nn.Module):
    r"""Twin Normalization layer: :func:`twin_norm` then a per-channel affine map.

    .. math::
      y = \gamma \odot \operatorname{twin\_norm}(x) + \beta

    with :math:`\gamma` (``scale``, init 1) and :math:`\beta` (``bias``, init 0) of shape
    ``[C]``. Like Flax's ``GroupNorm`` it has no state, so training and evaluation are the same
    computation; every call needs view pairs (an even batch, rows i and i+K paired), including
    ``init``.

    Paper: Motamedi & Kim, MFCL, TMLR (Eq. 2).

    Attributes:
      group_size: channels per group; must divide the input's C.
      num_groups: alternatively, the number of groups (``group_size = C // num_groups``), as in
        Flax's ``GroupNorm``; give exactly one of ``group_size`` and ``num_groups``.
      epsilon: added to the variance (1e-5).
      variance: ``"pooled"`` (Eq. 2, the default) or ``"views"`` (the paper's Table 18
        listing; see :func:`twin_norm`).
      use_scale: whether to learn ``scale`` :math:`\gamma`.
      use_bias: whether to learn ``bias`` :math:`\beta`.
      scale_init: initializer of ``scale``.
      bias_init: initializer of ``bias``.
      dtype: the output dtype (default: that of the input promoted with the parameters).
      param_dtype: the parameters' dtype.
    """

    group_size: int | None = None
    num_groups: int | None = None
    epsilon: float = 1e-5
    variance: str = "pooled"
    use_scale: bool = True
    use_bias: bool = True
    scale_init: Initializer = nn.initializers.ones
    bias_init: Initializer = nn.initializers.zeros
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32

    def __post_init__(self) -> None:
        if (self.group_size is None) == (self.num_groups is None):
            raise ValueError(
                "TwinNorm needs exactly one of group_size and num_groups, got "
                f"group_size={self.group_size!r}, num_groups={self.num_groups!r}."
            )
        if self.group_size is not None:
            _check_group_size(self.group_size)
        elif isinstance(self.num_groups, bool) or not (
            isinstance(self.num_groups, int) and self.num_groups > 0
        ):
            raise ValueError(f"num_groups must be a positive int, got {self.num_groups!r}.")
        _check_variance(self.variance)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: Array, *, paired: bool = True) -> Array:
        """Applies TN. ``[2K, ..., C] -> [2K, ..., C]``.

        ``paired=False`` (evaluation on single images) takes each row's statistics alone, which
        equals TN on the pair ``(x_i, x_i)``.
        """
        x = jnp.asarray(x)
        channels = x.shape[-1]
        group_size = self.group_size
        if group_size is None:
            if channels % self.num_groups:
                raise ValueError(
                    f"TwinNorm num_groups={self.num_groups} must divide the channel count "
                    f"C={channels} (x of shape {x.shape})."
                )
            group_size = channels // self.num_groups
        y = _standardize(x, group_size, self.epsilon, paired, self.variance)
        if self.use_scale:
            y = y * self.param("scale", self.scale_init, (channels,), self.param_dtype)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (channels,), self.param_dtype)
        dtype = self.dtype
        if dtype is None:
            dtype = jnp.promote_types(
                x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32,
                self.param_dtype,
            )
        return y.astype(dtype)

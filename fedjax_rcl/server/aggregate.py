"""Aggregation of client models: a weighted mean over the client axis (step 5 of the round)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGGREGATIONS = ("size", "uniform")


def weighted_mean(tree, weights: jax.Array):
    """Weighted mean over the leading (client) axis of every leaf.

    .. math::
        \\bar\\theta = \\frac{\\sum_k w_k \\theta_k}{\\sum_k w_k}

    Args:
      tree: pytree with leaves ``[clients, ...]``.
      weights: ``[clients]``, non-negative, not all zero (padded clients weigh 0).

    Returns:
      the pytree with leaves ``[...]``.
    """
    w = weights.astype(jnp.float32)
    sums = weighted_sum(tree, w / jnp.sum(w))
    return jax.tree.map(lambda s, x: s.astype(x.dtype), sums, tree)


def weighted_sum(tree, weights: jax.Array):
    """``sum_k w_k theta_k`` over the leading (client) axis of every leaf, in float32 (at
    least): with weights already divided by their total over the round's clients, the mean
    of ``weighted_mean`` taken piecewise — a group of clients at a time, or one device's
    clients — whose partial sums add up to it.

    Args:
      tree: pytree with leaves ``[clients, ...]``.
      weights: ``[clients]``.

    Returns:
      the pytree with leaves ``[...]``, of type ``promote(leaf, float32)``.
    """
    w = weights.astype(jnp.float32)
    return jax.tree.map(
        lambda x: jnp.tensordot(w, x.astype(jnp.promote_types(x.dtype, jnp.float32)),
                                axes=(0, 0)), tree)


def client_weights(sizes: jax.Array, aggregation: str) -> jax.Array:
    """``size``: weights proportional to client sample counts (FedAvg); ``uniform``: all equal
    (the FedRCL reference). The two agree on the paper's balanced partitions."""
    if aggregation == "size":
        return sizes.astype(jnp.float32)
    if aggregation == "uniform":
        return jnp.ones(sizes.shape, jnp.float32)
    raise ValueError(f"aggregation={aggregation!r}: allowed {AGGREGATIONS}")

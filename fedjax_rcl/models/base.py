"""What every model returns, so that algorithms can use any level of the network."""

from __future__ import annotations

from typing import NamedTuple

import jax


class ModelOutput(NamedTuple):
    """Output of a model's ``apply``.

    Attributes:
      logits: ``[B, num_classes]``.
      features: the multi-level features, each pre-ReLU and spatially mean-pooled to ``[B, C_l]``,
        from the earliest level to the last (FedRCL's levels, SPEC §5). Logits are not a level.
      embedding: ``[B, D]``, the representation the classifier reads (after the last ReLU and the
        global pool); MOON's projection head takes it.
    """

    logits: jax.Array
    features: tuple[jax.Array, ...]
    embedding: jax.Array


def spatial_mean(x: jax.Array) -> jax.Array:
    """``[B, H, W, C] -> [B, C]``; ``[B, C]`` passes through."""
    return x.mean(axis=(1, 2)) if x.ndim == 4 else x

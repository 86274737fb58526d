"""The stem and the classifier head that the CIFAR backbones share.

Both are functions called inside a model's ``@nn.compact`` ``__call__``: the layers they create
belong to that model under the names given here (``stem_conv``, ``stem_norm``, ``head``,
``projection``), so the parameter tree -- and the initial weights, which Flax draws by name --
are those of the model written out by hand.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax

from fedjax_rcl.models.base import ModelOutput, ProjectionHead, spatial_mean
from fedjax_rcl.nn.conv import torch_conv, torch_dense
from fedjax_rcl.nn.norm import Norm


def stem(x: jax.Array, features: int, *, norm: str, conv_impl: str, train: bool,
         levels: list, blocks: list, kernel_size: int = 3, use_bias: bool = True,
         activation: Callable[[jax.Array], jax.Array] = nn.relu,
         pool: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """A CIFAR stem: conv (stride 1, padding 1) -> norm -> activation (-> pool).

    The normalised output before the activation is the model's first feature level (FedRCL)
    and is appended to ``levels``; the stem's output is its first block (FedMLB), appended to
    ``blocks``.
    """
    x = torch_conv(x.shape[-1], features, kernel_size, padding=1, use_bias=use_bias,
                   conv_impl=conv_impl, name="stem_conv")(x)
    x = Norm(norm, name="stem_norm")(x, train=train)
    levels.append(x)
    x = activation(x)
    if pool is not None:
        x = pool(x)
    blocks.append(x)
    return x


def head(embedding: jax.Array, levels: list, blocks: list, *, num_classes: int,
         projection_dim: int | None, logits_from: jax.Array | None = None,
         classify_projection: bool = False) -> ModelOutput:
    """The classifier on the embedding (``dense -> logits``), MOON's projection head when
    ``projection_dim`` is set, and the model's ``ModelOutput`` (levels pooled to ``[B, C]``).

    ``logits_from``: what the classifier reads when it is not the embedding itself (pfl's CNN
    applies dropout between the two). ``classify_projection``: the classifier reads the
    projection head's output instead, as MOON's authors' ``ModelFedCon`` stacks them (features
    -> projection -> classifier), for every method of their tables.
    """
    if classify_projection:
        if not projection_dim:
            raise ValueError("classify_projection needs a projection head (projection_dim)")
        z = ProjectionHead(projection_dim, name="projection")(embedding)
        logits = torch_dense(projection_dim, num_classes, name="head")(z)
    else:
        x = embedding if logits_from is None else logits_from
        logits = torch_dense(x.shape[-1], num_classes, name="head")(x)
        z = ProjectionHead(projection_dim, name="projection")(embedding) if projection_dim else None
    return ModelOutput(logits, tuple(spatial_mean(f) for f in levels), embedding, z,
                       tuple(blocks))

"""The skeleton the CIFAR backbones share: the stem, the stages of blocks, the classifier head.

Each is a function called inside a model's ``@nn.compact`` ``__call__``: the layers they create
belong to that model under the names given here (``stem_conv``, ``stem_norm``,
``stage{s}_{unit}{b}``, ``head``, ``projection``), so the parameter tree -- and the initial
weights, which Flax draws by name -- are those of the model written out by hand. A backbone
states its stages as data (``Stage``) and its block as a module class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import flax.linen as nn
import jax

from fedjax_rcl.models.base import ModelOutput, ProjectionHead, spatial_mean
from fedjax_rcl.nn.conv import torch_conv, torch_dense
from fedjax_rcl.nn.norm import Norm


def stem(x: jax.Array, features: int, *, norm: str, train: bool,
         levels: list, blocks: list, kernel_size: int = 3, use_bias: bool = True,
         activation: Callable[[jax.Array], jax.Array] = nn.relu,
         pool: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """A CIFAR stem: conv (stride 1, padding 1) -> norm -> activation (-> pool).

    The normalised output before the activation is the model's first feature level (FedRCL)
    and is appended to ``levels``; the stem's output is its first block (FedMLB), appended to
    ``blocks``.
    """
    x = torch_conv(x.shape[-1], features, kernel_size, padding=1, use_bias=use_bias,
                   name="stem_conv")(x)
    x = Norm(norm, name="stem_norm")(x, train=train)
    levels.append(x)
    x = activation(x)
    if pool is not None:
        x = pool(x)
    blocks.append(x)
    return x


class Stage(NamedTuple):
    """One stage of a backbone: ``blocks`` blocks of ``features`` output channels, the first
    with stride ``stride`` and the others 1; ``options``: the block's further positional
    arguments (MobileNetV2's expansion). A plain tuple in this order serves as well."""

    features: int
    blocks: int
    stride: int = 1
    options: tuple = ()


def stages(x: jax.Array, specs: Sequence[Stage | tuple], block: Callable[..., nn.Module], *,
           train: bool, levels: list, blocks: list, start: int = 0,
           activation: Callable[[jax.Array], jax.Array] | None = None, unit: str = "block",
           feeds_head: bool = False) -> jax.Array:
    """The stages ``specs`` on ``x``, each block ``block(features, stride, *options)``.

    Stage ``s`` (from 1) is the model's block ``s`` (FedMLB's; block 0 is the stem) and is
    skipped when ``s < start``; its blocks are named ``stage{s}_{unit}{b}`` (``b`` from 1).
    ``activation`` follows every block (None: the block ends in its own). Each stage appends
    its level to ``levels`` -- its last block's output before the activation, FedRCL's
    pre-ReLU rule -- and its output to ``blocks``; ``feeds_head``: the last stage's output
    goes to the head unrecorded (MobileNetV2's reference takes its levels so).
    """
    for s, spec in enumerate(specs, 1):
        if s < start:
            continue
        features, n, stride, options = Stage(*spec)
        for b in range(n):
            x = block(features, stride if b == 0 else 1, *options,
                      name=f"stage{s}_{unit}{b + 1}")(x, train=train)
            level = x
            if activation is not None:
                x = activation(x)
        if not (feeds_head and s == len(specs)):
            levels.append(level)
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

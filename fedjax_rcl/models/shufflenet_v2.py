"""ShuffleNet v2 for 32x32 images (Ma, Zhang, Zheng, Sun, ECCV 2018, arXiv 1807.11164), the
common CIFAR variant at width 1x, with GroupNorm by default.

Stem conv3x3(3 -> 24, padding 1, no bias) -> norm -> ReLU (no max-pool at 32x32); three
stages (116, 232, 464 channels; 4, 8, 4 units, the first of each with stride 2); conv1x1(464 ->
1024) -> norm -> ReLU; global average pool; dense(classes). A stride-1 unit splits the channels
in half, keeps one half and runs the other through conv1x1 -> norm -> ReLU -> depthwise conv3x3
-> norm -> conv1x1 -> norm -> ReLU, concatenates and shuffles the channels (2 groups). A
stride-2 unit runs the whole input through two branches (depthwise conv3x3 stride 2 -> norm ->
conv1x1 -> norm -> ReLU; and conv1x1 -> norm -> ReLU -> depthwise conv3x3 stride 2 -> norm ->
conv1x1 -> norm -> ReLU), each to half the output channels, concatenated and shuffled.
Convolutions without bias, PyTorch-default initialisation. 1,263,854 parameters for 10
classes.

FedRCL's Table C uses ShuffleNet v1 (``model=shufflenet``); this is the v2 of MOON-style
comparisons. Levels (FedRCL): the stem's normalised output before its ReLU, and each stage's
output (after the final shuffle; every branch ends in a ReLU, so there is no pre-activation
tensor to take). Blocks (FedMLB): the stem after its ReLU and the three stages.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_rcl.models.base import ModelOutput
from fedjax_rcl.models.parts import Stage, head, stages, stem
from fedjax_rcl.models.shufflenet import channel_shuffle
from fedjax_rcl.nn.conv import torch_conv
from fedjax_rcl.nn.norm import Norm

STAGES = (Stage(116, 4, 2), Stage(232, 8, 2), Stage(464, 4, 2))


class ShuffleUnitV2(nn.Module):
    """One ShuffleNet v2 unit (module docstring)."""

    features: int
    stride: int
    norm: str = "group"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        def conv(h, cout, k, name, stride=1, groups=1):
            h = torch_conv(h.shape[-1], cout, k, stride=stride, padding=k // 2, groups=groups,
                           use_bias=False, name=f"{name}_conv")(h)
            return Norm(self.norm, name=f"{name}_norm")(h, train=train)

        half = self.features // 2
        if self.stride == 1:
            keep, y = jnp.split(x, 2, axis=-1)
            y = nn.relu(conv(y, half, 1, "pw1"))
            y = conv(y, half, 3, "dw", groups=half)
            y = nn.relu(conv(y, half, 1, "pw2"))
            return channel_shuffle(jnp.concatenate([keep, y], axis=-1), 2)
        cin = x.shape[-1]
        left = conv(x, cin, 3, "left_dw", stride=2, groups=cin)
        left = nn.relu(conv(left, half, 1, "left_pw"))
        y = nn.relu(conv(x, half, 1, "pw1"))
        y = conv(y, half, 3, "dw", stride=2, groups=half)
        y = nn.relu(conv(y, half, 1, "pw2"))
        return channel_shuffle(jnp.concatenate([left, y], axis=-1), 2)


class ShuffleNetV2(nn.Module):
    """CIFAR ShuffleNet v2, width 1x (see the module docstring)."""

    num_classes: int
    norm: str = "group"
    projection_dim: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = True, start: int = 0) -> ModelOutput:
        """Images to a ``ModelOutput``; ``start=k >= 1`` enters after block ``k - 1`` (the
        stem, then stages 1-3) on ``ModelOutput.blocks[k - 1]`` (FedMLB)."""
        levels, blocks = [], []
        if start == 0:
            x = stem(x, 24, norm=self.norm, train=train, levels=levels, blocks=blocks,
                     use_bias=False)
        x = stages(x, STAGES, functools.partial(ShuffleUnitV2, norm=self.norm), train=train,
                   levels=levels, blocks=blocks, start=start, unit="unit")
        x = torch_conv(x.shape[-1], 1024, 1, use_bias=False, name="head_conv")(x)
        x = nn.relu(Norm(self.norm, name="head_norm")(x, train=train))
        return head(x.mean(axis=(1, 2)), levels, blocks, num_classes=self.num_classes,
                    projection_dim=self.projection_dim)


def build(num_classes, *, norm="group", projection_dim=None):
    """The builder of ``model=shufflenet_v2`` (registered by ``fedjax_rcl.models``)."""
    return ShuffleNetV2(num_classes, norm=norm, projection_dim=projection_dim)

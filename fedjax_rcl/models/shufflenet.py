"""ShuffleNet for 32x32 images (Zhang, Zhou, Lin, Sun, CVPR 2018, arXiv 1707.01083), FedRCL's
Table C backbone: the CIFAR variant with 3 groups the FedRCL authors use (ShuffleNet v1, not
v2), with GroupNorm.

Stem conv3x3(3 -> 24, padding 1) -> norm -> ReLU; three stages of ShuffleNet units (4, 8, 4
units; 240, 480, 960 channels; the first unit of each stage has stride 2). A unit is a grouped
conv1x1 (3 groups, to a quarter of the output channels) -> norm -> ReLU -> channel shuffle ->
depthwise conv3x3 (stride) -> norm -> grouped conv1x1 (3 groups) -> norm, added to the input,
or for a stride-2 unit concatenated after a 3x3 average pool (stride 2, padding 1, zeros
counted) of the input, then ReLU. Global average pool, dense(classes). PyTorch-default
initialisation, convolutions with bias, as the reference (whose stage-2 exception for the first
grouped convolution never applies: every unit's first 1x1 is grouped). 925,618 parameters for
10 classes.

Levels (FedRCL): the stem's normalised output and each stage's output before its final ReLU
(after the add or concatenation), the rule of the ResNets (the reference takes them
after the ReLU). Blocks (FedMLB): the stem and the three stages, after their ReLU.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_rcl.models.base import ModelOutput
from fedjax_rcl.models.parts import Stage, head, stages, stem
from fedjax_rcl.nn.conv import torch_conv
from fedjax_rcl.nn.norm import Norm

GROUPS = 3
STAGES = (Stage(240, 4, 2), Stage(480, 8, 2), Stage(960, 4, 2))


def channel_shuffle(x: jax.Array, groups: int) -> jax.Array:
    """``[B, H, W, g * n]``: channel ``i * n + j`` moves to ``j * g + i`` (PyTorch's
    ``view(B, g, n, H, W).transpose(1, 2)``), so the next grouped convolution sees every
    group's channels."""
    b, h, w, c = x.shape
    return x.reshape(b, h, w, groups, c // groups).swapaxes(3, 4).reshape(b, h, w, c)


def avg_pool_3x3_s2(x: jax.Array) -> jax.Array:
    """``torch.nn.AvgPool2d(3, stride=2, padding=1)``: zero padding counted in the mean."""
    xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    ho, wo = (x.shape[1] + 1) // 2, (x.shape[2] + 1) // 2
    taps = [xp[:, u:u + 2 * (ho - 1) + 1:2, v:v + 2 * (wo - 1) + 1:2] for u in range(3)
            for v in range(3)]
    return sum(taps[1:], taps[0]) / 9.0


class ShuffleUnit(nn.Module):
    """One ShuffleNet unit; returns its output before the final ReLU."""

    features: int
    stride: int
    norm: str = "group"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        cin = x.shape[-1]
        mid = self.features // 4
        concat = self.stride != 1 or cin != self.features
        out = self.features - cin if concat else self.features
        y = torch_conv(cin, mid, 1, groups=GROUPS, name="squeeze")(x)
        y = nn.relu(Norm(self.norm, name="norm1")(y, train=train))
        y = channel_shuffle(y, GROUPS)
        y = torch_conv(mid, mid, 3, stride=self.stride, padding=1, groups=mid,
                       name="depthwise")(y)
        y = Norm(self.norm, name="norm2")(y, train=train)
        y = torch_conv(mid, out, 1, groups=GROUPS, name="expand")(y)
        y = Norm(self.norm, name="norm3")(y, train=train)
        if concat:
            return jnp.concatenate([avg_pool_3x3_s2(x), y], axis=-1)
        return x + y


class ShuffleNet(nn.Module):
    """FedRCL's CIFAR ShuffleNet, 3 groups (see the module docstring)."""

    num_classes: int
    norm: str = "group"
    projection_dim: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = True, start: int = 0) -> ModelOutput:
        """Images to a ``ModelOutput``; ``start=k >= 1`` enters after block ``k - 1`` (the
        stem, then stages 1-3) on ``ModelOutput.blocks[k - 1]`` (FedMLB)."""
        levels, blocks = [], []
        if start == 0:
            x = stem(x, 24, norm=self.norm, train=train, levels=levels, blocks=blocks)
        x = stages(x, STAGES, functools.partial(ShuffleUnit, norm=self.norm), train=train,
                   levels=levels, blocks=blocks, start=start, activation=nn.relu, unit="unit")
        return head(x.mean(axis=(1, 2)), levels, blocks, num_classes=self.num_classes,
                    projection_dim=self.projection_dim)


def build(num_classes, *, norm="group", projection_dim=None):
    """The builder of ``model=shufflenet`` (registered by ``fedjax_rcl.models``)."""
    return ShuffleNet(num_classes, norm=norm, projection_dim=projection_dim)

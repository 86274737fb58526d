"""MobileNetV2 for 32x32 images (Sandler et al., CVPR 2018), FedRCL's Table C backbone: the
CIFAR variant the FedRCL authors use, with GroupNorm.

Stem: conv1x1(3 -> 32, padding 1, as the reference: a zero border, 34x34) -> norm -> ReLU6.
Seven stages of linear bottlenecks ``(repeats, out, stride, expansion)``: (1, 16, 1, 1),
(2, 24, 2, 6), (3, 32, 2, 6), (4, 64, 2, 6), (3, 96, 1, 6), (3, 160, 1, 6), (1, 320, 1, 6);
a bottleneck is conv1x1 (expand) -> norm -> ReLU6 -> depthwise conv3x3 (stride) -> norm ->
ReLU6 -> conv1x1 (project) -> norm, plus the input when the shapes agree. Then conv1x1(320 ->
1280) -> norm -> ReLU6, global average pool, dense(classes) (the reference's 1x1 conv on the
pooled map is the same map). PyTorch-default initialisation, convolutions with bias, as the
reference. 2,254,090 parameters for 10 classes.

Levels (FedRCL): the stem's normalised output before its ReLU6, and stages 1-6's outputs (a
linear bottleneck has no activation after it: its output is already pre-activation) -- the
reference's seven ``layer`` outputs. Blocks (FedMLB): the stem after its ReLU6 and stages 1-6.
The depthwise convolutions run as shifted slices on CPU (``grouped_conv_general_dilated``).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax

from fedjax_rcl.models.base import ModelOutput
from fedjax_rcl.models.parts import Stage, head, stages, stem
from fedjax_rcl.nn.conv import torch_conv
from fedjax_rcl.nn.norm import Norm

# (output channels, blocks, first stride, (expansion,)) per stage.
STAGES = (Stage(16, 1, 1, (1,)), Stage(24, 2, 2, (6,)), Stage(32, 3, 2, (6,)),
          Stage(64, 4, 2, (6,)), Stage(96, 3, 1, (6,)), Stage(160, 3, 1, (6,)),
          Stage(320, 1, 1, (6,)))


class LinearBottleneck(nn.Module):
    """MobileNetV2's inverted residual with a linear projection (module docstring)."""

    features: int
    stride: int
    expansion: int
    norm: str = "group"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        cin = x.shape[-1]
        hidden = cin * self.expansion
        y = torch_conv(cin, hidden, 1, name="expand")(x)
        y = nn.relu6(Norm(self.norm, name="norm1")(y, train=train))
        y = torch_conv(hidden, hidden, 3, stride=self.stride, padding=1, groups=hidden,
                       name="depthwise")(y)
        y = nn.relu6(Norm(self.norm, name="norm2")(y, train=train))
        y = torch_conv(hidden, self.features, 1, name="project")(y)
        y = Norm(self.norm, name="norm3")(y, train=train)
        return x + y if self.stride == 1 and cin == self.features else y


class MobileNetV2(nn.Module):
    """FedRCL's CIFAR MobileNetV2 (see the module docstring)."""

    num_classes: int
    norm: str = "group"
    projection_dim: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = True, start: int = 0) -> ModelOutput:
        """Images to a ``ModelOutput``; ``start=k >= 1`` enters after block ``k - 1`` (the
        stem, then stages 1-6) on ``ModelOutput.blocks[k - 1]`` (FedMLB)."""
        levels, blocks = [], []
        if start == 0:
            x = stem(x, 32, norm=self.norm, train=train, levels=levels, blocks=blocks,
                     kernel_size=1, activation=nn.relu6)
        # Stage 7 feeds the head directly, as the reference.
        x = stages(x, STAGES, functools.partial(LinearBottleneck, norm=self.norm), train=train,
                   levels=levels, blocks=blocks, start=start, feeds_head=True)
        x = torch_conv(x.shape[-1], 1280, 1, name="head_conv")(x)
        x = nn.relu6(Norm(self.norm, name="head_norm")(x, train=train))
        return head(x.mean(axis=(1, 2)), levels, blocks, num_classes=self.num_classes,
                    projection_dim=self.projection_dim)


def build(num_classes, *, norm="group", projection_dim=None):
    """The builder of ``model=mobilenet_v2`` (registered by ``fedjax_rcl.models``)."""
    return MobileNetV2(num_classes, norm=norm, projection_dim=projection_dim)

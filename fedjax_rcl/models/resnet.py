"""CIFAR ResNets with GroupNorm, as FedRCL's reference ``ResNet18_base``.

Stem conv3x3(3->64, stride 1, pad 1, no bias) -> GN -> [level 0] -> ReLU; four stages of two
BasicBlocks (widths 64/128/256/512, first-block strides 1/2/2/2); each stage's last block output
(after the residual add, before its ReLU) is a level; global average pool -> dense(classes).
GroupNorm with 2 groups and eps 1e-5 everywhere (``norm`` may choose BatchNorm or TwinNorm);
convolutions padded symmetrically like PyTorch.
11,173,962 parameters for 10 classes (same count as the reference).

``resnet50`` uses ``Bottleneck`` blocks (3, 4, 6, 3; 23,520,842 parameters for 10 classes), the
same five levels.

The same structure at CPU scale: ``width`` scales every stage (``width=16``: 16/32/64/128
channels, 1/16 of the multiply-adds) and ``resnet10`` keeps one BasicBlock per stage. Both keep
what FedRCL's multi-level loss depends on -- a GroupNorm stem level and four residual stage
levels, pre-ReLU -- which MOON's small CNN lacks (its conv1 level has 6 channels and no
normalization; FedRCL collapses it).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax

from fedjax_rcl.models.base import ModelOutput
from fedjax_rcl.models.parts import Stage, head, stages, stem
from fedjax_rcl.nn.conv import torch_conv
from fedjax_rcl.nn.norm import Norm


class BasicBlock(nn.Module):
    """conv3x3 -> norm -> ReLU -> conv3x3 -> norm, plus (projected) shortcut; returns pre-ReLU."""

    features: int
    stride: int = 1
    norm: str = "group"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        cin = x.shape[-1]
        y = torch_conv(cin, self.features, 3, stride=self.stride, padding=1, use_bias=False,
                       name="conv1")(x)
        y = Norm(self.norm, name="norm1")(y, train=train, relu=True)
        y = torch_conv(self.features, self.features, 3, padding=1, use_bias=False,
                       name="conv2")(y)
        y = Norm(self.norm, name="norm2")(y, train=train)
        if self.stride != 1 or cin != self.features:
            x = torch_conv(cin, self.features, 1, stride=self.stride, use_bias=False,
                           name="shortcut_conv")(x)
            x = Norm(self.norm, name="shortcut_norm")(x, train=train)
        return x + y


class Bottleneck(nn.Module):
    """conv1x1 -> norm -> ReLU -> conv3x3 (stride) -> norm -> ReLU -> conv1x1 (x4) -> norm, plus
    (projected) shortcut; returns pre-ReLU. ResNet-50's block (He et al. 2016), stride on the
    3x3 convolution as torchvision's."""

    features: int  # the bottleneck width; the block outputs 4 * features channels
    stride: int = 1
    norm: str = "group"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        cin, width, out = x.shape[-1], self.features, 4 * self.features
        y = torch_conv(cin, width, 1, use_bias=False, name="conv1")(x)
        y = Norm(self.norm, name="norm1")(y, train=train, relu=True)
        y = torch_conv(width, width, 3, stride=self.stride, padding=1, use_bias=False,
                       name="conv2")(y)
        y = Norm(self.norm, name="norm2")(y, train=train, relu=True)
        y = torch_conv(width, out, 1, use_bias=False, name="conv3")(y)
        y = Norm(self.norm, name="norm3")(y, train=train)
        if self.stride != 1 or cin != out:
            x = torch_conv(cin, out, 1, stride=self.stride, use_bias=False,
                           name="shortcut_conv")(x)
            x = Norm(self.norm, name="shortcut_norm")(x, train=train)
        return x + y


# Blocks per stage, and whether they are bottlenecks, of each depth.
DEPTHS = {10: ((1, 1, 1, 1), False), 18: ((2, 2, 2, 2), False), 34: ((3, 4, 6, 3), False),
          50: ((3, 4, 6, 3), True)}


def resnet_stages(blocks_per_stage, width: int = 64) -> tuple[Stage, ...]:
    """A CIFAR ResNet's stages of ``blocks_per_stage`` blocks: ``width`` channels doubling
    from stage to stage (``w, 2w, 4w, 8w``), the first stage at stride 1 and each later one
    halving the resolution."""
    widths = [width * 2**s for s in range(len(blocks_per_stage))]
    return tuple(Stage(w, n, 1 if s == 0 else 2)
                 for s, (w, n) in enumerate(zip(widths, blocks_per_stage, strict=True)))


class ResNet(nn.Module):
    """CIFAR-stem ResNet.

    Attributes:
      num_classes: output classes.
      stages: ``(channels, blocks, stride)`` per stage (``parts.Stage``; ``resnet_stages``):
        ResNet-18's are ``(64, 2, 1), (128, 2, 2), (256, 2, 2), (512, 2, 2)``.
      norm: normalization kind (``fedjax_rcl.nn.norm.NORMS``).
      projection_dim: output size of a MOON projection head on the embedding; None: no head.
      bottleneck: ``Bottleneck`` blocks (ResNet-50: stage outputs ``4 x`` the channels)
        instead of ``BasicBlock``.
    """

    num_classes: int
    stages: tuple[Stage, ...] = resnet_stages((2, 2, 2, 2))
    norm: str = "group"
    projection_dim: int | None = None
    bottleneck: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = True, start: int = 0) -> ModelOutput:
        """Images ``[B, H, W, C]`` to a ``ModelOutput``.

        ``start=k >= 1`` enters after block ``k - 1`` (blocks: the stem, then each stage), ``x``
        being that block's activation ``ModelOutput.blocks[k - 1]``: FedMLB's hybrid paths run
        the global model's blocks ``k ..`` on a local model's activation. ``start`` is static.
        """
        levels, blocks = [], []
        if start == 0:
            x = stem(x, self.stages[0][0], norm=self.norm, train=train, levels=levels,
                     blocks=blocks, use_bias=False)
        block = functools.partial(Bottleneck if self.bottleneck else BasicBlock, norm=self.norm)
        x = stages(x, self.stages, block, train=train, levels=levels, blocks=blocks,
                   start=start, activation=nn.relu)
        return head(x.mean(axis=(1, 2)), levels, blocks, num_classes=self.num_classes,
                    projection_dim=self.projection_dim)


def resnet(num_classes: int, *, depth: int, width: int = 64, **kw) -> ResNet:
    """The CIFAR ResNet of ``depth`` (``DEPTHS``) whose first stage has ``width`` channels."""
    blocks_per_stage, bottleneck = DEPTHS[depth]
    return ResNet(num_classes, stages=resnet_stages(blocks_per_stage, width),
                  bottleneck=bottleneck, **kw)


def resnet10(num_classes: int, *, width: int = 64, **kw) -> ResNet:
    """One BasicBlock per stage: ResNet-18's levels at about half its depth."""
    return resnet(num_classes, depth=10, width=width, **kw)


def resnet18(num_classes: int, *, width: int = 64, **kw) -> ResNet:
    return resnet(num_classes, depth=18, width=width, **kw)


def resnet34(num_classes: int, *, width: int = 64, **kw) -> ResNet:
    return resnet(num_classes, depth=34, width=width, **kw)


def resnet50(num_classes: int, *, width: int = 64, **kw) -> ResNet:
    """Bottleneck blocks (3, 4, 6, 3), stage outputs 256/512/1024/2048 at width 64 (MOON's
    backbone, with the CIFAR stem)."""
    return resnet(num_classes, depth=50, width=width, **kw)


def build(num_classes, *, depth: int, norm="group", width=None, projection_dim=None) -> ResNet:
    """The builder of ``model=resnet10`` .. ``resnet50`` (``depth``) that ``fedjax_rcl.models``
    registers; ``width`` None: 64."""
    return resnet(num_classes, depth=depth, width=64 if width is None else width, norm=norm,
                  projection_dim=projection_dim)

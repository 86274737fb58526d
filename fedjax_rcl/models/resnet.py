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

import flax.linen as nn
import jax

from fedjax_rcl.models.base import ModelOutput
from fedjax_rcl.models.parts import head, stem
from fedjax_rcl.nn.conv import torch_conv
from fedjax_rcl.nn.norm import Norm


class BasicBlock(nn.Module):
    """conv3x3 -> norm -> ReLU -> conv3x3 -> norm, plus (projected) shortcut; returns pre-ReLU."""

    features: int
    stride: int = 1
    norm: str = "group"
    conv_impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        cin = x.shape[-1]
        y = torch_conv(cin, self.features, 3, stride=self.stride, padding=1, use_bias=False,
                       conv_impl=self.conv_impl, name="conv1")(x)
        y = Norm(self.norm, name="norm1")(y, train=train, relu=True)
        y = torch_conv(self.features, self.features, 3, padding=1, use_bias=False,
                       conv_impl=self.conv_impl, name="conv2")(y)
        y = Norm(self.norm, name="norm2")(y, train=train)
        if self.stride != 1 or cin != self.features:
            x = torch_conv(cin, self.features, 1, stride=self.stride, use_bias=False,
                           conv_impl=self.conv_impl, name="shortcut_conv")(x)
            x = Norm(self.norm, name="shortcut_norm")(x, train=train)
        return x + y


class Bottleneck(nn.Module):
    """conv1x1 -> norm -> ReLU -> conv3x3 (stride) -> norm -> ReLU -> conv1x1 (x4) -> norm, plus
    (projected) shortcut; returns pre-ReLU. ResNet-50's block (He et al. 2016), stride on the
    3x3 convolution as torchvision's."""

    features: int  # the bottleneck width; the block outputs 4 * features channels
    stride: int = 1
    norm: str = "group"
    conv_impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        cin, width, out = x.shape[-1], self.features, 4 * self.features
        y = torch_conv(cin, width, 1, use_bias=False, conv_impl=self.conv_impl, name="conv1")(x)
        y = Norm(self.norm, name="norm1")(y, train=train, relu=True)
        y = torch_conv(width, width, 3, stride=self.stride, padding=1, use_bias=False,
                       conv_impl=self.conv_impl, name="conv2")(y)
        y = Norm(self.norm, name="norm2")(y, train=train, relu=True)
        y = torch_conv(width, out, 1, use_bias=False, conv_impl=self.conv_impl, name="conv3")(y)
        y = Norm(self.norm, name="norm3")(y, train=train)
        if self.stride != 1 or cin != out:
            x = torch_conv(cin, out, 1, stride=self.stride, use_bias=False,
                           conv_impl=self.conv_impl, name="shortcut_conv")(x)
            x = Norm(self.norm, name="shortcut_norm")(x, train=train)
        return x + y


class ResNet(nn.Module):
    """CIFAR-stem ResNet with BasicBlocks.

    Attributes:
      num_classes: output classes.
      stage_sizes: blocks per stage, ``(2, 2, 2, 2)`` for ResNet-18, ``(3, 4, 6, 3)`` for 34.
      widths: channels per stage.
      norm: normalization kind (``fedjax_rcl.nn.norm.NORMS``).
      conv_impl: ``"auto" | "cpu" | "patches" | "rows" | "native"``.
      projection_dim: output size of a MOON projection head on the embedding; None: no head.
      bottleneck: ``Bottleneck`` blocks (ResNet-50: stage outputs ``4 x`` the widths) instead
        of ``BasicBlock``.
    """

    num_classes: int
    stage_sizes: tuple[int, ...] = (2, 2, 2, 2)
    widths: tuple[int, ...] = (64, 128, 256, 512)
    norm: str = "group"
    conv_impl: str = "auto"
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
            x = stem(x, self.widths[0], norm=self.norm, conv_impl=self.conv_impl, train=train,
                     levels=levels, blocks=blocks, use_bias=False)
        for s, (n_blocks, width) in enumerate(zip(self.stage_sizes, self.widths, strict=True)):
            if s + 1 < start:  # stage s is block s + 1
                continue
            for b in range(n_blocks):
                stride = 2 if (s > 0 and b == 0) else 1
                block = Bottleneck if self.bottleneck else BasicBlock
                x = block(width, stride, self.norm, self.conv_impl,
                          name=f"stage{s + 1}_block{b + 1}")(x, train=train)
                if b == n_blocks - 1:
                    levels.append(x)
                x = nn.relu(x)
            blocks.append(x)
        return head(x.mean(axis=(1, 2)), levels, blocks, num_classes=self.num_classes,
                    projection_dim=self.projection_dim)


def stage_widths(width: int) -> tuple[int, ...]:
    """The four stage widths of a CIFAR ResNet whose first stage has ``width`` channels."""
    return (width, 2 * width, 4 * width, 8 * width)


def resnet10(num_classes: int, *, width: int = 64, **kw) -> ResNet:
    """One BasicBlock per stage: ResNet-18's levels at about half its depth."""
    return ResNet(num_classes, stage_sizes=(1, 1, 1, 1), widths=stage_widths(width), **kw)


def resnet18(num_classes: int, *, width: int = 64, **kw) -> ResNet:
    return ResNet(num_classes, stage_sizes=(2, 2, 2, 2), widths=stage_widths(width), **kw)


def resnet34(num_classes: int, *, width: int = 64, **kw) -> ResNet:
    return ResNet(num_classes, stage_sizes=(3, 4, 6, 3), widths=stage_widths(width), **kw)


def resnet50(num_classes: int, *, width: int = 64, **kw) -> ResNet:
    """Bottleneck blocks (3, 4, 6, 3), stage outputs 256/512/1024/2048 at width 64 (MOON's
    backbone, with the CIFAR stem)."""
    return ResNet(num_classes, stage_sizes=(3, 4, 6, 3), widths=stage_widths(width),
                  bottleneck=True, **kw)


def build(num_classes, *, depth: int, conv_impl="auto", norm="group", width=None,
          projection_dim=None) -> ResNet:
    """The builder of ``model=resnet10`` .. ``resnet50`` (``depth``) that ``fedjax_rcl.models``
    registers; ``width`` None: 64."""
    make = {10: resnet10, 18: resnet18, 34: resnet34, 50: resnet50}[depth]
    return make(num_classes, width=64 if width is None else width, norm=norm,
                conv_impl=conv_impl, projection_dim=projection_dim)

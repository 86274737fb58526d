"""SqueezeNet for 32x32 images (Iandola et al. 2016, arXiv 1602.07360), FedRCL's Table C
backbone: the CIFAR variant with simple bypasses the FedRCL authors use, with GroupNorm.

Stem conv3x3(3 -> 96, padding 1) -> norm -> ReLU -> maxpool 2; Fire modules ``(out,
squeeze)``: fire2 (128, 16), fire3 (128, 16) + bypass, fire4 (256, 32) + maxpool, fire5 (256,
32) + bypass, fire6 (384, 48), fire7 (384, 48) + bypass, fire8 (512, 64) + maxpool, fire9
(512, 64); a Fire module is squeeze conv1x1 -> norm -> ReLU, then the concatenation of
conv1x1 and conv3x3 expansions (``out / 2`` each, -> norm -> ReLU). The classifier, the
reference's conv1x1(512 -> classes) then global average pool, is the same map as pooling first
and a dense layer, which this computes. PyTorch-default initialisation, convolutions with bias.
734,986 parameters for 10 classes.

Levels (FedRCL): the stem's normalised output before its ReLU, then the outputs of fire2-fire8
(after the bypass and pool), as the reference's eight ``layer`` outputs. A Fire module ends in
two ReLU branches concatenated: it has no single pre-activation tensor, so those levels are
post-ReLU. Blocks (FedMLB): the stem after ReLU and pool, then fire2-fire8's outputs.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_rcl.models.base import ModelOutput
from fedjax_rcl.models.parts import head, stem
from fedjax_rcl.nn.conv import torch_conv
from fedjax_rcl.nn.norm import Norm
from fedjax_rcl.nn.pool import max_pool

# (out, squeeze, bypass, pool after) for fire2 .. fire9
FIRES = ((128, 16, False, False), (128, 16, True, False), (256, 32, False, True),
         (256, 32, True, False), (384, 48, False, False), (384, 48, True, False),
         (512, 64, False, True), (512, 64, False, False))


class Fire(nn.Module):
    """SqueezeNet's Fire module (module docstring)."""

    features: int
    squeeze: int
    norm: str = "group"

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        def conv_norm_relu(h, cout, k, name):
            h = torch_conv(h.shape[-1], cout, k, padding=k // 2, name=f"{name}_conv")(h)
            return nn.relu(Norm(self.norm, name=f"{name}_norm")(h, train=train))

        s = conv_norm_relu(x, self.squeeze, 1, "squeeze")
        half = self.features // 2
        return jnp.concatenate([conv_norm_relu(s, half, 1, "expand1x1"),
                                conv_norm_relu(s, half, 3, "expand3x3")], axis=-1)


class SqueezeNet(nn.Module):
    """FedRCL's CIFAR SqueezeNet (see the module docstring)."""

    num_classes: int
    norm: str = "group"
    projection_dim: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = True, start: int = 0) -> ModelOutput:
        """Images to a ``ModelOutput``; ``start=k >= 1`` enters after block ``k - 1`` (the
        stem, then fire2-fire8) on ``ModelOutput.blocks[k - 1]`` (FedMLB)."""
        levels, blocks = [], []
        if start == 0:
            x = stem(x, 96, norm=self.norm, train=train, levels=levels, blocks=blocks,
                     pool=lambda h: max_pool(h, 2))
        for i, (out, squeeze, bypass, pool) in enumerate(FIRES):
            if i + 1 < start:
                continue
            y = Fire(out, squeeze, self.norm, name=f"fire{i + 2}")(x, train=train)
            x = y + x if bypass else y
            if pool:
                x = max_pool(x, 2)
            if i + 1 < len(FIRES):  # fire9 feeds the classifier, as the reference
                levels.append(x)
                blocks.append(x)
        return head(x.mean(axis=(1, 2)), levels, blocks, num_classes=self.num_classes,
                    projection_dim=self.projection_dim)


def build(num_classes, *, norm="group", projection_dim=None):
    """The builder of ``model=squeezenet`` (registered by ``fedjax_rcl.models``)."""
    return SqueezeNet(num_classes, norm=norm, projection_dim=projection_dim)

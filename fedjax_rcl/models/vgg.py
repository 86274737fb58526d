"""VGG-9 for 32x32 images, FedRCL's Table C backbone (after FedMA's VGG-9, Wang et al., ICLR
2020, with the FedRCL authors' GroupNorm).

Six conv3x3 layers (32, 64, 128, 128, 256, 256 channels, bias, padding 1), each followed by
the normalisation (GroupNorm with 2 groups by default) and ReLU, a 2x2 max-pool after the 2nd,
4th and 6th; an adaptive average pool to 4x4; dense 4096 -> 512 -> ReLU -> 512 -> ReLU ->
classes. Convolutions are initialised N(0, 2 / (9 * C_out)) with zero bias (He, fan-out), as the
reference; dense layers as PyTorch's default. 3,493,258 parameters for 10 classes.

Levels (FedRCL): the six conv layers' normalised outputs, before the ReLU -- VGG has no stages,
so each layer is a level, as the reference's six ``layer`` outputs (which it takes after the
ReLU/pool; pre-ReLU keeps one rule for every model here). Blocks (FedMLB): the six
layers' outputs after ReLU and pool.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fedjax_rcl.models.base import ModelOutput
from fedjax_rcl.models.parts import head
from fedjax_rcl.nn.conv import torch_conv, torch_dense
from fedjax_rcl.nn.norm import Norm
from fedjax_rcl.nn.pool import max_pool

WIDTHS = (32, 64, 128, 128, 256, 256)
he_fan_out = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def adaptive_avg_pool(x: jax.Array, size: int) -> jax.Array:
    """``[B, H, W, C] -> [B, size, size, C]`` by averaging equal tiles (``H, W`` multiples of
    ``size``), as ``torch.nn.AdaptiveAvgPool2d`` does then."""
    b, h, w, c = x.shape
    if h % size or w % size:
        raise ValueError(f"adaptive_avg_pool: {h}x{w} is not a multiple of {size}x{size}")
    return x.reshape(b, size, h // size, size, w // size, c).mean(axis=(2, 4))


class VGG9(nn.Module):
    """FedRCL's VGG-9 (see the module docstring).

    Attributes:
      num_classes: output classes.
      norm: normalisation kind (``fedjax_rcl.nn.norm.NORMS``).
      projection_dim: output size of a MOON projection head on the embedding; None: no head.
    """

    num_classes: int
    norm: str = "group"
    projection_dim: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = True, start: int = 0) -> ModelOutput:
        """Images to a ``ModelOutput``; ``start=k >= 1`` enters after layer ``k`` on its
        activation ``ModelOutput.blocks[k - 1]`` (FedMLB). ``start`` is static."""
        levels, blocks = [], []
        for i, width in enumerate(WIDTHS):
            if i < start:
                continue
            x = torch_conv(x.shape[-1], width, 3, padding=1, kernel_init=he_fan_out,
                           name=f"conv{i + 1}")(x)
            x = Norm(self.norm, name=f"norm{i + 1}")(x, train=train)
            levels.append(x)
            x = nn.relu(x)
            if i % 2 == 1:
                x = max_pool(x, 2)
            blocks.append(x)
        x = adaptive_avg_pool(x, 4).reshape(x.shape[0], -1)
        x = nn.relu(torch_dense(x.shape[-1], 512, name="fc1")(x))
        x = nn.relu(torch_dense(512, 512, name="fc2")(x))
        return head(x, levels, blocks, num_classes=self.num_classes,
                    projection_dim=self.projection_dim)


def build(num_classes, *, norm="group", projection_dim=None):
    """The builder of ``model=vgg9`` (registered by ``fedjax_rcl.models``)."""
    return VGG9(num_classes, norm=norm, projection_dim=projection_dim)

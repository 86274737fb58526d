"""MOON's small CNN for 32x32 images (Li et al., CVPR 2021, arXiv 2103.16257).

conv5x5(C->6) -> ReLU -> maxpool2 -> conv5x5(6->16) -> ReLU -> maxpool2 -> flatten(400)
-> dense 120 -> ReLU -> dense 84 -> ReLU -> dense(num_classes).
Levels (pre-ReLU): the two conv outputs and the two hidden dense outputs.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fedjax_rcl.models.base import ModelOutput, spatial_mean
from fedjax_rcl.models.parts import head
from fedjax_rcl.nn.conv import torch_conv, torch_dense
from fedjax_rcl.nn.pool import bias_relu_max_pool


class SmallCNN(nn.Module):
    """MOON's ``SimpleCNN`` with PyTorch-default initialisation.

    Attributes:
      num_classes: output classes.
      projection_dim: output size of a MOON projection head on the embedding; None: no head.
      classify_projection: the classifier reads the projection head's output (MOON's
        ``ModelFedCon``) rather than the embedding.
    """

    num_classes: int
    projection_dim: int | None = None
    classify_projection: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = True, start: int = 0) -> ModelOutput:
        """Images ``[B, 32, 32, C]`` to a ``ModelOutput``; ``start=k >= 1`` enters after block
        ``k - 1`` (blocks: conv1+pool, conv2+pool, fc1, fc2) on its activation
        ``ModelOutput.blocks[k - 1]`` (FedMLB's hybrid paths). ``start`` is static."""
        del train  # no train/test difference in this model
        levels, blocks = [], []
        for i, width in enumerate((6, 16)):
            if i < start:
                continue
            y, bias = torch_conv(x.shape[-1], width, 5, split_bias=True, name=f"conv{i + 1}")(x)
            # The level pooled here, mean(y) + bias: mean(y + bias) up to rounding, without
            # a full-size add forward and a full-size sum for the bias's gradient (computed
            # only where an algorithm reads the levels).
            levels.append(spatial_mean(y) + bias)
            x = bias_relu_max_pool(y, bias, 2)
            blocks.append(x)
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate((120, 84)):
            if i + 2 < start:
                continue
            x = torch_dense(x.shape[-1], width, name=f"fc{i + 1}")(x)
            levels.append(x)
            x = nn.relu(x)
            blocks.append(x)
        return head(x, levels, blocks, num_classes=self.num_classes,
                    projection_dim=self.projection_dim,
                    classify_projection=self.classify_projection)


def build(num_classes, *, norm="group", projection_dim=None):
    """The builder of ``model=cnn`` (registered by ``fedjax_rcl.models``)."""
    del norm  # no normalization layers; "group" is the config's default
    return SmallCNN(num_classes, projection_dim=projection_dim)


def build_fedcon(num_classes, *, norm="group", projection_dim=None):
    """The builder of ``model=moon_cnn`` (registered by ``fedjax_rcl.models``): the CNN, a
    projection head and the classifier on the projection's output."""
    del norm
    return SmallCNN(num_classes, projection_dim=projection_dim or 256, classify_projection=True)

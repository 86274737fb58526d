"""pfl-research's CIFAR-10 CNN (Granqvist et al., "pfl-research: simulation framework for
accelerating research in Private Federated Learning", 2024, arXiv 2404.06430), the model of its
CIFAR-10 benchmark (``experiments/pfl_cifar10.yaml``).

conv3x3(C->32, valid) -> ReLU -> conv3x3(32->64, valid) -> ReLU -> maxpool2 -> dropout 0.25
-> flatten -> dense 128 -> ReLU -> dropout 0.5 -> dense(num_classes); 1,626,442 parameters for
32x32x3 inputs and 10 classes. Dropout is active when training and draws its masks from the
``"dropout"`` key the engine passes every local step, one random byte per element
(``fedjax_rcl.nn.dropout``). At batch 50 a client's training step costs 5 GFLOP, so on a CPU
clients train one after another (``fedjax_rcl.engine.layout``): a client's 6.5 MB of weights,
most of them the dense layer's, then stay in cache through its steps, where 50 vmapped
clients' weights do not (BENCHMARKS.md, the pfl workload).
Levels (pre-ReLU): the two conv outputs and the hidden dense output. Blocks (FedMLB): conv1,
conv2 + pool, dense 128.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fedjax_rcl.models.base import ModelOutput, spatial_mean
from fedjax_rcl.models.parts import head
from fedjax_rcl.nn.conv import torch_conv, torch_dense
from fedjax_rcl.nn.dropout import Dropout
from fedjax_rcl.nn.pool import bias_relu_max_pool


class PflCNN(nn.Module):
    """pfl-research's CIFAR-10 CNN with PyTorch-default initialisation.

    Attributes:
      num_classes: output classes.
      projection_dim: output size of a MOON projection head on the embedding; None: no head.
      dropout: the two dropout rates (after the pool, after the hidden dense layer).
    """

    num_classes: int
    projection_dim: int | None = None
    dropout: tuple[float, float] = (0.25, 0.5)

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = True, start: int = 0) -> ModelOutput:
        """Images ``[B, H, W, C]`` to a ``ModelOutput``; ``start=k >= 1`` enters after block
        ``k - 1`` on its activation ``ModelOutput.blocks[k - 1]`` (FedMLB). ``start`` is
        static."""
        levels, blocks = [], []
        for i, width in enumerate((32, 64)):
            if i < start:
                continue
            if i == 1:  # the pool takes the bias, the ReLU and their gradients in its pass
                y, bias = torch_conv(x.shape[-1], width, 3, split_bias=True,
                                     name=f"conv{i + 1}")(x)
                # The level pooled here, mean(y) + bias: mean(y + bias) up to rounding, without
                # a full-size add forward and a full-size sum for the bias's gradient (computed
                # only where an algorithm reads the levels).
                levels.append(spatial_mean(y) + bias)
                x = bias_relu_max_pool(y, bias, 2)
            else:
                x = torch_conv(x.shape[-1], width, 3, name=f"conv{i + 1}")(x)
                levels.append(x)
                x = nn.relu(x)
            blocks.append(x)
        if start <= 2:
            x = Dropout(self.dropout[0], deterministic=not train)(x)
            x = x.reshape(x.shape[0], -1)
            x = torch_dense(x.shape[-1], 128, name="fc1")(x)
            levels.append(x)
            x = nn.relu(x)
            blocks.append(x)
        dropped = Dropout(self.dropout[1], deterministic=not train)(x)
        return head(x, levels, blocks, num_classes=self.num_classes,
                    projection_dim=self.projection_dim, logits_from=dropped)


def build(num_classes, *, norm="group", projection_dim=None):
    """The builder of ``model=pfl_cnn`` (registered by ``fedjax_rcl.models``)."""
    del norm  # no normalization layers; "group" is the config's default
    return PflCNN(num_classes, projection_dim=projection_dim)

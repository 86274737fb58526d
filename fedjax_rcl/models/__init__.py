"""Models that return logits and multi-level features (``ModelOutput``)."""

from __future__ import annotations

import flax.linen as nn

from fedjax_rcl import registry
from fedjax_rcl.models.base import (
    ModelFns,
    ModelOutput,
    ModelState,
    ProjectionHead,
    model_fns,
    spatial_mean,
)
from fedjax_rcl.models.cnn import SmallCNN
from fedjax_rcl.models.mobilenet import MobileNetV2
from fedjax_rcl.models.pfl_cnn import PflCNN
from fedjax_rcl.models.resnet import (
    BasicBlock,
    Bottleneck,
    ResNet,
    resnet10,
    resnet18,
    resnet34,
    resnet50,
)
from fedjax_rcl.models.shufflenet import ShuffleNet
from fedjax_rcl.models.shufflenet_v2 import ShuffleNetV2
from fedjax_rcl.models.squeezenet import SqueezeNet
from fedjax_rcl.models.vgg import VGG9


def get_model(name: str, *, num_classes: int, conv_impl: str = "auto", norm: str = "group",
              projection_dim: int | None = None, width: int | None = None,
              **extra) -> nn.Module:
    """Builds a registered model (``fedjax_rcl.registry``) by its config name.

    Args:
      name: a registered model (built in: cnn, pfl_cnn, resnet10, resnet18, resnet34,
        resnet50, vgg9, mobilenet_v2, squeezenet, shufflenet, shufflenet_v2).
      num_classes: size of the classifier output.
      conv_impl: ``"auto" | "cpu" | "patches" | "rows" | "native"`` (see ``fedjax_rcl.nn.conv``).
      norm: normalization kind for models that have one (the CNN has none).
      projection_dim: add a MOON projection head with this output size.
      width: channels of a ResNet's first stage (stages ``w, 2w, 4w, 8w``); None: 64.
      extra: model-specific arguments an algorithm asks for (``AlgorithmEntry.model_kwargs``,
        e.g. MFCL's ``group_size``).
    """
    entry = registry.model(name)
    return entry.build(num_classes, conv_impl=conv_impl, norm=norm, width=width,
                       projection_dim=projection_dim, **extra)


__all__ = [
    "BasicBlock",
    "Bottleneck",
    "ModelFns",
    "ModelOutput",
    "MobileNetV2",
    "ModelState",
    "PflCNN",
    "ProjectionHead",
    "ResNet",
    "ShuffleNet",
    "ShuffleNetV2",
    "SmallCNN",
    "SqueezeNet",
    "VGG9",
    "get_model",
    "model_fns",
    "resnet10",
    "resnet18",
    "resnet34",
    "resnet50",
    "spatial_mean",
]

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


def input_size_problem(name: str, dataset: str, image_shape: tuple[int, ...]) -> str | None:
    """The line that refuses images ``[H, W, C]`` smaller than the smallest input the
    registered model ``name`` takes (``ModelEntry.min_input_size``), or None when they fit
    or the model states no minimum: said before compiling, where the model's first layer
    that does not fit would otherwise fail inside JAX."""
    smallest = registry.model(name).min_input_size
    height, width = image_shape[:2]
    if smallest is None or min(height, width) >= smallest:
        return None
    return (f"model={name}: takes images of at least {smallest}x{smallest}; dataset={dataset} "
            f"has {height}x{width} images (choose a model for images this small, or larger "
            "images)")


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
    "input_size_problem",
    "model_fns",
    "resnet10",
    "resnet18",
    "resnet34",
    "resnet50",
    "spatial_mean",
]

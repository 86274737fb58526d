"""Models that return logits and multi-level features (``ModelOutput``)."""

from __future__ import annotations

import flax.linen as nn

from fedjax_rcl.models.base import ModelOutput, spatial_mean
from fedjax_rcl.models.cnn import SmallCNN
from fedjax_rcl.models.resnet import BasicBlock, ResNet, resnet18, resnet34

MODELS = ("cnn", "resnet18", "resnet34")


def get_model(name: str, *, num_classes: int, conv_impl: str = "auto",
              norm: str = "group") -> nn.Module:
    """Builds a model by its config name.

    Args:
      name: one of ``MODELS``.
      num_classes: size of the classifier output.
      conv_impl: ``"auto" | "patches" | "native"`` (see ``fedjax_rcl.nn.conv``).
      norm: normalization kind for models that have one.
    """
    if name == "cnn":
        return SmallCNN(num_classes, conv_impl=conv_impl)
    if name == "resnet18":
        return resnet18(num_classes, norm=norm, conv_impl=conv_impl)
    if name == "resnet34":
        return resnet34(num_classes, norm=norm, conv_impl=conv_impl)
    raise ValueError(f"model={name!r}: allowed {MODELS}")


__all__ = [
    "MODELS",
    "BasicBlock",
    "ModelOutput",
    "ResNet",
    "SmallCNN",
    "get_model",
    "resnet18",
    "resnet34",
    "spatial_mean",
]

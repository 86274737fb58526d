"""Models that return logits and multi-level features (``ModelOutput``)."""

from __future__ import annotations

import flax.linen as nn

from fedjax_rcl.models.base import (
    ModelFns,
    ModelOutput,
    ModelState,
    ProjectionHead,
    model_fns,
    spatial_mean,
)
from fedjax_rcl.models.cnn import SmallCNN
from fedjax_rcl.models.resnet import BasicBlock, ResNet, resnet18, resnet34

MODELS = ("cnn", "resnet18", "resnet34")
# Number of feature levels each model returns (FedRCL's multi-level loss uses them).
MODEL_LEVELS = {"cnn": 4, "resnet18": 5, "resnet34": 5}


def get_model(name: str, *, num_classes: int, conv_impl: str = "auto", norm: str = "group",
              projection_dim: int | None = None) -> nn.Module:
    """Builds a model by its config name.

    Args:
      name: one of ``MODELS``.
      num_classes: size of the classifier output.
      conv_impl: ``"auto" | "cpu" | "patches" | "rows" | "native"`` (see ``fedjax_rcl.nn.conv``).
      norm: normalization kind for models that have one (the CNN has none).
      projection_dim: add a MOON projection head with this output size.
    """
    if name == "cnn":
        return SmallCNN(num_classes, conv_impl=conv_impl, projection_dim=projection_dim)
    kw = dict(norm=norm, conv_impl=conv_impl, projection_dim=projection_dim)
    if name == "resnet18":
        return resnet18(num_classes, **kw)
    if name == "resnet34":
        return resnet34(num_classes, **kw)
    raise ValueError(f"model={name!r}: allowed {MODELS}")


__all__ = [
    "MODELS",
    "MODEL_LEVELS",
    "BasicBlock",
    "ModelFns",
    "ModelOutput",
    "ModelState",
    "ProjectionHead",
    "ResNet",
    "SmallCNN",
    "get_model",
    "model_fns",
    "resnet18",
    "resnet34",
    "spatial_mean",
]

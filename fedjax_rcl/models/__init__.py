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
from fedjax_rcl.models.resnet import BasicBlock, ResNet, resnet10, resnet18, resnet34

MODELS = ("cnn", "resnet10", "resnet18", "resnet34")
# Number of feature levels each model returns (FedRCL's multi-level loss uses them).
MODEL_LEVELS = {"cnn": 4, "resnet10": 5, "resnet18": 5, "resnet34": 5}
# Models whose width can be set (``width``: channels of the first stage); the default is 64.
WIDTH_MODELS = ("resnet10", "resnet18", "resnet34")
_RESNETS = {"resnet10": resnet10, "resnet18": resnet18, "resnet34": resnet34}


def get_model(name: str, *, num_classes: int, conv_impl: str = "auto", norm: str = "group",
              projection_dim: int | None = None, width: int | None = None) -> nn.Module:
    """Builds a model by its config name.

    Args:
      name: one of ``MODELS``.
      num_classes: size of the classifier output.
      conv_impl: ``"auto" | "cpu" | "patches" | "rows" | "native"`` (see ``fedjax_rcl.nn.conv``).
      norm: normalization kind for models that have one (the CNN has none).
      projection_dim: add a MOON projection head with this output size.
      width: channels of a ResNet's first stage (stages ``w, 2w, 4w, 8w``); None: 64.
    """
    if name == "cnn":
        if width is not None:
            raise ValueError(f"width={width}: model=cnn has a fixed width")
        return SmallCNN(num_classes, conv_impl=conv_impl, projection_dim=projection_dim)
    if name not in _RESNETS:
        raise ValueError(f"model={name!r}: allowed {MODELS}")
    return _RESNETS[name](num_classes, width=64 if width is None else width, norm=norm,
                          conv_impl=conv_impl, projection_dim=projection_dim)


__all__ = [
    "MODELS",
    "MODEL_LEVELS",
    "WIDTH_MODELS",
    "BasicBlock",
    "ModelFns",
    "ModelOutput",
    "ModelState",
    "ProjectionHead",
    "ResNet",
    "SmallCNN",
    "get_model",
    "model_fns",
    "resnet10",
    "resnet18",
    "resnet34",
    "spatial_mean",
]

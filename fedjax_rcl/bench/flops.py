"""FLOPs of one forward pass or one training step of a registered model, for GFLOP/s figures.

One counter for every benchmark row, ours or PyTorch's: 2 per multiply-add of every
convolution and matrix product, padding positions included (as PyTorch's and the papers'
counts), read from our own model's traced program by ``fedjax_rcl.engine.layout``'s
``jaxpr_flops`` (the count the simulator's client-layout cost model runs on). The PyTorch
reference's models mirror ours layer for layer, so the same number stands for both sides;
``tests/test_torch_reference.py`` checks it against a count of the PyTorch models' own layers.
Normalization, activations, pooling and the losses are left out: they are O(activations), not
O(activations x fan-in) (for ResNet-18 well under 1% of the total).

    forward_flops("cnn")                         # 1,303,440
    forward_flops("resnet18")                    # 1,110,845,440
    forward_flops("resnet10", width=16)
    train_step_flops("cnn", "moon", batch=50)

Nothing is compiled or run: the model is initialised and traced on abstract values.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from fedjax_rcl.engine import layout
from fedjax_rcl.models import get_model, model_fns


@functools.cache
def forward_flops(model_name: str, *, num_classes: int = 10, image_size: int = 32,
                  in_channels: int = 3, projection_dim: int | None = None,
                  width: int | None = None) -> int:
    """FLOPs of one forward pass of one image through the registered model ``model_name``.

    Args:
      model_name: a registered model (``fedjax_rcl.models.get_model``).
      num_classes: classifier outputs.
      image_size: square input side.
      in_channels: input channels.
      projection_dim: MOON's projection head output, or None for no head.
      width: a ResNet's first-stage channels (stages double it); None: the model's default.
    """
    # The native convolution: every implementation counts the same (tests/test_layout.py), and
    # this one needs no kernel built.
    fns = model_fns(get_model(model_name, num_classes=num_classes,
                              projection_dim=projection_dim, width=width), conv_impl="native")
    shape = (image_size, image_size, in_channels)
    sample = jax.ShapeDtypeStruct((1, *shape), np.float32)
    params, model_state = jax.eval_shape(fns.init, jax.random.PRNGKey(0), sample)
    return int(layout.forward_flops(fns.apply, params, model_state, shape, 1))


def train_step_flops(model_name: str, algorithm: str, batch: int, *, num_classes: int = 10,
                     image_size: int = 32, in_channels: int = 3, projection_dim: int = 256,
                     width: int | None = None) -> int:
    """FLOPs of one local step over ``batch`` images: the forward and the backward (twice the
    forward; ``layout.TRAIN_STEP_FACTOR`` in all), and for MOON the projection head and the two
    gradient-free forwards of the global and the previous local model."""
    moon = algorithm == "moon"
    f = forward_flops(model_name, num_classes=num_classes, image_size=image_size,
                      in_channels=in_channels, projection_dim=projection_dim if moon else None,
                      width=width)
    return batch * f * (layout.TRAIN_STEP_FACTOR + (2 if moon else 0))

"""Models that return logits and multi-level features (``ModelOutput``), and the built-in ones'
registry entries.

Each built-in model is registered here with what the config checks before anything is built --
its feature levels, the norms it takes, whether ``width=`` applies, its FedMLB blocks and its
smallest input -- and a builder that imports the model's module only when it builds, so that
validating ``model=`` or ``norm=`` imports no model code (a plugin's model registers from its
own module instead). ``tests/test_backbones.py`` and ``tests/test_models.py`` hold these
declarations to the models themselves. The model classes (``ResNet``, ``VGG9``, ...) are
attributes of this package, imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

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


# One loader per model module: imports and returns it (a static import, which the import
# graph of tests/test_architecture.py sees).
def _cnn() -> ModuleType:
    from fedjax_rcl.models import cnn

    return cnn


def _mfcl() -> ModuleType:
    from fedjax_rcl.models import mfcl

    return mfcl


def _mobilenet() -> ModuleType:
    from fedjax_rcl.models import mobilenet

    return mobilenet


def _pfl_cnn() -> ModuleType:
    from fedjax_rcl.models import pfl_cnn

    return pfl_cnn


def _resnet() -> ModuleType:
    from fedjax_rcl.models import resnet

    return resnet


def _shufflenet() -> ModuleType:
    from fedjax_rcl.models import shufflenet

    return shufflenet


def _shufflenet_v2() -> ModuleType:
    from fedjax_rcl.models import shufflenet_v2

    return shufflenet_v2


def _squeezenet() -> ModuleType:
    from fedjax_rcl.models import squeezenet

    return squeezenet


def _vgg() -> ModuleType:
    from fedjax_rcl.models import vgg

    return vgg


def _lazy(load: Callable[[], ModuleType], attr: str = "build", **fixed) -> Callable:
    """A registry builder that imports its model's module when it builds: ``load()`` returns
    the module, whose ``attr(num_classes, **fixed, **options)`` builds the model."""

    def build(num_classes, **options):
        return getattr(load(), attr)(num_classes, **fixed, **options)

    return build


_NORMS = ("group", "batch", "twin")
# Levels: the two conv outputs and the two hidden dense outputs, pre-ReLU. Blocks (FedMLB):
# conv1+pool, conv2+pool, fc1, fc2.
# Smallest input: two valid 5x5 convolutions, each followed by a 2x2 pool: H -> (H - 4) // 2
# -> ((H - 4) // 2 - 4) // 2 >= 1 needs H >= 16 (at 14 and 15 the second pool is empty; below,
# the second convolution does not fit).
# On a CPU the two small CNNs compile without XLA's YNNPACK fusions: their max-pools then run
# as XLA's own loops, and their rounds take less time (BENCHMARKS.md); pfl_cnn and the ResNets
# keep XLA's default, under which they are faster.
_NO_YNN_FUSIONS = (("xla_cpu_experimental_ynn_fusion_type", ""),)
# And their processes let the OpenMP threads under the oneDNN kernels spin longer between calls:
# a compiled round's process has several XLA threads that call the kernels, each leading an
# OpenMP team, so libgomp counts more threads than cores and by default lets them spin 100 times
# before they sleep; ACTIVE makes that 1,000, and the spin count keeps libgomp's own 300,000
# where a process has one team, so that an idle process never keeps a core busy. MOON's Table 1
# round took 0.88x the time, bitwise the same; ResNet-18's 1.03-1.07x, so the others keep
# libgomp's defaults (BENCHMARKS.md, "Figures behind the code's choices").
_SPIN_BETWEEN_CALLS = (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"))
registry.register_model("cnn", _lazy(_cnn), num_levels=4, norms=("group",), num_blocks=4,
                        min_input_size=16, cpu_xla_options=_NO_YNN_FUSIONS,
                        cpu_thread_env=_SPIN_BETWEEN_CALLS)
# MOON's tables train every method on its ``ModelFedCon(simple-cnn)``: the same CNN, then the
# projection head (84 -> 84 -> 256 by default, ``moon.projection_dim`` under MOON) and the
# classifier on the projection's output.
registry.register_model("moon_cnn", _lazy(_cnn, "build_fedcon"), num_levels=4,
                        norms=("group",), num_blocks=4, min_input_size=16,
                        cpu_xla_options=_NO_YNN_FUSIONS, cpu_thread_env=_SPIN_BETWEEN_CALLS)
# Smallest input: every convolution is padded (a stride-2 3x3 with padding 1 maps H to
# (H + 1) // 2 >= 1), and there is no pool before the global mean: any H >= 1.
registry.register_model("mobilenet_v2", _lazy(_mobilenet), num_levels=7, norms=_NORMS,
                        num_blocks=7, min_input_size=1)
# Smallest input: two valid 3x3 convolutions and a 2x2 pool: (H - 4) // 2 >= 1, H >= 6.
registry.register_model("pfl_cnn", _lazy(_pfl_cnn), num_levels=3, norms=("group",),
                        num_blocks=3, min_input_size=6)
for _depth in (10, 18, 34, 50):
    # Levels: the stem's normalised output and each stage's output (FedRCL's five levels).
    # Blocks (FedMLB): the stem and the four stages, as the FedMLB authors cut ResNet-18.
    # Smallest input: the CIFAR stem has no pool, and the stride-2 stages' 3x3 (padding 1)
    # and 1x1 shortcut convolutions map H to (H + 1) // 2 >= 1: any H >= 1.
    registry.register_model(f"resnet{_depth}", _lazy(_resnet, depth=_depth), num_levels=5,
                            norms=_NORMS, width=True, num_blocks=5, min_input_size=1)
# Smallest input: the stride-2 depthwise convolutions and the shortcut's 3x3 average pool are
# padded by 1 (H -> (H + 1) // 2 >= 1): any H >= 1.
registry.register_model("shufflenet", _lazy(_shufflenet), num_levels=4, norms=_NORMS,
                        num_blocks=4, min_input_size=1)
# Smallest input: the stride-2 depthwise convolutions are padded by 1 (H -> (H + 1) // 2 >= 1),
# and there is no pool before the global mean: any H >= 1.
registry.register_model("shufflenet_v2", _lazy(_shufflenet_v2), num_levels=4, norms=_NORMS,
                        num_blocks=4, min_input_size=1)
# Smallest input: three 2x2 max-pools (the stem's, after fire4 and after fire8); the padded
# convolutions keep the size: H // 8 >= 1, H >= 8.
registry.register_model("squeezenet", _lazy(_squeezenet), num_levels=8, norms=_NORMS,
                        num_blocks=8, min_input_size=8)
# Smallest input: three 2x2 pools, then the adaptive pool to 4x4 needs H // 8 >= 4 (and a
# multiple of 4): H >= 32.
registry.register_model("vgg9", _lazy(_vgg), num_levels=6, norms=_NORMS, num_blocks=6,
                        min_input_size=32)
# MFCL's autoencoder (its phase 1). Smallest input: the client module's 2x2 max-pool (its
# convolutions are padded): H >= 2 (and even, which the module itself checks).
registry.register_model("mfcl_autoencoder", _lazy(_mfcl), num_levels=1,
                        norms=("twin", "group", "batch"), min_input_size=2)

# The model classes and constructors this package offers, by the loader of their module.
_LAZY_EXPORTS: dict[str, Callable[[], ModuleType]] = {
    "BasicBlock": _resnet, "Bottleneck": _resnet, "ResNet": _resnet, "resnet10": _resnet,
    "resnet18": _resnet, "resnet34": _resnet, "resnet50": _resnet, "SmallCNN": _cnn,
    "MobileNetV2": _mobilenet, "PflCNN": _pfl_cnn, "ShuffleNet": _shufflenet,
    "ShuffleNetV2": _shufflenet_v2, "SqueezeNet": _squeezenet, "VGG9": _vgg,
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_EXPORTS:
        return getattr(_LAZY_EXPORTS[name](), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_model(name: str, *, num_classes: int, norm: str = "group",
              projection_dim: int | None = None, width: int | None = None,
              **extra) -> nn.Module:
    """Builds a registered model (``fedjax_rcl.registry``) by its config name.

    The model does not fix how its convolutions run: that is chosen where it is traced
    (``model_fns(module, conv_impl=)``, ``fedjax_rcl.nn.conv.implementation``).

    Args:
      name: a registered model (built in: cnn, moon_cnn, pfl_cnn, resnet10, resnet18, resnet34,
        resnet50, vgg9, mobilenet_v2, squeezenet, shufflenet, shufflenet_v2,
        mfcl_autoencoder).
      num_classes: size of the classifier output.
      norm: normalization kind for models that have one (the CNN has none).
      projection_dim: add a MOON projection head with this output size.
      width: channels of a ResNet's first stage (stages ``w, 2w, 4w, 8w``); None: 64. Passed
        to models that declare it (``registry.ModelEntry.width``) and refused for the others,
        as the config's checks refuse it.
      extra: model-specific arguments an algorithm asks for (``AlgorithmEntry.model_kwargs``,
        e.g. MFCL's ``group_size``).
    """
    entry = registry.model(name)
    if entry.width:
        extra["width"] = width
    elif width is not None:
        raise ValueError(f"width={width!r}: model={name} has a fixed width")
    return entry.build(num_classes, norm=norm, projection_dim=projection_dim, **extra)


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

"""Layers: the patch convolution, PyTorch-style conv/dense factories, normalizations."""

from fedjax_rcl.nn.conv import (
    CONV_IMPLS,
    patch_conv_general_dilated,
    resolve_conv_impl,
    torch_conv,
    torch_dense,
)
from fedjax_rcl.nn.norm import NORMS, Norm
from fedjax_rcl.nn.twin_norm import TwinNorm, twin_norm

__all__ = [
    "CONV_IMPLS",
    "NORMS",
    "TwinNorm",
    "Norm",
    "patch_conv_general_dilated",
    "resolve_conv_impl",
    "torch_conv",
    "torch_dense",
    "twin_norm",
]

"""Layers: convolutions (oneDNN through XLA's FFI, patches, rows), max-pooling, dropout with
byte masks, PyTorch-style factories, normalizations."""

from fedjax_rcl.nn.conv import (
    CONV_IMPLS,
    cpu_conv_general_dilated,
    onednn_conv_general_dilated,
    onednn_narrow_conv_general_dilated,
    patch_conv_general_dilated,
    resolve_conv_impl,
    row_conv_general_dilated,
    torch_conv,
    torch_dense,
)
from fedjax_rcl.nn.dropout import Dropout, dropout_mask
from fedjax_rcl.nn.norm import NORMS, Norm
from fedjax_rcl.nn.pool import bias_relu_max_pool, max_pool
from fedjax_rcl.nn.twin_norm import TwinNorm, twin_norm

__all__ = [
    "CONV_IMPLS",
    "Dropout",
    "NORMS",
    "TwinNorm",
    "Norm",
    "bias_relu_max_pool",
    "cpu_conv_general_dilated",
    "dropout_mask",
    "max_pool",
    "onednn_conv_general_dilated",
    "onednn_narrow_conv_general_dilated",
    "patch_conv_general_dilated",
    "resolve_conv_impl",
    "row_conv_general_dilated",
    "torch_conv",
    "torch_dense",
    "twin_norm",
]

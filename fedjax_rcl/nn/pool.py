"""Max-pooling over non-overlapping windows as a reshape and a max, and a convolution's bias,
ReLU and that pool in one CPU kernel.

``flax.linen.max_pool`` is ``lax.reduce_window``, whose gradient is ``select_and_scatter``: on
XLA:CPU the pair is a large part of a MOON-CNN client step (BENCHMARKS.md). When the stride
equals the window, the windows tile the image, and ``reshape + max`` is the same function with a
cheap gradient (an equality mask). On ties the gradient is split equally among the maxima instead
of going to the first one as in ``torch.nn.MaxPool2d``; after a ReLU the ties are all-zero
windows, whose gradient the ReLU zeroes either way, and equal positive values (flat regions of
an image), which share it.

``bias_relu_max_pool(y, b, k)`` is ``max_pool(relu(y + b), k)`` for a convolution's output
``y`` without its bias (``nn.conv.torch_conv(split_bias=True)``). XLA:CPU runs the bias, the
ReLU, the pool and their gradients as several fusions that move a pixel's few channels at a
time (6 and 16 in MOON's CNN) and a separate reduction for the bias's gradient; the kernel of
``csrc/max_pool.cc`` (built with the oneDNN convolutions by ``fedjax_rcl.nn.onednn``) makes one
pass over the activations forward and one backward, on whole image rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.nn import onednn


def max_pool(x: jax.Array, window: int) -> jax.Array:
    """``[B, H, W, C] -> [B, H // k, W // k, C]``: max over ``k x k`` windows with stride ``k``.

    Trailing rows/columns that do not fill a window are dropped (PyTorch's ``floor`` mode, and
    Flax's ``'VALID'``).
    """
    b, h, w, c = x.shape
    ho, wo = h // window, w // window
    x = x[:, : ho * window, : wo * window]
    return x.reshape(b, ho, window, wo, window, c).max(axis=(2, 4))


IMPLS = ("auto", "xla", "kernel")


def _xla_bias_relu_max_pool(y: jax.Array, b: jax.Array, window: int) -> jax.Array:
    return max_pool(jax.nn.relu(y + b), window)


def _kernel_forward(y, b, window):
    n, h, w, c = y.shape
    out = jax.ShapeDtypeStruct((n, h // window, w // window, c), y.dtype)
    return onednn.call("fedjax_bias_relu_max_pool_forward", out, y, b,
                       vmap_method="broadcast_all", window=np.int64(window))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _kernel_pool(y, b, window):
    return _kernel_forward(y, b, window)


def _kernel_pool_fwd(y, b, window):
    p = _kernel_forward(y, b, window)
    return p, (y, b, p)


def _kernel_pool_bwd(window, residuals, dp):
    y, b, p = residuals
    shapes = (jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(b.shape, b.dtype))
    # Under vmap the kernel takes every client at once: leading axes, one bias each.
    dy, db = onednn.call("fedjax_bias_relu_max_pool_backward", shapes, y, b, p, dp,
                         vmap_method="broadcast_all", window=np.int64(window))
    return dy, db


_kernel_pool.defvjp(_kernel_pool_fwd, _kernel_pool_bwd)


def resolve_impl(impl: str, y: jax.Array, b: jax.Array) -> str:
    """``"kernel"`` or ``"xla"``: what ``impl`` means for these operands here."""
    if impl not in IMPLS:
        raise ValueError(f"bias_relu_max_pool: impl={impl!r}; allowed {IMPLS}")
    if impl != "auto":
        return impl
    f32 = y.dtype == jnp.float32 and b.dtype == jnp.float32
    on_cpu = jax.default_backend() == "cpu"
    return "kernel" if f32 and on_cpu and onednn.available() else "xla"


def bias_relu_max_pool(y: jax.Array, b: jax.Array, window: int,
                       impl: str = "auto") -> jax.Array:
    """``max_pool(relu(y + b), window)``: a convolution's output ``y`` ``[B, H, W, C]`` without
    its bias ``b`` ``[C]``, through a ReLU, pooled over ``window x window`` tiles (see
    ``max_pool``; the gradient's ties split equally, as there).

    ``impl``: ``"xla"``, that formula compiled by XLA; ``"kernel"``, one float32 C++ pass
    forward and one backward on the CPU (``csrc/max_pool.cc``, built with the oneDNN
    convolutions by ``fedjax_rcl.nn.onednn``), the bias's gradient summed in the same pass;
    ``"auto"`` the kernel for float32 on a CPU where it can be built, XLA otherwise. Values are
    the same floats either way; the bias's gradient is summed in another order.
    """
    if y.ndim != 4 or b.shape != (y.shape[-1],) or window < 1:
        raise ValueError(f"bias_relu_max_pool: y [B, H, W, C], b [C], window >= 1; got "
                         f"{y.shape}, {b.shape}, {window}")
    impl = resolve_impl(impl, y, b)
    if impl == "kernel":
        if y.dtype != jnp.float32 or b.dtype != jnp.float32:
            raise ValueError("bias_relu_max_pool: impl='kernel' computes float32 only; got "
                             f"{y.dtype}, {b.dtype}")
        return _kernel_pool(y, b, int(window))
    return _xla_bias_relu_max_pool(y, b, window)

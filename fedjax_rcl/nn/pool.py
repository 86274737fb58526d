"""Max-pooling over non-overlapping windows as a reshape and a max.

``flax.linen.max_pool`` is ``lax.reduce_window``, whose gradient is ``select_and_scatter``: on
XLA:CPU the pair is a large part of a MOON-CNN client step (BENCHMARKS.md). When the stride
equals the window, the windows tile the image, and ``reshape + max`` is the same function with a
cheap gradient (an equality mask). On ties the gradient is split equally among the maxima instead
of going to the first one as in ``torch.nn.MaxPool2d``; after a ReLU the only ties are all-zero
windows, whose gradient the ReLU zeroes either way.
"""

from __future__ import annotations

import jax


def max_pool(x: jax.Array, window: int) -> jax.Array:
    """``[B, H, W, C] -> [B, H // k, W // k, C]``: max over ``k x k`` windows with stride ``k``.

    Trailing rows/columns that do not fill a window are dropped (PyTorch's ``floor`` mode, and
    Flax's ``'VALID'``).
    """
    b, h, w, c = x.shape
    ho, wo = h // window, w // window
    x = x[:, : ho * window, : wo * window]
    return x.reshape(b, ho, window, wo, window, c).max(axis=(2, 4))

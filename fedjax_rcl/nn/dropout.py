"""Dropout whose mask costs a quarter of the random bits: one byte per element, not one word.

Inverted dropout (Srivastava et al., "Dropout: a simple way to prevent neural networks from
overfitting", JMLR 2014), as ``flax.linen.Dropout`` computes it::

    y = m * x / (1 - p),   m ~ Bernoulli(1 - p) elementwise

``flax.linen.Dropout`` draws ``m`` with ``jax.random.bernoulli``: one 32-bit random word per
element. On XLA:CPU generating the words is the cost: pfl's CNN at batch 10 drops 125,440
activations per step, and drawing their masks was a tenth of the pfl workload's training
round (BENCHMARKS.md). When
``p * 256`` is an integer (every rate in the models here: 0.25, 0.5), an element only needs
one random byte ``u``, uniform on ``{0..255}``:

    m = [u >= 256 p],   P(m = 1) = (256 - 256 p) / 256 = 1 - p   exactly,

so the mask is drawn from ``ceil(n / 4)`` words, each split into four bytes: a quarter of the
random bits. Other rates fall back to ``jax.random.bernoulli``. The mask is a different function
of the key than Flax's, so the same key drops other elements than ``flax.linen.Dropout`` would.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp


def byte_threshold(rate: float) -> int | None:
    """``256 * rate`` when it is an integer in ``[1, 255]`` (the byte mask is exact), else None."""
    t = rate * 256
    return int(t) if t == int(t) and 1 <= t <= 255 else None


def dropout_mask(key: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """Boolean keep-mask of ``shape``, each element kept with probability ``1 - rate``.

    With ``t = byte_threshold(rate)``: the first ``prod(shape)`` bytes of
    ``jax.random.bits(key, (ceil(prod(shape) / 4),), uint32)`` in memory order, kept where
    ``byte >= t``. Otherwise ``jax.random.bernoulli(key, 1 - rate, shape)``.
    """
    t = byte_threshold(rate)
    if t is None:
        return jax.random.bernoulli(key, 1.0 - rate, shape)
    n = math.prod(shape)
    words = jax.random.bits(key, (-(-n // 4),), jnp.uint32)
    u = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)[:n]
    return (u >= t).reshape(shape)


class Dropout(nn.Module):
    """Inverted dropout with byte masks (module docstring); a drop-in for ``nn.Dropout``.

    Attributes:
      rate: the probability ``p`` of dropping an element, in ``[0, 1]``.
      deterministic: True for the identity (evaluation).
      rng_collection: the Flax RNG stream the mask's key comes from.
    """

    rate: float
    deterministic: bool = False
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        """``rng``: the mask's key; None draws one from ``rng_collection`` (``make_rng``)."""
        if self.deterministic or self.rate == 0.0:
            return x
        if self.rate == 1.0:
            return jnp.zeros_like(x)
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        keep = dropout_mask(rng, self.rate, x.shape)
        return jnp.where(keep, x / (1.0 - self.rate), jnp.zeros_like(x))

"""Byte-mask dropout (``fedjax_rcl.nn.dropout``) against a NumPy reconstruction of its mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.nn.dropout import Dropout, byte_threshold, dropout_mask


def _apply(rate, x, key, deterministic=False):
    """The module with ``key`` as the mask's key (Flax's ``make_rng`` would derive another)."""
    return Dropout(rate, deterministic=deterministic).apply({}, x, key)


@pytest.mark.parametrize("rate", [0.25, 0.5, 1 / 256, 255 / 256])
@pytest.mark.parametrize("shape", [(3, 5, 7, 2), (10, 13), (1,)])  # sizes 210, 130 and 1: not /4
def test_output_is_the_numpy_byte_mask_applied_to_the_input(rate, shape):
    key = jax.random.key(7)
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    n = x.size
    words = np.asarray(jax.random.bits(key, (-(-n // 4),), jnp.uint32))
    u = words.view(np.uint8)[:n].reshape(shape)  # each word's four bytes, in memory order
    expected = np.where(u >= round(rate * 256), x / np.float32(1 - rate), 0.0)
    np.testing.assert_allclose(np.asarray(_apply(rate, jnp.asarray(x), key)), expected,
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("rate", [0.25, 0.5, 0.1])  # 0.1: not a multiple of 1/256 (fallback)
def test_keep_fraction_is_one_minus_the_rate(rate):
    keep = np.asarray(dropout_mask(jax.random.key(3), rate, (400, 1000)))
    sd = np.sqrt(rate * (1 - rate) / keep.size)
    assert abs(keep.mean() - (1 - rate)) < 5 * sd
    # Neighbouring bytes of one word are independent: the pair (a, b) of elements 4i, 4i+1.
    a, b = keep.reshape(-1, 4)[:, 0], keep.reshape(-1, 4)[:, 1]
    assert abs((a & b).mean() - (1 - rate) ** 2) < 5 * np.sqrt((1 - rate) ** 2 / a.size)


def test_a_rate_off_the_byte_grid_is_jax_bernoulli():
    key = jax.random.key(5)
    np.testing.assert_array_equal(np.asarray(dropout_mask(key, 0.3, (6, 9))),
                                  np.asarray(jax.random.bernoulli(key, 0.7, (6, 9))))


def test_byte_threshold():
    assert byte_threshold(0.25) == 64 and byte_threshold(0.5) == 128
    assert byte_threshold(1 / 256) == 1 and byte_threshold(255 / 256) == 255
    assert byte_threshold(0.3) is None and byte_threshold(0.0) is None
    assert byte_threshold(1.0) is None


def test_identity_in_evaluation_and_at_rate_zero_zeros_at_rate_one():
    x = jnp.arange(12.0).reshape(3, 4)
    key = jax.random.key(0)
    np.testing.assert_array_equal(_apply(0.5, x, key, deterministic=True), x)
    np.testing.assert_array_equal(_apply(0.0, x, key), x)
    np.testing.assert_array_equal(_apply(1.0, x, key), jnp.zeros_like(x))


def test_the_key_comes_from_the_dropout_stream_when_not_given():
    x = jnp.ones((4, 50))
    out = [Dropout(0.5).apply({}, x, rngs={"dropout": jax.random.key(k)}) for k in (0, 0, 1)]
    np.testing.assert_array_equal(out[0], out[1])
    assert not np.array_equal(out[0], out[2])
    assert set(np.unique(np.asarray(out[0]))) == {0.0, 2.0}


def test_gradient_is_the_mask_over_the_keep_probability_and_keys_differ():
    x = jnp.ones((8, 64))
    k1, k2 = jax.random.key(1), jax.random.key(2)
    g = jax.grad(lambda v: _apply(0.25, v, k1).sum())(x)
    mask = np.asarray(dropout_mask(k1, 0.25, x.shape))
    np.testing.assert_allclose(np.asarray(g), mask / 0.75, rtol=1e-6)
    assert not np.array_equal(mask, np.asarray(dropout_mask(k2, 0.25, x.shape)))


def test_inside_jit_and_vmap_equals_one_call_per_key():
    keys = jax.random.split(jax.random.key(9), 3)
    x = jnp.ones((3, 10, 7))
    batched = jax.jit(jax.vmap(lambda k, v: _apply(0.5, v, k)))(keys, x)
    for i in range(3):
        np.testing.assert_array_equal(batched[i], _apply(0.5, x[i], keys[i]))

"""``fedjax_rcl.nn.pool``: ``bias_relu_max_pool`` (the XLA formula and the CPU kernel of
``csrc/max_pool.cc``) against a NumPy float64 reference, values and both gradients, on random
inputs with exact ties; the kernel against the XLA formula; NaN; vmap; the choice of ``auto``;
refusals; the models that use it keep ``nn.Conv``'s parameters."""

from __future__ import annotations

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.nn import onednn, pool
from fedjax_rcl.nn.conv import torch_conv
from fedjax_rcl.nn.pool import bias_relu_max_pool, max_pool

needs_kernel = pytest.mark.skipif(
    not onednn.available(), reason=f"no CPU kernels here: {onednn.unavailable_reason()}")
IMPLS = ["xla", pytest.param("kernel", marks=needs_kernel)]
# (shape, window): MOON's CNN's two pools (batch cut), odd sizes (trailing rows and columns
# dropped), a 3 x 3 window, many channels.
CASES = [((3, 28, 28, 6), 2), ((4, 10, 10, 16), 2), ((2, 7, 9, 5), 2), ((2, 8, 11, 3), 3),
         ((2, 6, 6, 64), 2)]


def _reference(y, b, dp, k):
    """float64: p = max over k x k tiles of max(y + b, 0); the gradient of sum(p * dp) with
    ties in a tile sharing dp equally (JAX's rule for a max) and the ReLU's z > 0 mask."""
    n, h, w, c = y.shape
    ho, wo = h // k, w // k
    z = y.astype(np.float64) + b.astype(np.float64)
    r = np.maximum(z, 0)
    tiles = r[:, :ho * k, :wo * k].reshape(n, ho, k, wo, k, c)
    p = tiles.max(axis=(2, 4))
    hit = tiles == p[:, :, None, :, None]
    share = dp / hit.sum(axis=(2, 4))
    dz = np.zeros_like(z)
    dz[:, :ho * k, :wo * k] = (hit * share[:, :, None, :, None]).reshape(n, ho * k, wo * k, c)
    dz = np.where(z > 0, dz, 0.0)
    return p, dz, dz.sum(axis=(0, 1, 2))


def _inputs(shape, k, seed):
    rng = np.random.default_rng(seed)
    y = rng.normal(size=shape).astype(np.float32)
    y[::2] = np.round(y[::2] * 2) / 2  # half the samples on a coarse grid: exact ties
    b = (rng.normal(size=shape[-1]) * 0.3).astype(np.float32)
    b[0] = 0.0  # a channel whose ties are at values y takes exactly
    dp = rng.normal(size=(shape[0], shape[1] // k, shape[2] // k, shape[3])).astype(np.float32)
    return y, b, dp


def _value_and_grads(impl, y, b, dp, k):
    def loss(y, b):
        return jnp.sum(bias_relu_max_pool(y, b, k, impl) * dp)

    fn = jax.jit(lambda y, b: (bias_relu_max_pool(y, b, k, impl), jax.grad(loss, (0, 1))(y, b)))
    p, (dy, db) = fn(jnp.asarray(y), jnp.asarray(b))
    return np.asarray(p), np.asarray(dy), np.asarray(db)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape,k", CASES)
def test_values_and_gradients_match_the_float64_reference(impl, shape, k):
    y, b, dp = _inputs(shape, k, seed=sum(shape) + k)
    want_p, want_dy, want_db = _reference(y, b, dp.astype(np.float64), k)
    assert (want_dy != 0).any() and (_reference(y, b, dp, k)[1][0] != 0).any()
    # the inputs do have tiles with several maxima that the gradient reaches
    z = y + b
    tiles = np.maximum(z, 0)[:, :shape[1] // k * k, :shape[2] // k * k]
    tiles = tiles.reshape(shape[0], shape[1] // k, k, shape[2] // k, k, shape[3])
    top = tiles.max(axis=(2, 4), keepdims=True)
    assert (((tiles == top) & (top > 0)).sum(axis=(2, 4)) > 1).any()
    p, dy, db = _value_and_grads(impl, y, b, dp, k)
    np.testing.assert_allclose(p, want_p, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dy, want_dy, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(db, want_db, rtol=1e-5, atol=1e-5 * np.abs(want_db).max())


@needs_kernel
@pytest.mark.parametrize("shape,k", CASES)
def test_the_kernel_computes_the_formulas_floats(shape, k):
    """Values and the input gradient are the XLA formula's floats (max, an add, one division);
    the bias's gradient is the same sum in another order."""
    y, b, dp = _inputs(shape, k, seed=7)
    xla, kernel = (_value_and_grads(impl, y, b, dp, k) for impl in ("xla", "kernel"))
    np.testing.assert_array_equal(kernel[0], xla[0])
    np.testing.assert_array_equal(kernel[1], xla[1])
    np.testing.assert_allclose(kernel[2], xla[2], rtol=1e-5, atol=1e-5 * np.abs(xla[2]).max())


@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_reaches_the_output_of_its_tile(impl):
    y, b, _ = _inputs((2, 4, 4, 3), 2, seed=3)
    y[1, 2, 3, 1] = np.nan
    p = np.asarray(bias_relu_max_pool(jnp.asarray(y), jnp.asarray(b), 2, impl))
    assert np.isnan(p[1, 1, 1, 1])
    assert np.isnan(p).sum() == 1


@needs_kernel
def test_under_vmap_each_client_gets_what_one_call_gives():
    """Clients side by side (one call for all, leading axes and a bias each; a bias shared;
    two vmaps) give each client what its own call gives, gradients included."""
    rng = np.random.default_rng(5)
    y = jnp.asarray(rng.normal(size=(3, 2, 8, 8, 6)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(3, 6)), jnp.float32)
    dp = jnp.asarray(rng.normal(size=(2, 4, 4, 6)), jnp.float32)
    grad = jax.grad(lambda y, b: jnp.sum(bias_relu_max_pool(y, b, 2, "kernel") * dp), (0, 1))
    together = jax.jit(jax.vmap(grad))(y, b)
    shared_bias = jax.jit(jax.vmap(grad, in_axes=(0, None)))(y, b[1])
    nested = jax.jit(jax.vmap(jax.vmap(grad)))(y.reshape(1, *y.shape), b.reshape(1, *b.shape))
    for k in range(3):
        alone = jax.jit(grad)(y[k], b[k])
        for a, n, c in zip(together, nested, alone, strict=True):
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(c))
            np.testing.assert_array_equal(np.asarray(n[0, k]), np.asarray(c))
        alone = jax.jit(grad)(y[k], b[1])  # one bias for every client
        for a, c in zip(shared_bias, alone, strict=True):
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(c))
    forward = jax.jit(jax.vmap(lambda y, b: bias_relu_max_pool(y, b, 2, "kernel")))(y, b)
    for k in range(3):
        np.testing.assert_array_equal(
            np.asarray(forward[k]), np.asarray(bias_relu_max_pool(y[k], b[k], 2, "kernel")))


@needs_kernel
def test_auto_takes_the_kernel_for_float32_on_the_cpu_and_xla_otherwise():
    y, b = jnp.ones((2, 4, 4, 6), jnp.float32), jnp.zeros(6)
    assert pool.resolve_impl("auto", y, b) == "kernel"
    assert pool.resolve_impl("auto", y.astype(jnp.bfloat16), b.astype(jnp.bfloat16)) == "xla"
    grad = jax.grad(lambda y: jnp.sum(bias_relu_max_pool(y, b, 2) ** 2))
    hlo = jax.jit(grad).lower(y).as_text()
    assert all(t in hlo for t in onednn.MAX_POOL_TARGETS)
    hlo = jax.jit(grad).lower(y.astype(jnp.bfloat16)).as_text()
    assert not any(t in hlo for t in onednn.MAX_POOL_TARGETS)


def test_auto_takes_xla_where_the_kernel_cannot_be_built(monkeypatch):
    monkeypatch.setattr(onednn, "_load", lambda: onednn.OneDnnUnavailable("none in this test"))
    y = jnp.ones((2, 4, 4, 6), jnp.float32)
    assert pool.resolve_impl("auto", y, jnp.zeros(6)) == "xla"
    hlo = jax.jit(lambda y: bias_relu_max_pool(y, jnp.zeros(6), 2)).lower(y).as_text()
    assert not any(t in hlo for t in onednn.MAX_POOL_TARGETS)


def test_what_it_does_not_compute_is_refused():
    y = jnp.ones((2, 4, 4, 6))
    with pytest.raises(ValueError, match=r"impl='fast'; allowed \('auto', 'xla', 'kernel'\)"):
        bias_relu_max_pool(y, jnp.zeros(6), 2, impl="fast")
    with pytest.raises(ValueError, match=r"y \[B, H, W, C\], b \[C\], window >= 1; got "
                                         r"\(2, 4, 4, 6\), \(5,\), 2"):
        bias_relu_max_pool(y, jnp.zeros(5), 2)
    with pytest.raises(ValueError, match="window >= 1"):
        bias_relu_max_pool(y, jnp.zeros(6), 0)
    with pytest.raises(ValueError, match="impl='kernel' computes float32 only"):
        bias_relu_max_pool(y.astype(jnp.bfloat16), jnp.zeros(6, jnp.bfloat16), 2, "kernel")


def test_a_split_bias_conv_has_the_biased_convs_parameters_and_output():
    """``torch_conv(split_bias=True)``: the same parameter names, shapes and initial values
    as the biased layer (checkpoints and seeds carry over), and ``y + bias`` its output."""
    x = jax.random.normal(jax.random.key(1), (2, 12, 12, 3))
    biased = torch_conv(3, 6, 5, name="conv1")
    split = torch_conv(3, 6, 5, split_bias=True, name="conv1")
    vb, vs = biased.init(jax.random.key(0), x), split.init(jax.random.key(0), x)
    assert jax.tree.structure(vb) == jax.tree.structure(vs)
    for a, c in zip(jax.tree.leaves(vb), jax.tree.leaves(vs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    y, bias = split.apply(vs, x)
    np.testing.assert_array_equal(np.asarray(y + bias), np.asarray(biased.apply(vb, x)))
    with pytest.raises(ValueError, match="split_bias needs use_bias"):
        torch_conv(3, 6, 5, use_bias=False, split_bias=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_it_is_the_models_former_conv_relu_pool(impl):
    """In a module: ``bias_relu_max_pool`` of a split-bias convolution is the biased
    convolution, ReLU and ``max_pool`` (values bitwise, gradients to rounding)."""
    x = jax.random.normal(jax.random.key(2), (3, 14, 14, 4))

    class Former(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            return max_pool(flax_nn.relu(torch_conv(4, 16, 5, name="c")(x)), 2)

    class Now(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            return bias_relu_max_pool(*torch_conv(4, 16, 5, split_bias=True, name="c")(x), 2,
                                      impl)

    v = Former().init(jax.random.key(0), x)
    np.testing.assert_array_equal(np.asarray(Now().apply(v, x)), np.asarray(Former().apply(v, x)))
    g = [jax.jit(jax.grad(lambda v, m=m: jnp.sum(m.apply(v, x) ** 2)))(v)
         for m in (Former(), Now())]
    for a, c in zip(jax.tree.leaves(g[0]), jax.tree.leaves(g[1]), strict=True):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-5,
                                   atol=1e-5 * float(np.abs(a).max()))

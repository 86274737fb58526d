"""``fedjax_rcl.nn.twin_norm`` against the float64 reference of ``tests/loss_reference``.

Rows i and i+K of a ``[2K, H, W, C]`` batch are the two views of sample i; each group of
``group_size`` consecutive channels is normalised with the mean and population variance taken
jointly over both views. Compared eagerly and under ``jax.jit`` in float64: values, and the
gradient of ``sum(w * twin_norm(x))`` for a fixed random ``w`` against finite differences
(``rtol=1e-6``, absolute floor ``1e-6 * max|reference gradient|``).
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import loss_reference as ref  # tests/ is on sys.path (pytest rootdir conftest)
import numpy as np
import pytest

RTOL = 1e-6
MODES = ("eager", "jit")


@pytest.fixture(scope="module")
def impl():
    """The JAX implementation, imported lazily: a missing one fails each test with a clear note."""
    try:
        import fedjax_rcl.nn as nn
    except Exception as e:  # any import failure is reported the same way
        pytest.fail(f"cannot import fedjax_rcl.nn: {e!r}", pytrace=False)
    if not hasattr(nn, "twin_norm"):
        pytest.fail("fedjax_rcl.nn lacks twin_norm (public API)", pytrace=False)
    return nn


@pytest.fixture(autouse=True)
def _float64():
    with jax.enable_x64(True):
        yield


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def _fn(impl, mode: str, **kw):
    fn = functools.partial(impl.twin_norm, **kw)
    return jax.jit(fn) if mode == "jit" else fn


# (K, H, W, C, group_size, eps); eps None = the default 1e-5, not passed. Mostly one shape, so
# that eager mode (one compilation per primitive and shape) stays cheap.
CASES = {
    "K2-2x2-C8-g2": (2, 2, 2, 8, 2, None),
    "K2-2x2-C8-g8-one-group": (2, 2, 2, 8, 8, None),
    "K2-2x2-C8-g2-eps1e-3": (2, 2, 2, 8, 2, 1e-3),
    "K2-2x2-C8-g2-constant": (2, 2, 2, 8, 2, None),
    "K3-3x2-C6-g3": (3, 3, 2, 6, 3, None),
    "K4-1x1-C4-g1-two-values": (4, 1, 1, 4, 1, None),
}


def _case_input(name: str):
    k, h, w, c, g, eps = CASES[name]
    rng = _rng(name)
    if name.endswith("constant"):
        x = np.full((2 * k, h, w, c), 0.75)  # zero variance: output 0, gradient 1/sqrt(eps)-ish
    else:
        x = rng.normal(size=(2 * k, h, w, c)) * 2.0 + 0.5
    kw = {"group_size": g} if eps is None else {"group_size": g, "eps": eps}
    weights = rng.normal(size=x.shape)
    return x, kw, weights


@functools.cache
def _reference(name: str):
    x, kw, weights = _case_input(name)
    value = ref.twin_norm(x, **kw)
    grad = ref.numeric_grad(lambda v: float(np.sum(weights * ref.twin_norm(v, **kw))), x)
    return value, grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_twin_norm_matches_reference(impl, name, mode):
    x, kw, weights = _case_input(name)
    fn = functools.partial(impl.twin_norm, **kw)
    value_and_grad = jax.value_and_grad(lambda v: jnp.sum(jnp.asarray(weights) * fn(v)))
    if mode == "jit":
        fn, value_and_grad = jax.jit(fn), jax.jit(value_and_grad)
    out = fn(jnp.asarray(x))
    assert out.dtype == jnp.float64 and out.shape == x.shape
    _, grad = value_and_grad(jnp.asarray(x))
    ref_value, ref_grad = _reference(name)
    np.testing.assert_allclose(
        np.asarray(out), ref_value, rtol=RTOL, atol=1e-12, err_msg=f"{name} [{mode}] value"
    )
    grad = np.asarray(grad)
    assert np.all(np.isfinite(grad))
    scale = float(np.max(np.abs(ref_grad)))
    np.testing.assert_allclose(
        grad,
        ref_grad,
        rtol=RTOL,
        atol=max(RTOL * scale, 1e-10),
        err_msg=f"{name} [{mode}] gradient",
    )


@pytest.mark.parametrize("mode", MODES)
def test_views_share_statistics(impl, mode):
    """Rows i and i+K together: mean 0, variance var/(var+eps) ~ 1 per group; each view alone is
    not normalised (the second view is shifted, so per-view means are far from 0)."""
    k, h, w, c, g, eps = 3, 3, 2, 6, 2, 1e-5
    rng = _rng("share")
    x = rng.normal(size=(2 * k, h, w, c))
    x[k:] += 3.0  # second views shifted
    outputs = (
        np.asarray(_fn(impl, mode, group_size=g)(jnp.asarray(x))),
        ref.twin_norm(x, group_size=g),
    )
    for y in outputs:
        for i in range(k):
            for start in range(0, c, g):
                joint = np.concatenate(
                    [
                        y[i, :, :, start : start + g].ravel(),
                        y[i + k, :, :, start : start + g].ravel(),
                    ]
                )
                raw = np.concatenate(
                    [
                        x[i, :, :, start : start + g].ravel(),
                        x[i + k, :, :, start : start + g].ravel(),
                    ]
                )
                assert abs(joint.mean()) < 1e-12
                np.testing.assert_allclose(joint.var(), raw.var() / (raw.var() + eps), rtol=1e-9)
                assert abs(joint.var() - 1.0) < 1e-4
                assert (
                    y[i, :, :, start : start + g].mean() < -0.5
                )  # first view below the joint mean
                assert y[i + k, :, :, start : start + g].mean() > 0.5


@pytest.mark.parametrize("mode", MODES)
def test_samples_do_not_share_statistics(impl, mode):
    """Perturbing sample j (both of its views) leaves every other sample's output unchanged."""
    k, j = 4, 2
    rng = _rng("independent")
    x = rng.normal(size=(2 * k, 2, 2, 4))
    perturbed = x.copy()
    perturbed[j] = perturbed[j] * 5.0 + 7.0
    perturbed[j + k] = rng.normal(size=perturbed[j + k].shape)
    fn = _fn(impl, mode, group_size=2)
    before = np.asarray(fn(jnp.asarray(x)))
    after = np.asarray(fn(jnp.asarray(perturbed)))
    others = [r for r in range(2 * k) if r not in (j, j + k)]
    np.testing.assert_array_equal(after[others], before[others])
    assert not np.allclose(after[[j, j + k]], before[[j, j + k]])
    np.testing.assert_allclose(after, ref.twin_norm(perturbed, group_size=2), rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_odd_batch_raises(impl, mode, rows):
    x = jnp.asarray(np.ones((rows, 2, 2, 4)))
    with pytest.raises(ValueError) as excinfo:
        _fn(impl, mode, group_size=2)(x)
    message = str(excinfo.value).lower()
    assert "pair" in message and "view" in message, f"message should mention view pairs: {message}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("channels", "group_size"), [(6, 4), (8, 3), (4, 8)])
def test_group_size_not_dividing_channels_raises(impl, mode, channels, group_size):
    x = jnp.asarray(np.ones((4, 2, 2, channels)))
    with pytest.raises(ValueError):
        _fn(impl, mode, group_size=group_size)(x)


@pytest.mark.parametrize("mode", MODES)
def test_twin_norm_vmap(impl, mode):
    """vmap over a leading axis of independent batches equals the per-batch reference."""
    rng = _rng("vmap")
    xs = rng.normal(size=(3, 4, 2, 3, 6))
    fn = jax.vmap(functools.partial(impl.twin_norm, group_size=3))
    if mode == "jit":
        fn = jax.jit(fn)
    out = np.asarray(fn(jnp.asarray(xs)))
    for n in range(xs.shape[0]):
        np.testing.assert_allclose(
            out[n], ref.twin_norm(xs[n], group_size=3), rtol=RTOL, atol=1e-12, err_msg=f"slice {n}"
        )


def _table18(x_nhwc: np.ndarray, group_size: int, eps: float = 1e-5) -> np.ndarray:
    """MFCL's code listing (its Table 18, TensorFlow, NCHW) in float64 NumPy: each view's
    GroupNorm moments, averaged over the two views, then shared by both."""
    x = np.transpose(np.asarray(x_nhwc, np.float64), (0, 3, 1, 2))
    n, c, h, w = x.shape
    g = x.reshape(n, c // group_size, group_size, h, w)
    mean, var = g.mean(axis=(2, 3, 4), keepdims=True), g.var(axis=(2, 3, 4), keepdims=True)
    mean_p = np.concatenate([(mean[: n // 2] + mean[n // 2:]) / 2] * 2)
    var_p = np.concatenate([(var[: n // 2] + var[n // 2:]) / 2] * 2)
    out = ((g - mean_p) / np.sqrt(var_p + eps)).reshape(n, c, h, w)
    return np.transpose(out, (0, 2, 3, 1))


@pytest.mark.parametrize("mode", MODES)
def test_views_variance_is_the_papers_listing(impl, mode):
    """``variance="views"`` matches MFCL's Table 18 listing; it differs from Eq. 2's pooled
    variance when the two views' means differ, and equals it when they do not."""
    rng = _rng("table18")
    x = rng.normal(size=(6, 3, 2, 8)) * rng.uniform(0.5, 2.0, size=8)
    x[3:] += rng.normal(size=(3, 1, 1, 8))  # the second views' means move
    views = np.asarray(_fn(impl, mode, group_size=4, variance="views")(jnp.asarray(x)))
    np.testing.assert_allclose(views, _table18(x, 4), rtol=RTOL, atol=1e-12)
    assert np.max(np.abs(views - ref.twin_norm(x, group_size=4))) > 1e-2
    same = np.concatenate([x[:3], x[:3]])
    np.testing.assert_allclose(
        np.asarray(_fn(impl, mode, group_size=4, variance="views")(jnp.asarray(same))),
        ref.twin_norm(same, group_size=4), rtol=RTOL, atol=1e-12)


def test_unknown_variance_raises(impl):
    with pytest.raises(ValueError, match="variance='joint'.*pooled.*views"):
        impl.twin_norm(jnp.ones((2, 2, 2, 4)), group_size=2, variance="joint")
    with pytest.raises(ValueError, match="variance='joint'"):
        impl.TwinNorm(group_size=2, variance="joint")


@pytest.mark.parametrize("group_size", [1, 2, 6])
def test_twin_norm_module_applies_its_affine_in_float32(group_size):
    """The Flax ``TwinNorm``: a scale and bias per channel applied to the normalised views, in
    float32 as models run it."""
    from fedjax_rcl.nn.twin_norm import TwinNorm

    x = _rng(f"module-{group_size}").normal(size=(6, 3, 2, 6)) * 3 + 1
    module = TwinNorm(group_size=group_size)
    params = module.init(jax.random.key(0), jnp.zeros((2, 3, 2, 6), jnp.float32))
    assert params["params"]["scale"].shape == params["params"]["bias"].shape == (6,)
    params = jax.tree.map(lambda p: p + 0.5, params)  # scale 1.5, bias 0.5
    got = module.apply(params, jnp.asarray(x, jnp.float32))
    assert got.dtype == jnp.float32
    want = ref.twin_norm(x, group_size=group_size) * 1.5 + 0.5
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_twin_norm_module_arguments():
    from fedjax_rcl.nn.twin_norm import TwinNorm, twin_norm

    with pytest.raises(ValueError, match="group_size"):
        TwinNorm(group_size=0)
    with pytest.raises(ValueError, match="exactly one"):
        TwinNorm()
    with pytest.raises(ValueError, match="divide"):
        twin_norm(jnp.zeros((2, 2, 2, 4)), group_size=3)
    x = jnp.arange(2 * 2 * 2 * 6, dtype=jnp.float32).reshape(2, 2, 2, 6)
    by_groups = TwinNorm(num_groups=2)  # 6 channels in 2 groups: groups of 3
    np.testing.assert_array_equal(
        by_groups.apply(by_groups.init(jax.random.key(0), x), x), twin_norm(x, group_size=3))

"""``fedjax_rcl.nn.group_norm`` (the ``norm=group`` layer, with its hand-written gradient)
against the float64 reference of ``tests/loss_reference``: values, and the gradients of
``sum(w * group_norm(x, scale, bias))`` with respect to all three inputs against finite
differences; against Flax's ``nn.GroupNorm`` (differentiated by JAX) in float32 and bfloat16."""

from __future__ import annotations

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import loss_reference as ref  # tests/ is on sys.path (pytest rootdir conftest)
import numpy as np
import pytest

from fedjax_rcl.nn import Norm
from fedjax_rcl.nn.group_norm import GroupNorm, group_norm

# (shape, groups): an image batch, a feature batch with no spatial axes, one group, C/G = 1.
CASES = {"image": ((2, 3, 2, 4), 2), "features": ((3, 6), 3), "one_group": ((2, 2, 3, 3), 1),
         "per_channel": ((2, 2, 2, 4), 4)}


def _inputs(name):
    shape, groups = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    x = rng.normal(size=shape) * 2.0 + rng.normal(size=shape[-1])  # per-channel offsets
    scale = rng.normal(size=shape[-1])
    bias = rng.normal(size=shape[-1])
    weights = rng.normal(size=shape)
    return x, scale, bias, weights, groups


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CASES))
def test_group_norm_and_its_gradient_match_the_float64_reference(name, jit):
    x, scale, bias, weights, groups = _inputs(name)
    with jax.enable_x64(True):
        def objective(x, scale, bias):
            return jnp.sum(jnp.asarray(weights) * group_norm(x, scale, bias, groups, 1e-5))

        fn = jax.value_and_grad(objective, argnums=(0, 1, 2))
        if jit:
            fn = jax.jit(fn)
        value, grads = fn(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias))
        out = group_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias), groups, 1e-5)
        assert out.dtype == jnp.float64 and all(g.dtype == jnp.float64 for g in grads)
    expected = ref.group_norm(x, scale, bias, num_groups=groups)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(float(value), float(np.sum(weights * expected)), rtol=1e-10)

    def f(which):
        def g(v):
            args = [x, scale, bias]
            args[which] = v
            return float(np.sum(weights * ref.group_norm(*args, num_groups=groups)))
        return g

    for which, (arg, grad) in enumerate(zip((x, scale, bias), grads, strict=True)):
        expected_grad = ref.numeric_grad(f(which), arg)
        top = float(np.max(np.abs(expected_grad)))
        np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-6,
                                   atol=1e-6 * top, err_msg=f"{name}: gradient {which}")


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
def test_layer_equals_flax_group_norm_with_its_parameters_and_gradients(dtype, tol):
    """Same parameter names, shapes and initial values as ``flax.linen.GroupNorm`` (so
    checkpoints written with it still load), and the same values and gradients; in bfloat16
    both take their statistics in float32 and return bfloat16."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 5, 5, 8)) * 3 + 1, jnp.float32)
    ours, theirs = GroupNorm(num_groups=2), flax_nn.GroupNorm(
        num_groups=2, epsilon=1e-5, use_fast_variance=False)
    p_ours, p_theirs = ours.init(jax.random.key(0), x), theirs.init(jax.random.key(0), x)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), p_ours) == jax.tree.map(
        lambda a: (a.shape, a.dtype), p_theirs)
    np.testing.assert_array_equal(p_ours["params"]["scale"], p_theirs["params"]["scale"])
    np.testing.assert_array_equal(p_ours["params"]["bias"], p_theirs["params"]["bias"])
    params = jax.tree.map(lambda a: a + jnp.asarray(rng.normal(size=a.shape), a.dtype), p_ours)
    w = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    def objective(module):
        def f(params, x):
            params = jax.tree.map(lambda a: a.astype(dtype), params)
            y = module.apply(params, x.astype(dtype))
            assert y.dtype == dtype
            return jnp.sum(jax.nn.relu(y.astype(jnp.float32)) * w)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    (v1, (gp1, gx1)), (v2, (gp2, gx2)) = objective(ours)(params, x), objective(theirs)(params, x)
    np.testing.assert_allclose(float(v1), float(v2), rtol=tol)
    for a, b in zip(jax.tree.leaves((gp1, gx1)), jax.tree.leaves((gp2, gx2)), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.max(np.abs(b))))


def test_norm_group_is_this_layer_under_the_name_gn():
    x = jnp.ones((2, 4, 4, 6))
    variables = Norm("group").init(jax.random.key(0), x, train=True)
    assert jax.tree.map(jnp.shape, variables) == {"params": {"gn": {"bias": (6,), "scale": (6,)}}}
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 4, 4, 6))
    out = Norm("group").apply(variables, jnp.asarray(x, jnp.float32), train=True)
    np.testing.assert_allclose(np.asarray(out), ref.group_norm(x, np.ones(6), np.zeros(6),
                                                                num_groups=2), atol=2e-5)


def test_groups_that_do_not_divide_the_channels_are_refused():
    with pytest.raises(ValueError, match=r"num_groups=4 must divide the channels.*\(2, 6\)"):
        GroupNorm(num_groups=4).init(jax.random.key(0), jnp.ones((2, 6)))

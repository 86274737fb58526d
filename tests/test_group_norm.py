"""``fedjax_rcl.nn.group_norm`` (the ``norm=group`` layer, with its hand-written gradient)
against the float64 reference of ``tests/loss_reference``: values, and the gradients of
``sum(w * group_norm(x, scale, bias))`` (with and without the fused ReLU) with respect to all
three inputs against finite differences; against Flax's ``nn.GroupNorm`` (differentiated by
JAX) in float32 and bfloat16; the CPU kernels (``impl="kernel"``) against the float64 path."""

from __future__ import annotations

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import loss_reference as ref  # tests/ is on sys.path (pytest rootdir conftest)
import numpy as np
import pytest

from fedjax_rcl.nn import Norm, onednn
from fedjax_rcl.nn import group_norm as group_norm_module
from fedjax_rcl.nn.group_norm import GroupNorm, group_norm

needs_kernels = pytest.mark.skipif(
    not onednn.available(), reason=f"no CPU kernels here: {onednn.unavailable_reason()}")

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


def _reference(x, scale, bias, groups, relu):
    out = ref.group_norm(x, scale, bias, num_groups=groups)
    return np.maximum(out, 0) if relu else out


@pytest.mark.parametrize("relu", [False, True], ids=["norm", "norm_relu"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(CASES))
def test_group_norm_and_its_gradient_match_the_float64_reference(name, jit, relu):
    x, scale, bias, weights, groups = _inputs(name)
    with jax.enable_x64(True):
        def objective(x, scale, bias):
            return jnp.sum(jnp.asarray(weights) * group_norm(x, scale, bias, groups, 1e-5, relu))

        fn = jax.value_and_grad(objective, argnums=(0, 1, 2))
        if jit:
            fn = jax.jit(fn)
        value, grads = fn(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias))
        out = group_norm(jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias), groups, 1e-5,
                         relu)
        assert out.dtype == jnp.float64 and all(g.dtype == jnp.float64 for g in grads)
    expected = _reference(x, scale, bias, groups, relu)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(float(value), float(np.sum(weights * expected)), rtol=1e-10)

    def f(which):
        def g(v):
            args = [x, scale, bias]
            args[which] = v
            return float(np.sum(weights * _reference(*args, groups, relu)))
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


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_groups_that_do_not_divide_the_channels_are_refused(impl):
    with pytest.raises(ValueError, match=r"num_groups=4 must divide the channels.*\(2, 6\)"):
        GroupNorm(num_groups=4).init(jax.random.key(0), jnp.ones((2, 6)))
    for groups in (4, 0):
        with pytest.raises(ValueError, match=rf"num_groups={groups} must divide the channels"):
            group_norm(jnp.ones((2, 6)), jnp.ones(6), jnp.zeros(6), groups, impl=impl)


def _float64_path(x, scale, bias, weights, groups, relu):
    """Values and gradients of the XLA path in float64 (checked against finite differences
    above)."""
    with jax.enable_x64(True):
        def objective(x, scale, bias):
            y = group_norm(x, scale, bias, groups, 1e-5, relu, impl="xla")
            return jnp.sum(jnp.asarray(weights) * y), y

        (_, y), grads = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(
            *map(jnp.asarray, (x, scale, bias)))
        return [np.asarray(a) for a in (y, *grads)]


@needs_kernels
@pytest.mark.parametrize("relu", [False, True], ids=["norm", "norm_relu"])
@pytest.mark.parametrize("name", [*CASES, "resnet_stage"])
def test_kernels_match_the_float64_path_in_float32(name, relu):
    """The CPU kernels (float32, statistics accumulated in double) agree with the float64
    path to float32 precision: output, and the gradients for x, scale and bias."""
    if name == "resnet_stage":  # a ResNet stage's shape: 16 x 16 positions, 2 groups
        rng = np.random.default_rng(7)
        x = rng.normal(size=(3, 16, 16, 32)) + rng.normal(size=32)
        scale, bias = rng.normal(size=32), rng.normal(size=32)
        weights, groups = rng.normal(size=x.shape), 2
    else:
        x, scale, bias, weights, groups = _inputs(name)
    expected = _float64_path(x, scale, bias, weights, groups, relu)

    def objective(x, scale, bias):
        y = group_norm(x, scale, bias, groups, 1e-5, relu, impl="kernel")
        return jnp.sum(jnp.asarray(weights, jnp.float32) * y), y

    fn = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True))
    (_, y), grads = fn(*(jnp.asarray(a, jnp.float32) for a in (x, scale, bias)))
    assert y.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in grads)
    # dx is a difference of terms of size |w| |scale| / sd, which can nearly cancel (two
    # values a group): float32 is exact to a few units of that size, not of dx's own.
    sd = np.std(x.reshape(x.shape[0], -1, groups, x.shape[-1] // groups), axis=(1, 3))
    terms = float(np.max(np.abs(weights)) * np.max(np.abs(scale)) / np.min(sd))
    for what, got, want in zip(("y", "dx", "dscale", "dbias"), (y, *grads), expected,
                               strict=True):
        top = max(float(np.max(np.abs(want))), terms if what == "dx" else 0.0)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * top,
                                   err_msg=f"{name}: {what}")


@needs_kernels
def test_kernels_stay_exact_when_the_mean_dwarfs_the_spread():
    """Activations at 1000 +- 1: the kernels' one-pass variance is accumulated in double and
    the output centred before scaling, so float32 precision holds (a float32 E[x^2] - E[x]^2
    would lose every digit of the variance here)."""
    rng = np.random.default_rng(3)
    x = (1000.0 + rng.normal(size=(2, 8, 8, 4))).astype(np.float32).astype(np.float64)
    scale, bias = rng.normal(size=4), rng.normal(size=4)
    weights = rng.normal(size=x.shape)
    expected = _float64_path(x, scale, bias, weights, 2, False)

    def objective(x, scale, bias):
        y = group_norm(x, scale, bias, 2, 1e-5, impl="kernel")
        return jnp.sum(jnp.asarray(weights, jnp.float32) * y), y

    (_, y), grads = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(
        *(jnp.asarray(a, jnp.float32) for a in (x, scale, bias)))
    for what, got, want in zip(("y", "dx", "dscale", "dbias"), (y, *grads), expected,
                               strict=True):
        top = float(np.max(np.abs(want)))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-3, atol=1e-3 * top,
                                   err_msg=what)


@needs_kernels
def test_kernels_under_vmap_equal_one_call_per_client():
    """Clients side by side (vmap, each with its own scale and bias) give what one call per
    client gives, gradients included."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(3, 2, 4, 4, 6)), jnp.float32)
    scale = jnp.asarray(rng.normal(size=(3, 6)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(3, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, 4, 4, 6)), jnp.float32)

    def loss(x, scale, bias):
        return jnp.sum(w * group_norm(x, scale, bias, 2, relu=True, impl="kernel"))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    together = jax.jit(jax.vmap(grad))(x, scale, bias)
    for k in range(3):
        alone = jax.jit(grad)(x[k], scale[k], bias[k])
        for a, b in zip(together, alone, strict=True):
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b))


@needs_kernels
def test_auto_takes_the_kernels_for_float32_on_the_cpu_and_xla_otherwise():
    x = jnp.ones((2, 4, 4, 6), jnp.float32)
    ones, zeros = jnp.ones(6), jnp.zeros(6)
    assert group_norm_module.resolve_impl("auto", x, ones, zeros) == "kernel"
    low = [a.astype(jnp.bfloat16) for a in (x, ones, zeros)]
    assert group_norm_module.resolve_impl("auto", *low) == "xla"
    grad = jax.grad(lambda x: jnp.sum(group_norm(x, ones, zeros, 2, relu=True) ** 2))
    hlo = jax.jit(grad).lower(x).as_text()
    assert all(t in hlo for t in onednn.GROUP_NORM_TARGETS)
    hlo = jax.jit(grad).lower(x.astype(jnp.bfloat16)).as_text()
    assert not any(t in hlo for t in onednn.GROUP_NORM_TARGETS)


def test_auto_takes_xla_where_the_kernels_cannot_be_built(monkeypatch):
    monkeypatch.setattr(onednn, "_load", lambda: onednn.OneDnnUnavailable("none in this test"))
    x = jnp.ones((2, 4, 4, 6), jnp.float32)
    assert group_norm_module.resolve_impl("auto", x, jnp.ones(6), jnp.zeros(6)) == "xla"
    hlo = jax.jit(lambda x: group_norm(x, jnp.ones(6), jnp.zeros(6), 2)).lower(x).as_text()
    assert not any(t in hlo for t in onednn.GROUP_NORM_TARGETS)


def test_what_the_kernels_do_not_compute_is_refused():
    x = jnp.ones((2, 6), jnp.bfloat16)
    with pytest.raises(ValueError, match="impl='kernel' computes float32 only"):
        group_norm(x, jnp.ones(6, jnp.bfloat16), jnp.zeros(6, jnp.bfloat16), 2, impl="kernel")
    with pytest.raises(ValueError, match=r"impl='fast'; allowed \('auto', 'xla', 'kernel'\)"):
        group_norm(jnp.ones((2, 6)), jnp.ones(6), jnp.zeros(6), 2, impl="fast")


@pytest.mark.parametrize("kind", ["group", "batch", "twin"])
def test_norm_with_relu_is_relu_of_the_norm(kind):
    """``Norm(kind)(x, relu=True)`` (fused for GroupNorm) equals ``relu(Norm(kind)(x))``, with
    the same parameters and gradients."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(4, 4, 4, 6)), jnp.float32)
    layer = Norm(kind)
    variables = layer.init(jax.random.key(0), x, train=True)
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(
        jnp.shape, layer.init(jax.random.key(0), x, train=True, relu=True))
    variables = jax.tree.map(lambda a: a + jnp.asarray(rng.normal(size=a.shape), a.dtype),
                             variables)

    def f(fused):
        def loss(variables, x):
            if fused:
                y = layer.apply(variables, x, train=True, relu=True, mutable=["batch_stats"])[0]
            else:
                y = jax.nn.relu(layer.apply(variables, x, train=True, mutable=["batch_stats"])[0])
            return jnp.sum(y * jnp.cos(x)), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(variables, x)

    for a, b in zip(jax.tree.leaves(f(True)), jax.tree.leaves(f(False)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

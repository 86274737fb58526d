"""The patch convolution equals XLA's native convolution (values and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fedjax_rcl.models import get_model
from fedjax_rcl.nn.conv import patch_conv_general_dilated, resolve_conv_impl

DN = ("NHWC", "HWIO", "NHWC")


@pytest.mark.parametrize(
    "shape,kernel,stride,padding",
    [
        ((2, 8, 8, 3), (3, 3, 3, 5), (1, 1), ((1, 1), (1, 1))),
        ((2, 9, 9, 4), (3, 3, 4, 6), (2, 2), ((1, 1), (1, 1))),  # odd size, stride 2
        ((1, 8, 8, 4), (1, 1, 4, 8), (2, 2), ((0, 0), (0, 0))),  # 1x1 projection shortcut
        ((3, 12, 12, 2), (5, 5, 2, 3), (1, 1), "VALID"),  # MOON CNN layer
        ((2, 7, 10, 3), (3, 3, 3, 2), (2, 1), "SAME"),
        ((2, 8, 8, 3), (3, 2, 3, 4), (1, 2), ((2, 0), (1, 3))),  # asymmetric everything
    ],
)
def test_patch_conv_matches_native(shape, kernel, stride, padding):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, shape)
    w = jax.random.normal(kw, kernel) / np.sqrt(np.prod(kernel[:3]))
    native = lambda x, w: lax.conv_general_dilated(x, w, stride, padding, dimension_numbers=DN)
    patches = lambda x, w: patch_conv_general_dilated(x, w, stride, padding, dimension_numbers=DN)
    y_native, y_patch = jax.jit(native)(x, w), jax.jit(patches)(x, w)
    assert y_patch.shape == y_native.shape
    np.testing.assert_allclose(y_patch, y_native, atol=1e-5, rtol=1e-5)

    # Gradients w.r.t. input and kernel of a random linear functional.
    g = jax.random.normal(kg, y_native.shape)
    grad = lambda f: jax.grad(lambda x, w: jnp.sum(f(x, w) * g), argnums=(0, 1))(x, w)
    for a, b in zip(grad(patches), grad(native), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_patch_conv_under_vmap_over_kernels():
    """The client axis: one kernel per client, vmapped, as in the round."""
    kx, kw = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (4, 2, 8, 8, 3))
    w = jax.random.normal(kw, (4, 3, 3, 3, 5))
    f = lambda impl: jax.vmap(lambda x, w: impl(x, w, (2, 2), ((1, 1), (1, 1)),
                                                dimension_numbers=DN))(x, w)
    np.testing.assert_allclose(f(patch_conv_general_dilated), f(lax.conv_general_dilated),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["cnn", "resnet18"])
def test_models_agree_across_conv_impls(name):
    """Whole models (logits and every feature level) agree within 1e-5 for both implementations."""
    x = jax.random.uniform(jax.random.PRNGKey(2), (2, 32, 32, 3))
    a, b = (get_model(name, num_classes=10, conv_impl=i) for i in ("patches", "native"))
    params = a.init(jax.random.PRNGKey(3), x)
    ya, yb = jax.jit(a.apply)(params, x), jax.jit(b.apply)(params, x)
    for u, v in zip(jax.tree.leaves(ya), jax.tree.leaves(yb), strict=True):
        np.testing.assert_allclose(u, v, atol=1e-5, rtol=1e-5)


def test_unsupported_convolutions_are_refused():
    x, w = jnp.ones((1, 8, 8, 4)), jnp.ones((3, 3, 2, 4))
    with pytest.raises(ValueError, match="grouped"):
        patch_conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=2)
    with pytest.raises(ValueError, match="rhs_dilation"):
        patch_conv_general_dilated(x, jnp.ones((3, 3, 4, 4)), (1, 1), "SAME", rhs_dilation=(2, 2))


def test_auto_selects_by_platform():
    assert resolve_conv_impl("auto", "cpu") == "patches"
    assert resolve_conv_impl("auto", "gpu") == "native"
    assert resolve_conv_impl("auto", "tpu") == "native"
    assert resolve_conv_impl("native", "cpu") == "native"
    with pytest.raises(ValueError, match="conv_impl"):
        resolve_conv_impl("fast")

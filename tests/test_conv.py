"""The oneDNN, patch and row convolutions equal XLA's native convolution (values and
gradients), and the implementation in force when a model is traced is the one that runs."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fedjax_rcl.models import get_model, model_fns
from fedjax_rcl.nn import conv as conv_module
from fedjax_rcl.nn import max_pool, onednn
from fedjax_rcl.nn.conv import (
    cpu_conv_general_dilated,
    input_grad_rule,
    onednn_conv_general_dilated,
    patch_conv_general_dilated,
    prefers_rows,
    resolve_conv_impl,
    row_conv_general_dilated,
)

IMPLS = {"patches": patch_conv_general_dilated, "rows": row_conv_general_dilated,
         "cpu": cpu_conv_general_dilated, "onednn": onednn_conv_general_dilated}


@pytest.fixture(autouse=True)
def _needs_onednn(request):
    """Cases of the oneDNN convolution skip, with the reason, where it cannot be built
    (test_onednn.py fails instead on the platforms where it must build)."""
    impl = request.node.callspec.params.get("impl") if hasattr(request.node, "callspec") else None
    if impl == "onednn" and not onednn.available():
        pytest.skip(f"oneDNN extension unavailable: {onednn.unavailable_reason()}")

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
        ((2, 32, 32, 3), (5, 5, 3, 6), (1, 1), "VALID"),  # MOON conv1, rows under "cpu"
        ((2, 8, 8, 6), (3, 3, 6, 4), (1, 1), "SAME"),  # narrowing: the flipped input gradient
        ((2, 6, 6, 4), (3, 3, 4, 4), (1, 1), ((1, 1), (1, 1))),  # ResNet's tie: flipped
    ],
)
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_matmul_convs_match_native(impl, shape, kernel, stride, padding):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, shape)
    w = jax.random.normal(kw, kernel) / np.sqrt(np.prod(kernel[:3]))
    native = lambda x, w: lax.conv_general_dilated(x, w, stride, padding, dimension_numbers=DN)
    patches = lambda x, w: IMPLS[impl](x, w, stride, padding, dimension_numbers=DN)
    y_native, y_patch = jax.jit(native)(x, w), jax.jit(patches)(x, w)
    assert y_patch.shape == y_native.shape
    np.testing.assert_allclose(y_patch, y_native, atol=1e-5, rtol=1e-5)

    # Gradients w.r.t. input and kernel of a random linear functional. A kernel gradient sums
    # B*H*W products in a different order per implementation: tolerance relative to its scale.
    g = jax.random.normal(kg, y_native.shape)
    grad = lambda f: jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * g), argnums=(0, 1)))(x, w)
    for a, b in zip(grad(patches), grad(native), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6 * max(1.0, float(np.abs(b).max())), rtol=1e-5)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_gradient_through_a_jitted_convolution(impl):
    """The gradient of a jitted convolution taken outside the jit (a test's or a user's
    ``jax.grad`` of a compiled ``apply``) equals lax.conv's: the custom gradients' residuals
    are values a jitted forward pass can return."""
    kx, kw = jax.random.split(jax.random.PRNGKey(3))
    x = jax.random.normal(kx, (2, 9, 9, 4))
    w = jax.random.normal(kw, (3, 3, 4, 6)) / 6.0
    native = lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=DN)
    ours = jax.jit(lambda x, w: IMPLS[impl](x, w, (2, 2), "SAME", dimension_numbers=DN))
    grad = lambda f: jax.grad(lambda x, w: jnp.sum(jnp.tanh(f(x, w))), argnums=(0, 1))(x, w)
    for a, b in zip(grad(ours), grad(native), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_matmul_convs_under_vmap_over_kernels(impl):
    """The client axis: one kernel per client, vmapped, as in the round."""
    kx, kw = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (4, 2, 8, 8, 3))
    w = jax.random.normal(kw, (4, 3, 3, 3, 5))
    f = lambda impl: jax.vmap(lambda x, w: impl(x, w, (2, 2), ((1, 1), (1, 1)),
                                                dimension_numbers=DN))(x, w)
    np.testing.assert_allclose(f(IMPLS[impl]), f(lax.conv_general_dilated),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["cnn", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_models_agree_across_conv_impls(name):
    """Whole models (logits and every feature level) agree within 1e-5 for both implementations."""
    x = jax.random.uniform(jax.random.PRNGKey(2), (2, 32, 32, 3))
    model = get_model(name, num_classes=10)
    weights, state = model_fns(model, conv_impl="native").init(jax.random.PRNGKey(3), x)
    params = {"params": weights, **state}
    want = jax.jit(conv_module.under("native", model.apply))(params, x)
    for impl in IMPLS:
        if impl == "onednn" and not onednn.available():
            continue
        got = jax.jit(conv_module.under(impl, model.apply))(params, x)
        chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def _convolutions(fn, *args) -> tuple[int, int]:
    """XLA convolutions and matrix products in ``fn``'s jaxpr, traced afresh (a new function:
    JAX's trace cache, which does not see the implementation in force, holds the last)."""
    jaxpr = str(jax.make_jaxpr(lambda *a: fn(*a))(*args))
    return jaxpr.count("conv_general_dilated["), jaxpr.count("dot_general[")


def test_the_implementation_in_force_when_traced_runs():
    """``implementation`` is read while a convolution layer is traced: XLA's convolution under
    ``native``, patch matrix products under ``patches``; the innermost scope holds, and
    outside any the layer runs ``auto``'s choice."""
    layer = conv_module.torch_conv(3, 4, 3, padding=1)
    x = jnp.ones((2, 8, 8, 3))
    variables = layer.init(jax.random.PRNGKey(0), x)
    apply = functools.partial(layer.apply, variables)
    assert conv_module.current_implementation() == "auto"
    with conv_module.implementation("native"):
        assert _convolutions(apply, x)[0] == 1
        with conv_module.implementation("patches"):
            assert conv_module.current_implementation() == "patches"
            assert _convolutions(apply, x) == (0, 1)
        assert _convolutions(apply, x)[0] == 1
    assert conv_module.current_implementation() == "auto"
    with pytest.raises(ValueError, match="conv_impl"), conv_module.implementation("fast"):
        pass


def test_under_fixes_the_implementation_whatever_the_caller_sets():
    """A function wrapped by ``under`` traces with its own implementation, so that a jit
    cache, which does not see the scope, cannot hand back a trace made under another."""
    layer = conv_module.torch_conv(3, 4, 3, padding=1)
    x = jnp.ones((2, 8, 8, 3))
    variables = layer.init(jax.random.PRNGKey(0), x)
    native = conv_module.under("native", functools.partial(layer.apply, variables))
    with conv_module.implementation("patches"):
        assert _convolutions(native, x)[0] == 1
    fns = model_fns(get_model("cnn", num_classes=10), conv_impl="native")
    assert fns.conv_impl == "native"
    params, state = fns.init(jax.random.PRNGKey(0), jnp.ones((1, 32, 32, 3)))
    with conv_module.implementation("patches"):
        assert _convolutions(lambda p, x: fns.apply(p, state, x, train=False), params,
                             jnp.ones((2, 32, 32, 3)))[0] == 2


def test_choose_is_the_one_per_shape_rule():
    """Native everywhere under ``native``; grouped convolutions through their own
    formulation otherwise; under ``cpu``, oneDNN where it runs, else rows for narrow inputs
    and patches for the rest."""
    narrow, wide = jnp.ones((2, 32, 32, 3)), jnp.ones((2, 8, 8, 64))
    k_narrow, k_wide = jnp.ones((5, 5, 3, 6)), jnp.ones((3, 3, 64, 64))
    same = ((1, 1), (1, 1))
    assert conv_module.choose("native", wide, k_wide, (1, 1), same,
                              64) is lax.conv_general_dilated
    for impl in ("patches", "rows", "cpu", "onednn"):
        assert (conv_module.choose(impl, wide, jnp.ones((3, 3, 1, 64)), (1, 1), same, 64)
                is conv_module.grouped_conv_general_dilated)
    assert conv_module.choose("patches", narrow, k_narrow, (1, 1), "VALID") is (
        patch_conv_general_dilated)
    assert conv_module.choose("rows", wide, k_wide, (1, 1), same) is row_conv_general_dilated
    cpu = [conv_module.choose("cpu", x, k, (1, 1), p)
           for x, k, p in ((narrow, k_narrow, "VALID"), (wide, k_wide, same))]
    if onednn.available():
        assert cpu == [conv_module.onednn_narrow_conv_general_dilated] * 2
    else:
        assert cpu == [row_conv_general_dilated, patch_conv_general_dilated]


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_unsupported_convolutions_are_refused(impl):
    x, w = jnp.ones((1, 8, 8, 4)), jnp.ones((3, 3, 2, 4))
    with pytest.raises(ValueError, match="grouped"):
        IMPLS[impl](x, w, (1, 1), "SAME", feature_group_count=2)
    with pytest.raises(ValueError, match="rhs_dilation"):
        IMPLS[impl](x, jnp.ones((3, 3, 4, 4)), (1, 1), "SAME", rhs_dilation=(2, 2))
    with pytest.raises(ValueError, match="channels"):
        IMPLS[impl](x, jnp.ones((3, 3, 3, 4)), (1, 1), "SAME")


@pytest.mark.parametrize("rule", ["flipped", "col2im"])
@pytest.mark.parametrize("shape,kernel,padding", [
    ((2, 8, 8, 3), (3, 3, 3, 5), ((1, 1), (1, 1))),
    ((2, 8, 8, 6), (3, 3, 6, 4), "SAME"),
    ((2, 10, 10, 4), (3, 3, 4, 8), "VALID"),  # pfl's conv2, widening and valid
    ((2, 9, 9, 2), (5, 5, 2, 3), ((2, 1), (0, 2))),  # asymmetric padding within k - 1
])
def test_both_patch_input_gradients_are_exact(monkeypatch, rule, shape, kernel, padding):
    """Each input-gradient rule of the patch convolution, forced, equals XLA's gradient in
    float64 (the auto rule picks one of these two; test_matmul_convs_match_native covers it)."""
    monkeypatch.setattr(conv_module, "INPUT_GRAD_RULE", rule)
    with jax.enable_x64(True):
        kx, kw, kg = jax.random.split(jax.random.PRNGKey(4), 3)
        x = jax.random.normal(kx, shape, jnp.float64)
        w = jax.random.normal(kw, kernel, jnp.float64)
        g = jax.random.normal(kg, lax.conv_general_dilated(x, w, (1, 1), padding,
                                                           dimension_numbers=DN).shape,
                              jnp.float64)
        grads = [jax.jit(jax.grad(lambda x, w, f=f: jnp.sum(f(x, w, (1, 1), padding,
                                                              dimension_numbers=DN) * g),
                                  argnums=(0, 1)))(x, w)
                 for f in (patch_conv_general_dilated, lax.conv_general_dilated)]
        assert input_grad_rule(x.shape, g.shape, w.shape, (1, 1),
                               lax.padtype_to_pads(shape[1:3], kernel[:2], (1, 1), padding)
                               if isinstance(padding, str) else padding) == rule
    chex.assert_trees_all_close(grads[0], grads[1], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("rule", ["flipped", "col2im"])
def test_bfloat16_input_gradients_round_once(monkeypatch, rule):
    """In bfloat16 both rules round the input gradient once: col2im sums its k_h k_w taps in
    float32, as the flipped rule's matmul accumulates, instead of rounding every tap and
    partial sum to bfloat16 (which doubled the error). Reference: float64 on the same
    bfloat16-rounded operands, so what is left is the final rounding (at most 2^-8 relative)."""
    monkeypatch.setattr(conv_module, "INPUT_GRAD_RULE", rule)
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(5), 3)
    bf = jnp.bfloat16
    x = jax.random.normal(kx, (4, 14, 14, 16)).astype(bf)
    w = (jax.random.normal(kw, (3, 3, 16, 32)) / 12).astype(bf)
    g = jax.random.normal(kg, (4, 12, 12, 32)).astype(bf)
    dx = jax.jit(jax.grad(lambda x: jnp.sum((patch_conv_general_dilated(
        x, w, (1, 1), "VALID", dimension_numbers=DN) * g).astype(jnp.float32))))(x)
    assert dx.dtype == bf
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(np.asarray(a.astype(jnp.float32)), jnp.float64)
        ref = jax.jit(jax.grad(lambda x, w, g: jnp.sum(lax.conv_general_dilated(
            x, w, (1, 1), "VALID", dimension_numbers=DN) * g)))(f64(x), f64(w), f64(g))
        err = np.asarray(f64(dx) - ref)
        ref = np.asarray(ref)
    assert np.linalg.norm(err) / np.linalg.norm(ref) < 2.0 ** -8.5
    assert np.all(np.abs(err) <= 2.0 ** -7 * np.abs(ref) + 1e-4)


def test_input_gradient_rule_writes_fewer_values():
    """Flipped-kernel patches write k*k*C_out per input position, col2im k*k*C_in per output
    position: widening layers take col2im, narrowing ones and ResNet's ties the flipped rule,
    strided ones col2im (the only exact one there)."""
    same, valid = ((1, 1), (1, 1)), ((0, 0), (0, 0))
    assert input_grad_rule((10, 30, 30, 32), (10, 28, 28, 64), (3, 3, 32, 64), (1, 1),
                           valid) == "col2im"  # pfl-research's conv2
    assert input_grad_rule((50, 14, 14, 6), (50, 10, 10, 16), (5, 5, 6, 16), (1, 1),
                           valid) == "col2im"  # MOON's conv2
    assert input_grad_rule((50, 32, 32, 64), (50, 32, 32, 64), (3, 3, 64, 64), (1, 1),
                           same) == "flipped"  # ResNet-18's stage 1
    assert input_grad_rule((50, 8, 8, 64), (50, 8, 8, 32), (3, 3, 64, 32), (1, 1),
                           same) == "flipped"
    assert input_grad_rule((50, 32, 32, 64), (50, 16, 16, 128), (3, 3, 64, 128), (2, 2),
                           same) == "col2im"
    # Valid padding of a narrowing layer: fewer output positions tip it to col2im.
    assert input_grad_rule((1, 6, 6, 8), (1, 2, 2, 4), (5, 5, 8, 4), (1, 1), valid) == "col2im"


def test_cpu_rule_picks_rows_only_for_narrow_inputs():
    # MOON's CNN: both layers as rows; ResNet-18: the 3->64 stem (34 wide, 11x the work as a
    # band) and every 64+ channel layer as patches.
    assert prefers_rows((50, 32, 32, 3), (5, 5, 3, 6))
    assert prefers_rows((50, 14, 14, 6), (5, 5, 6, 16))
    assert not prefers_rows((50, 32, 32, 3), (3, 3, 3, 64), (1, 1), ((1, 1), (1, 1)))
    assert not prefers_rows((50, 32, 32, 64), (3, 3, 64, 64), (1, 1), ((1, 1), (1, 1)))
    assert not prefers_rows((50, 4, 4, 512), (3, 3, 512, 512), (1, 1), "SAME")


def test_auto_selects_by_platform():
    assert resolve_conv_impl("auto", "cpu") == "cpu"
    assert resolve_conv_impl("auto", "gpu") == "native"
    assert resolve_conv_impl("auto", "tpu") == "native"
    assert resolve_conv_impl("native", "cpu") == "native"
    with pytest.raises(ValueError, match="conv_impl"):
        resolve_conv_impl("fast")


def test_auto_selects_patches_for_weights_side_by_side_on_a_gpu_only():
    """Per-client weights under ``vmap`` are grouped convolutions on a GPU: the patch
    formulation there (measured on an H200), the platform's choice everywhere else."""
    assert resolve_conv_impl("auto", "gpu", batched_weights=True) == "patches"
    assert resolve_conv_impl("auto", "cpu", batched_weights=True) == "cpu"
    assert resolve_conv_impl("auto", "tpu", batched_weights=True) == "native"  # not measured
    assert resolve_conv_impl("native", "gpu", batched_weights=True) == "native"  # as asked
    assert resolve_conv_impl("onednn", "gpu", batched_weights=True) == "onednn"


@pytest.mark.parametrize("shape,window",
                         [((2, 28, 28, 6), 2), ((3, 10, 10, 16), 2), ((1, 9, 7, 2), 3)])
def test_max_pool_matches_flax(shape, window):
    """Values and gradients equal reduce_window max-pooling (random inputs: no ties)."""
    import flax.linen as nn

    x = jax.random.normal(jax.random.PRNGKey(4), shape)
    g = jax.random.normal(jax.random.PRNGKey(5), max_pool(x, window).shape)
    ours = lambda x: max_pool(x, window)
    flax_pool = lambda x: nn.max_pool(x, (window, window), strides=(window, window))
    np.testing.assert_array_equal(ours(x), flax_pool(x))
    grad = lambda f: jax.jit(jax.grad(lambda x: jnp.sum(f(x) * g)))(x)
    np.testing.assert_array_equal(grad(ours), grad(flax_pool))


@pytest.mark.parametrize("shape,kernel,stride,padding,groups", [
    ((2, 9, 9, 8), (3, 3, 1, 8), 1, 1, 8),    # depthwise
    ((2, 9, 9, 8), (3, 3, 1, 8), 2, 1, 8),    # depthwise, stride 2 (MobileNetV2)
    ((2, 8, 8, 6), (5, 5, 1, 6), 1, 2, 6),    # depthwise 5x5
    ((2, 7, 7, 12), (1, 1, 4, 6), 1, 0, 3),   # grouped pointwise (ShuffleNet)
    ((2, 7, 7, 12), (3, 3, 4, 6), 1, 1, 3),   # any other grouping: XLA's
])
def test_grouped_convolution_matches_xla(shape, kernel, stride, padding, groups):
    from fedjax_rcl.nn.conv import grouped_conv_general_dilated

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=kernel), jnp.float32)
    pads = ((padding, padding), (padding, padding))
    dn = lax.conv_dimension_numbers(shape, kernel, ("NHWC", "HWIO", "NHWC"))

    def f(conv, x, w):
        return conv(x, w, (stride, stride), pads, dimension_numbers=dn,
                    feature_group_count=groups)

    got, want = (jax.jit(functools.partial(f, conv))(x, w)
                 for conv in (grouped_conv_general_dilated, lax.conv_general_dilated))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    gx, gw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(grouped_conv_general_dilated, x, w) ** 2),
                              (0, 1)))(x, w)
    hx, hw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(lax.conv_general_dilated, x, w) ** 2),
                              (0, 1)))(x, w)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(hx), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(hw), rtol=1e-4, atol=1e-4)
    if kernel[2] == 1 or kernel[:2] == (1, 1):  # the fast paths emit no convolution at all
        jaxpr = str(jax.make_jaxpr(lambda x, w: f(grouped_conv_general_dilated, x, w))(x, w))
        assert "conv_general_dilated" not in jaxpr

"""The client-layout cost model: FLOPs counted from a program, the rule, and its fit."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.engine import layout


def _conv_macs(n, h_out, w_out, c_out, kh, kw, c_in_per_group):
    return n * h_out * w_out * c_out * kh * kw * c_in_per_group


def test_counts_convolutions_and_matrix_products_like_the_textbook():
    x = jnp.zeros((4, 9, 9, 6))
    w1 = jnp.zeros((3, 3, 6, 8))  # HWIO
    w2 = jnp.zeros((2, 2, 4, 8))  # grouped: 2 groups of 4 input channels
    d = jnp.zeros((8 * 4 * 4, 10))

    def f(x, w1, w2, d):
        dn = ("NHWC", "HWIO", "NHWC")
        y = jax.lax.conv_general_dilated(x, w1, (2, 2), "SAME", dimension_numbers=dn)  # 5x5
        y = jax.lax.conv_general_dilated(y, w2, (1, 1), "VALID", dimension_numbers=dn,
                                         feature_group_count=2)  # 4x4
        return y.reshape(4, -1) @ d

    expected = 2 * (_conv_macs(4, 5, 5, 8, 3, 3, 6) + _conv_macs(4, 4, 4, 8, 2, 2, 4)
                    + 4 * 128 * 10)
    assert layout.jaxpr_flops(jax.make_jaxpr(f)(x, w1, w2, d)) == expected


def test_nested_programs_scan_length_and_the_costlier_branch():
    a = jnp.zeros((5, 7))
    b = jnp.zeros((7, 3))
    one = 2 * 5 * 7 * 3

    def scanned(a, b):
        return jax.lax.scan(lambda c, _: (c, jax.jit(jnp.matmul)(a, b)), 0.0, None, length=6)[1]

    assert layout.jaxpr_flops(jax.make_jaxpr(scanned)(a, b)) == 6 * one

    def branchy(p, a, b):
        return jax.lax.cond(p, lambda: (a @ b) @ b.T @ b, lambda: a @ b)

    heavy = one + 2 * 5 * 3 * 7 + one
    assert layout.jaxpr_flops(jax.make_jaxpr(branchy)(True, a, b)) == heavy


@pytest.mark.slow
def test_custom_gradients_and_the_onednn_kernels_count_like_the_native_convolution():
    from fedjax_rcl.models import get_model, model_fns
    from fedjax_rcl.nn import onednn

    counts = {}
    impls = ["native", "patches"] + (["onednn"] if onednn.available() else [])
    for impl in impls:
        m = model_fns(get_model("resnet10", num_classes=10, width=8), conv_impl=impl)
        p, s = m.init(jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3)))
        counts[impl] = layout.forward_flops(m.apply, p, s, (32, 32, 3), 2)
    assert len(set(counts.values())) == 1, counts
    # The stem alone: a 3x3 convolution from 3 to 8 channels at 32x32, for 2 images.
    assert counts["native"] > 2 * _conv_macs(2, 32, 32, 8, 3, 3, 3)


def test_forward_flops_of_moons_cnn_against_its_layers():
    from fedjax_rcl.models import get_model, model_fns

    m = model_fns(get_model("cnn", num_classes=10))
    p, s = m.init(jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3)))
    dense_shapes = [leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(p)
                    if path[-1].key == "kernel" and leaf.ndim == 2]
    convs = 2 * (_conv_macs(1, 28, 28, 6, 5, 5, 3) + _conv_macs(1, 10, 10, 16, 5, 5, 6))
    dense = 2 * sum(i * o for i, o in dense_shapes)
    assert layout.forward_flops(m.apply, p, s, (32, 32, 3), 1) == convs + dense


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_rule_puts_small_steps_side_by_side_and_large_ones_one_at_a_time(platform):
    t = layout.SIDE_BY_SIDE_BELOW_GFLOP[platform]
    assert layout.side_by_side(t / 2, platform)
    assert not layout.side_by_side(t, platform)
    assert not layout.side_by_side(t * 2, platform)
    assert layout.side_by_side(1e6, "tpu")  # not measured: side by side


def test_fit_threshold_separates_the_table_or_says_it_cannot():
    assert layout.fit_threshold({0.2: True, 5.0: False, 167.0: False}) == pytest.approx(1.0)
    assert layout.fit_threshold({0.2: True, 0.1: True, 20.0: False}) == pytest.approx(2.0)
    assert layout.fit_threshold({0.2: True, 5.0: True}) is None
    assert layout.fit_threshold({5.0: True, 0.2: False}) is None  # not separable by FLOPs
    assert math.isfinite(layout.fit_threshold({1.0: True, 4.0: False}))

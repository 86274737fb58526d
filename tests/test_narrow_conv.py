"""``fedjax_rcl.nn.narrow_conv``: the positions-in-lanes kernel (``csrc/narrow_conv.cc``) against
a NumPy float64 reference on random inputs (forward and input gradient, at row widths that fill
one vector, two, or part of one, odd heights, padding); the CPU convolution that composes it
with oneDNN (values and both gradients, and where it runs); vmap in one call, bitwise each
client's own call; the rule; refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.nn import conv, narrow_conv, onednn

pytestmark = pytest.mark.skipif(
    not onednn.available(), reason=f"no CPU kernels here: {onednn.unavailable_reason()}")
DN = ("NHWC", "HWIO", "NHWC")
# (x, w, padding): MOON's CNN's conv1 (3 -> 6, 28 wide: two vectors) and conv2 input gradient
# shapes (batch cut), a row of exactly 16 and of 17, one channel, eight, a 1-wide output, an
# odd output height (the two-row tiles' remainder), asymmetric padding.
CASES = [((2, 32, 32, 3), (5, 5, 3, 6), ((0, 0), (0, 0))),
         ((3, 14, 14, 6), (5, 5, 6, 16), ((0, 0), (0, 0))),
         ((2, 18, 18, 4), (3, 3, 4, 8), ((0, 0), (0, 0))),
         ((2, 9, 17, 5), (3, 3, 5, 7), ((1, 1), (1, 1))),
         ((1, 7, 5, 2), (3, 5, 2, 1), ((0, 2), (0, 0))),
         ((2, 11, 30, 16), (2, 3, 16, 3), ((1, 0), (0, 2)))]


def _pad(x, padding):
    (pt, pb), (pl, pr) = padding
    return np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))


def _reference_conv(x, w, padding):
    """float64: y[n, i, j, o] = sum_{a, b, c} xpad[n, i + a, j + b, c] w[a, b, c, o]."""
    xp = _pad(x.astype(np.float64), padding)
    kh, kw = w.shape[:2]
    ho, wo = xp.shape[1] - kh + 1, xp.shape[2] - kw + 1
    return sum(np.einsum("nhwc,co->nhwo", xp[:, a:a + ho, b:b + wo], w[a, b].astype(np.float64))
               for a in range(kh) for b in range(kw))


def _reference_input_grad(dy, w, x_shape, padding):
    """float64: the transpose of ``_reference_conv`` in x, applied to dy."""
    (pt, pb), (pl, pr) = padding
    kh, kw = w.shape[:2]
    n, h, wd, c = x_shape
    dxp = np.zeros((n, h + pt + pb, wd + pl + pr, c))
    for a in range(kh):
        for b in range(kw):
            dxp[:, a:a + dy.shape[1], b:b + dy.shape[2]] += np.einsum(
                "nhwo,co->nhwc", dy.astype(np.float64), w[a, b].astype(np.float64))
    return dxp[:, pt:pt + h, pl:pl + wd]


def _random(shape, rng):
    return rng.normal(size=shape).astype(np.float32)


def _close(ours, ref, taps):
    # float32 sums of `taps` terms of order 1: a few ulps of sqrt(taps) each
    np.testing.assert_allclose(np.asarray(ours, np.float64), ref, rtol=0,
                               atol=2e-6 * taps + 1e-6)


@pytest.mark.parametrize("xs, ws, padding", CASES)
def test_forward_matches_float64(xs, ws, padding):
    rng = np.random.default_rng(0)
    x, w = _random(xs, rng), _random(ws, rng)
    y = jax.jit(lambda x, w: narrow_conv.conv(x, w, padding))(x, w)
    _close(y, _reference_conv(x, w, padding), np.prod(ws[:3]))


@pytest.mark.parametrize("xs, ws, padding", CASES)
def test_input_grad_matches_float64(xs, ws, padding):
    rng = np.random.default_rng(1)
    w = _random(ws, rng)
    ys = _reference_conv(np.zeros(xs, np.float32), w, padding).shape
    if ys[2] > narrow_conv.MAX_WIDTH or xs[2] > narrow_conv.MAX_WIDTH:
        pytest.skip("rows wider than the kernel takes")
    dy = _random(ys, rng)
    dx = jax.jit(lambda dy, w: narrow_conv.input_grad(dy, w, xs, padding))(dy, w)
    _close(dx, _reference_input_grad(dy, w, xs, padding), ws[0] * ws[1] * ws[3])


def _cpu_conv(padding):
    return lambda x, w: conv.onednn_narrow_conv_general_dilated(x, w, (1, 1), padding,
                                                                dimension_numbers=DN)


@pytest.mark.parametrize("xs, ws, padding", CASES)
def test_cpu_convolution_values_and_gradients(xs, ws, padding):
    """The composed convolution (narrow kernel where it applies, oneDNN elsewhere) against the
    float64 reference: y, and the gradients in x and w of sum(y * g)."""
    rng = np.random.default_rng(2)
    x, w = _random(xs, rng), _random(ws, rng)
    f = _cpu_conv(padding)
    y_ref = _reference_conv(x, w, padding)
    g = _random(y_ref.shape, rng)
    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    _close(y, y_ref, np.prod(ws[:3]))
    _close(dx, _reference_input_grad(g, w, xs, padding), ws[0] * ws[1] * ws[3])
    xp = _pad(x.astype(np.float64), padding)
    dw_ref = np.stack([np.stack([np.einsum("nhwc,nhwo->co", xp[:, a:a + g.shape[1],
                                                                b:b + g.shape[2]], g)
                                 for b in range(ws[1])]) for a in range(ws[0])])
    _close(dw, dw_ref, np.prod(g.shape[:3]))


def _targets(f, *args):
    return {t for t in onednn.NARROW_CONV_TARGETS if t in jax.jit(f).lower(*args).as_text()}


def test_the_kernel_runs_where_the_rule_says():
    """MOON's CNN: conv1's forward (6 output channels) and conv2's input gradient (6) on the
    kernel; conv2's forward (16) and conv1's input gradient (rows 32 wide but the images take
    none here) on oneDNN; ``MODE="off"`` none; 33-wide rows and stride 2 none."""
    if narrow_conv.isa() not in narrow_conv.FAST_ISAS:
        pytest.skip(f"the rule leaves this CPU's path ({narrow_conv.isa()}) to oneDNN")
    valid = ((0, 0), (0, 0))

    def grads(xs, ws, padding=valid, strides=(1, 1)):
        def loss(x, w):
            return jnp.sum(conv.onednn_narrow_conv_general_dilated(
                x, w, strides, padding, dimension_numbers=DN) ** 2)
        return _targets(jax.grad(loss, (0, 1)), jnp.ones(xs), jnp.ones(ws))

    fwd, bwd = "fedjax_narrow_conv_forward", "fedjax_narrow_conv_backward_data"
    assert grads((2, 32, 32, 3), (5, 5, 3, 6)) == {fwd, bwd}  # dx: 3 channels, 32 wide
    assert grads((2, 14, 14, 6), (5, 5, 6, 16)) == {bwd}
    assert grads((2, 8, 37, 3), (3, 3, 3, 6)) == set()  # 35-wide output, 37-wide input
    assert grads((2, 8, 8, 3), (3, 3, 3, 6), strides=(2, 2)) == set()
    assert grads((2, 8, 8, 3), (3, 3, 3, 9)) == {bwd}  # 9 outputs; dx has 3
    narrow_conv.MODE = "off"
    try:
        assert grads((2, 32, 32, 3), (5, 5, 3, 6)) == set()
    finally:
        narrow_conv.MODE = "auto"
    assert narrow_conv.applies(8, 32, (1, 1), valid, jnp.float32)
    assert not narrow_conv.applies(9, 32, (1, 1), valid, jnp.float32)
    assert not narrow_conv.applies(8, 33, (1, 1), valid, jnp.float32)
    assert not narrow_conv.applies(6, 28, (1, 1), valid, jnp.bfloat16)
    assert not narrow_conv.applies(6, 28, (1, 1), ((0, -1), (0, 0)), jnp.float32)


def test_clients_side_by_side_in_one_call_are_each_clients_own_call():
    """Under vmap one call takes every client (its own kernel, a shared kernel, a shared input,
    two vmaps); each client's result is bitwise its call alone (the same sums in the same
    order)."""
    rng = np.random.default_rng(3)
    pad = ((1, 1), (2, 0))
    x = jnp.asarray(_random((4, 3, 9, 13, 5), rng))
    w = jnp.asarray(_random((4, 3, 3, 5, 6), rng))
    dy = jnp.asarray(_random((4, 3, 9, 13, 6), rng))
    fwd = jax.jit(lambda x, w: narrow_conv.conv(x, w, pad))
    bwd = jax.jit(lambda dy, w: narrow_conv.input_grad(dy, w, x.shape[1:], pad))
    for f, a in ((fwd, x), (bwd, dy)):
        alone = np.stack([np.asarray(f(a[i], w[i])) for i in range(4)])
        np.testing.assert_array_equal(jax.jit(jax.vmap(f))(a, w), alone)
        np.testing.assert_array_equal(jax.jit(jax.vmap(f, (0, None)))(a, w[1]),
                                      np.stack([np.asarray(f(a[i], w[1])) for i in range(4)]))
        np.testing.assert_array_equal(jax.jit(jax.vmap(f, (None, 0)))(a[2], w),
                                      np.stack([np.asarray(f(a[2], w[i])) for i in range(4)]))
        two = jax.jit(jax.vmap(jax.vmap(f)))(a.reshape(2, 2, *a.shape[1:]),
                                              w.reshape(2, 2, *w.shape[1:]))
        np.testing.assert_array_equal(two.reshape(alone.shape), alone)


def test_refusals():
    x, w = jnp.ones((1, 8, 8, 3)), jnp.ones((3, 3, 3, 6))
    with pytest.raises(ValueError, match="float32 only"):
        narrow_conv.conv(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), ((0, 0), (0, 0)))
    with pytest.raises(ValueError, match="padding must be >= 0"):
        narrow_conv.conv(x, w, ((0, 0), (-1, 0)))
    with pytest.raises(ValueError, match="needs padding <= k - 1"):
        narrow_conv.input_grad(jnp.ones((1, 10, 10, 6)), w, (1, 8, 8, 3), ((3, 3), (0, 0)))
    with pytest.raises(Exception, match="output rows at most 32 positions"):
        jax.block_until_ready(narrow_conv.conv(jnp.ones((1, 8, 40, 3)), w, ((0, 0), (0, 0))))


_PATHS_SCRIPT = """
import json, sys
import numpy as np
import jax
from fedjax_rcl.nn import narrow_conv
rng = np.random.default_rng(5)
out = {"isa": narrow_conv.isa()}
for xs, ws, pad in json.loads(sys.argv[1]):
    pad = tuple(map(tuple, pad))
    x, w = rng.normal(size=xs).astype(np.float32), rng.normal(size=ws).astype(np.float32)
    y = jax.jit(lambda x, w: narrow_conv.conv(x, w, pad))(x, w)
    dy = rng.normal(size=y.shape).astype(np.float32)
    dx = jax.jit(lambda dy, w: narrow_conv.input_grad(dy, w, xs, pad))(dy, w)
    out.setdefault("y", []).append(np.asarray(y).tolist())
    out.setdefault("dx", []).append(np.asarray(dx).tolist())
print(json.dumps(out))
"""


def test_every_instruction_set_path_computes_the_convolution():
    """The AVX-512, AVX2 and baseline paths (16-, 8- and 4-float vectors, their own tiles and
    column blocks), each forced in a process of its own with ``$FEDJAX_NARROW_CONV_ISA``, where
    this CPU has it: the forward and input gradient against float64."""
    import json
    import os
    import subprocess
    import sys

    cases = [((2, 32, 32, 3), (5, 5, 3, 6), ((0, 0), (0, 0))),
             ((2, 9, 17, 5), (3, 3, 5, 7), ((1, 1), (1, 1))),
             ((1, 10, 7, 16), (3, 3, 16, 2), ((1, 0), (2, 1)))]
    have = narrow_conv.ISAS.index(narrow_conv.isa())
    for name in narrow_conv.ISAS[:have + 1]:
        env = {**os.environ, "FEDJAX_NARROW_CONV_ISA": name, "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run([sys.executable, "-c", _PATHS_SCRIPT, json.dumps(cases)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout.splitlines()[-1])
        assert out["isa"] == name
        rng = np.random.default_rng(5)
        for i, (xs, ws, pad) in enumerate(cases):
            x, w = rng.normal(size=xs).astype(np.float32), rng.normal(size=ws).astype(np.float32)
            y_ref = _reference_conv(x, w, pad)
            _close(np.array(out["y"][i]), y_ref, np.prod(ws[:3]))
            dy = rng.normal(size=y_ref.shape).astype(np.float32)
            _close(np.array(out["dx"][i]), _reference_input_grad(dy, w, xs, pad),
                   ws[0] * ws[1] * ws[3])

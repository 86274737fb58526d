"""Quick checks of fedjax_rcl.losses and twin_norm: per-anchor float64 loops, edge cases,
jit/vmap, finite gradients. The full table-driven tests live in test_losses.py and
test_twin_norm.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl import losses
from fedjax_rcl.nn.twin_norm import TwinNorm, twin_norm


# ------------------------------------------------------------------ float64 per-anchor loops
def _unit(f):
    f = np.asarray(f, np.float64)
    if f.ndim > 2:
        f = f.mean(axis=tuple(range(1, f.ndim - 1)))
    return f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)


def _loop_supcon(f, y, t, mining):
    u = _unit(f)
    s = u @ u.T
    b = len(y)
    out = []
    for i in range(b):
        same = [j for j in range(b) if y[j] == y[i]]
        other = [k for k in range(b) if y[k] != y[i]]
        mates = [j for j in same if j != i]
        if mining == "hard":
            p = min(s[i, j] for j in same)
            negs = sorted((s[i, k] for k in other), reverse=True)[: min(2, b)]
            den = math.exp(p / t) + sum(math.exp(n / t) for n in negs)
            out.append(-math.log(math.exp(p / t) / den) if other else 0.0)
        elif mates:
            den = sum(math.exp(s[i, k] / t) for k in range(b) if k != i)
            out.append(np.mean([-math.log(math.exp(s[i, j] / t) / den) for j in mates]))
    return float(np.mean(out)) if out else 0.0


def _loop_penalty(f, y, t, thr, mining):
    u = _unit(f)
    s = u @ u.T
    b = len(y)
    out = []
    for i in range(b):
        mates = [j for j in range(b) if j != i and y[j] == y[i]]
        if mining == "hard":
            q = -1.0
            if mates and min(s[i, j] for j in mates) >= thr:
                q = min(s[i, j] for j in mates)
            out.append(math.log1p(math.exp((q - s[i, i]) / t)))
        elif mates:
            out.append(math.log1p(sum(math.exp((s[i, k] - 1) / t) for k in mates if s[i, k] > thr)))
    return float(np.mean(out)) if out else 0.0


def _cases():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(8, 5))
    collapsed = np.tile(rng.normal(size=(1, 5)), (6, 1))
    near = rng.normal(size=(1, 5)) + 0.05 * rng.normal(size=(6, 5))
    zero = base.copy()
    zero[2] = 0.0
    return {
        "mixed": (base, np.array([0, 0, 1, 1, 1, 2, 3, 0])),
        "no_classmate": (base[:4], np.array([0, 1, 2, 3])),
        "single_class": (base[:5], np.zeros(5, int)),
        "one_other": (base[:4], np.array([0, 0, 0, 1])),
        "collapsed": (collapsed, np.array([0, 0, 0, 1, 1, 2])),
        "near_collapsed": (near, np.array([0, 0, 0, 1, 1, 1])),
        "zero_vector": (zero, np.array([0, 0, 1, 1, 1, 2, 3, 0])),
        "b1": (base[:1], np.array([3])),
        "b2_same": (base[:2], np.array([1, 1])),
        "nhwc": (rng.normal(size=(6, 3, 2, 4)), np.array([0, 1, 0, 1, 2, 2])),
    }


CASES = _cases()


@pytest.mark.parametrize("mining", ["hard", "none"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_rcl_matches_loop_and_grads_finite(name, mining):
    f, y = CASES[name]
    t, thr, beta = 0.5, 0.7, 0.7
    with jax.enable_x64():
        got = losses.rcl_loss(
            jnp.asarray(f), jnp.asarray(y), temperature=t, threshold=thr, beta=beta, mining=mining
        )
        want = _loop_supcon(f, y, t, mining) + beta * _loop_penalty(f, y, t, thr, mining)
        np.testing.assert_allclose(float(got), want, rtol=1e-10, atol=1e-12)
        sc = losses.supcon_loss(jnp.asarray(f), jnp.asarray(y), temperature=t, mining=mining)
        np.testing.assert_allclose(float(sc), _loop_supcon(f, y, t, mining), rtol=1e-10, atol=1e-12)
    # float32, compiled, gradient finite (at reference temperature 0.05 too).
    for temp in (0.5, 0.05):
        fn = jax.jit(
            jax.value_and_grad(
                lambda x, y=y, temp=temp: losses.rcl_loss(x, y, temperature=temp, mining=mining)
            )
        )
        val, grad = fn(jnp.asarray(f, jnp.float32))
        assert np.isfinite(val) and np.all(np.isfinite(grad)), (name, temp)


def test_edge_values():
    f, y = CASES["no_classmate"]
    assert float(losses.supcon_loss(f, y, temperature=0.1, mining="none")) == 0.0
    f, y = CASES["single_class"]
    assert float(losses.supcon_loss(f, y, temperature=0.1)) == 0.0
    f, y = CASES["b1"]
    assert float(losses.supcon_loss(f, y, temperature=0.1)) == 0.0
    # Collapsed classmates: the gate is on, q = s_ii = 1, pen = log 2 for those anchors.
    f, y = CASES["collapsed"]
    pen = losses.rcl_loss_terms(f, y, temperature=0.05)[1]
    np.testing.assert_allclose(
        float(pen), (5 * math.log(2) + math.log1p(math.exp(-40))) / 6, rtol=1e-5
    )


def test_multilevel_jit_vmap():
    rng = np.random.default_rng(1)
    levels = [jnp.asarray(rng.normal(size=(3, 6, 4, 4, c)), jnp.float32) for c in (2, 5, 7)]
    y = jnp.asarray(rng.integers(0, 3, size=(3, 6)))
    fn = jax.jit(jax.vmap(lambda fs, y: losses.multilevel_rcl_loss(fs, y, temperature=0.1)))
    got = fn(levels, y)
    want = [
        np.mean([float(losses.rcl_loss(lv[c], y[c], temperature=0.1)) for lv in levels])
        for c in range(3)
    ]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
    with pytest.raises(TypeError):
        losses.multilevel_rcl_loss(levels, y, temprature=0.1)  # misspelled option is rejected


@pytest.mark.parametrize("mining", ["hard", "none"])
@pytest.mark.parametrize("name", ["mixed", "near_collapsed"])
def test_beta_zero_is_supcon_and_beta_scales_the_penalty(name, mining):
    """beta = 0 leaves exactly SupCon and beta = 2 adds twice the penalty, both against the
    independent float64 loops above (not rcl_loss against the supcon_loss it is built on)."""
    f, y = CASES[name]
    t, thr = 0.2, 0.7
    with jax.enable_x64():
        x = jnp.asarray(f, jnp.float64)
        got = {beta: float(losses.rcl_loss(x, y, temperature=t, threshold=thr, beta=beta,
                                           mining=mining)) for beta in (0.0, 2.0)}
    scl, pen = _loop_supcon(f, y, t, mining), _loop_penalty(f, y, t, thr, mining)
    assert got[0.0] == pytest.approx(scl, rel=1e-9, abs=1e-12)
    assert got[2.0] == pytest.approx(scl + 2.0 * pen, rel=1e-9, abs=1e-12)
    if name == "near_collapsed":
        assert pen > 0.1  # the case exercises an active penalty, so beta must matter


def test_nt_xent_and_moon():
    rng = np.random.default_rng(2)
    z1, z2, z3 = (rng.normal(size=(4, 6)) for _ in range(3))
    with jax.enable_x64():
        got = float(losses.nt_xent_loss(jnp.asarray(z1), jnp.asarray(z2), temperature=0.3))
        u = _unit(np.concatenate([z1, z2]))
        s = u @ u.T / 0.3
        want = np.mean(
            [
                -s[i, (i + 4) % 8] + np.log(sum(np.exp(s[i, k]) for k in range(8) if k != i))
                for i in range(8)
            ]
        )
        np.testing.assert_allclose(got, want, rtol=1e-12)
        got = float(losses.moon_loss(jnp.asarray(z1), jnp.asarray(z2), jnp.asarray(z3)))
        a, g, p = _unit(z1), _unit(z2), _unit(z3)
        pos, neg = np.sum(a * g, 1) / 0.5, np.sum(a * p, 1) / 0.5
        want = np.mean(-pos + np.log(np.exp(pos) + np.exp(neg)))
        np.testing.assert_allclose(got, want, rtol=1e-12)
    zero = jnp.zeros((2, 6))
    grad = jax.grad(
        lambda z: (
            losses.moon_loss(z, zero + 1, zero) + losses.nt_xent_loss(z, zero, temperature=0.1)
        )
    )(zero)
    assert np.all(np.isfinite(grad))
    # K = 1: the twin is the only other view, the loss is 0.
    assert abs(float(losses.nt_xent_loss(z1[:1], z2[:1], temperature=0.1))) < 1e-6


def _loop_twin_norm(x, g, eps):
    x = np.asarray(x, np.float64)
    k = x.shape[0] // 2
    out = np.empty_like(x)
    for i in range(k):
        for c0 in range(0, x.shape[-1], g):
            v = np.concatenate([x[i, ..., c0 : c0 + g].ravel(), x[i + k, ..., c0 : c0 + g].ravel()])
            mu, var = v.mean(), v.var()
            for r in (i, i + k):
                out[r, ..., c0 : c0 + g] = (x[r, ..., c0 : c0 + g] - mu) / np.sqrt(var + eps)
    return out


@pytest.mark.parametrize("group_size", [1, 2, 6])
def test_twin_norm(group_size):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 3, 2, 6)) * 3 + 1
    with jax.enable_x64():
        got = jax.jit(lambda x: twin_norm(x, group_size=group_size))(jnp.asarray(x))
        np.testing.assert_allclose(
            np.asarray(got), _loop_twin_norm(x, group_size, 1e-5), rtol=1e-10
        )
    module = TwinNorm(group_size=group_size)
    params = module.init(jax.random.key(0), jnp.zeros((2, 3, 2, 6)))
    assert params["params"]["scale"].shape == (6,)
    params = jax.tree.map(lambda p: p + 0.5, params)
    got = module.apply(params, jnp.asarray(x, jnp.float32))
    want = _loop_twin_norm(x, group_size, 1e-5) * 1.5 + 0.5
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    # Zero-variance groups: finite values and gradients.
    grad = jax.grad(lambda x: jnp.sum(twin_norm(x, group_size=group_size) ** 2))(jnp.zeros_like(x))
    assert np.all(np.isfinite(grad))


def test_twin_norm_errors():
    with pytest.raises(ValueError, match="view pairs"):
        twin_norm(jnp.zeros((3, 2, 2, 4)), group_size=2)
    with pytest.raises(ValueError, match="divide"):
        twin_norm(jnp.zeros((2, 2, 2, 4)), group_size=3)
    with pytest.raises(ValueError, match="group_size"):
        TwinNorm(group_size=0)
    with pytest.raises(ValueError, match="exactly one"):
        TwinNorm()
    x = jnp.arange(2 * 2 * 2 * 6, dtype=jnp.float32).reshape(2, 2, 2, 6)
    by_groups = TwinNorm(num_groups=2)
    np.testing.assert_array_equal(
        by_groups.apply(by_groups.init(jax.random.key(0), x), x), twin_norm(x, group_size=3)
    )
    with pytest.raises(ValueError, match="mining"):
        losses.supcon_loss(jnp.zeros((2, 3)), jnp.zeros(2, int), temperature=1.0, mining="x")

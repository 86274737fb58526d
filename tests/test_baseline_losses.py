"""The baselines' losses (``fedjax_rcl.losses.baselines``) against brute-force NumPy float64
loops: values, gradients (central differences of the loops), edge cases, no gradient into the
global model's outputs or the prototypes, and jit + vmap over a client axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_rcl.losses.baselines import (
    class_prototypes,
    decorrelation_loss,
    feature_hint_loss,
    hybrid_path_losses,
    logit_calibrated_cross_entropy,
    not_true_distillation,
    prototype_contrastive_loss,
    prototypes_from_sums,
)


@pytest.fixture(autouse=True)
def _float64():
    with jax.enable_x64(True):
        yield


# ---- brute-force references (plain loops, float64) ----

def ref_fedlc(z, y, n, tau):
    total = 0.0
    for i in range(len(y)):
        cal = [z[i, c] - tau * n[c] ** -0.25 for c in range(z.shape[1]) if n[c] > 0]
        own = z[i, y[i]] - tau * n[y[i]] ** -0.25
        total += -(own - np.log(sum(np.exp(v) for v in cal)))
    return total / len(y)


def ref_ntd(z, zg, y, tau):
    total = 0.0
    for i in range(len(y)):
        others = [c for c in range(z.shape[1]) if c != y[i]]
        p = np.array([np.exp(z[i, c] / tau) for c in others])
        q = np.array([np.exp(zg[i, c] / tau) for c in others])
        p, q = p / p.sum(), q / q.sum()
        total += sum(q[j] * np.log(q[j] / p[j]) for j in range(len(others)))
    return tau**2 * total / len(y)


def ref_decorr(x):
    n, c = x.shape
    if n == 1:
        return 0.0
    z = np.empty_like(x)
    for a in range(c):
        col = x[:, a] - x[:, a].mean()
        z[:, a] = col / np.sqrt(1e-8 + np.sum(col**2) / (n - 1))
    total = 0.0
    for a in range(c):
        for b in range(c):
            if a != b:
                total += sum(z[i, a] * z[i, b] for i in range(n)) ** 2
    return total / (c * (c - 1)) / n


def ref_mlb(z, hyb, y, tau):
    """(mean over pathways of CE, mean over pathways of KL(p_hybrid || p_main)), loops."""
    def softmax(v):
        e = np.exp(v - v.max())
        return e / e.sum()

    ces, kls = [], []
    for zm in hyb:
        ce = kl = 0.0
        for i in range(len(y)):
            ce += -np.log(softmax(zm[i])[y[i]])
            p, q = softmax(zm[i] / tau), softmax(z[i] / tau)
            kl += sum(p[c] * np.log(p[c] / q[c]) for c in range(len(p)))
        ces.append(ce / len(y))
        kls.append(kl / len(y))
    return np.mean(ces), np.mean(kls)


def ref_hint(fs, gs):
    return np.mean([np.mean((f - g) ** 2) for f, g in zip(fs, gs, strict=True)])


def ref_proto(f, y, protos, present, t):
    unit = lambda v: v / max(np.linalg.norm(v), 1e-12)
    total, count = 0.0, 0
    for i in range(len(y)):
        if not present[y[i]]:
            continue
        s = {c: unit(f[i]) @ unit(protos[c]) / t for c in range(len(present)) if present[c]}
        total += -(s[y[i]] - np.log(sum(np.exp(v) for v in s.values())))
        count += 1
    return total / count if count else 0.0


def numeric_grad(fn, x, eps=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += eps
        down[idx] -= eps
        g[idx] = (fn(up) - fn(down)) / (2 * eps)
    return g


def _check(jax_fn, ref_fn, x):
    np.testing.assert_allclose(float(jax.jit(jax_fn)(jnp.asarray(x))), ref_fn(x), rtol=1e-10,
                               atol=1e-12)
    got = np.asarray(jax.jit(jax.grad(jax_fn))(jnp.asarray(x)))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, numeric_grad(ref_fn, x), rtol=1e-5, atol=1e-7)


# ---- FedLC ----

@pytest.mark.parametrize("seed,tau", [(0, 1.0), (1, 0.5), (2, 2.0)])
def test_fedlc_values_and_gradients(seed, tau):
    rng = np.random.default_rng(seed)
    z, y = rng.normal(size=(6, 5)), rng.integers(0, 5, 6)
    n = np.bincount(y, minlength=5).astype(float) + rng.integers(0, 20, 5) * (
        np.bincount(y, minlength=5) > 0)
    n[[c for c in range(5) if c not in y][:1]] = 0.0  # a class the client lacks
    fn = lambda v: logit_calibrated_cross_entropy(v, jnp.asarray(y), jnp.asarray(n), tau=tau)
    _check(fn, lambda v: ref_fedlc(v, y, n, tau), z)


def test_fedlc_single_class_batch_and_absent_classes_have_no_gradient():
    z, y = np.random.default_rng(3).normal(size=(4, 3)), np.zeros(4, int)
    n = np.array([4.0, 0.0, 0.0])
    fn = lambda v: logit_calibrated_cross_entropy(v, jnp.asarray(y), jnp.asarray(n))
    np.testing.assert_allclose(float(fn(jnp.asarray(z))), 0.0, atol=1e-12)  # only class held
    g = np.asarray(jax.grad(fn)(jnp.asarray(z)))
    assert np.all(np.isfinite(g)) and np.all(g == 0)


# ---- FedNTD ----

@pytest.mark.parametrize("seed,tau", [(0, 1.0), (1, 3.0)])
def test_ntd_values_and_gradients(seed, tau):
    rng = np.random.default_rng(seed)
    z, zg, y = rng.normal(size=(5, 4)), rng.normal(size=(5, 4)), rng.integers(0, 4, 5)
    fn = lambda v: not_true_distillation(v, jnp.asarray(zg), jnp.asarray(y), tau=tau)
    _check(fn, lambda v: ref_ntd(v, zg, y, tau), z)
    g_global = jax.grad(lambda w: not_true_distillation(jnp.asarray(z), w, jnp.asarray(y),
                                                        tau=tau))(jnp.asarray(zg))
    assert np.all(np.asarray(g_global) == 0)


def test_ntd_ignores_the_true_class_logit():
    rng = np.random.default_rng(4)
    z, zg, y = rng.normal(size=(3, 4)), rng.normal(size=(3, 4)), np.array([0, 1, 1])
    moved = z.copy()
    moved[np.arange(3), y] += 5.0
    a = not_true_distillation(jnp.asarray(z), jnp.asarray(zg), jnp.asarray(y))
    b = not_true_distillation(jnp.asarray(moved), jnp.asarray(zg), jnp.asarray(y))
    np.testing.assert_allclose(float(a), float(b), rtol=1e-12)
    np.testing.assert_allclose(float(not_true_distillation(jnp.asarray(zg), jnp.asarray(zg),
                                                           jnp.asarray(y))), 0.0, atol=1e-12)


# ---- FedDecorr ----

@pytest.mark.parametrize("seed,shape", [(0, (6, 4)), (1, (3, 5))])
def test_decorrelation_values_and_gradients(seed, shape):
    x = np.random.default_rng(seed).normal(size=shape)
    _check(decorrelation_loss, ref_decorr, x)


def test_decorrelation_edge_cases():
    loss = jax.jit(decorrelation_loss)  # eagerly, each operation compiles on its own
    assert float(loss(jnp.ones((1, 4)))) == 0.0  # one sample
    x = np.random.default_rng(5).normal(size=(5, 3))
    x[:, 1] = 2.0  # a constant dimension
    g = np.asarray(jax.jit(jax.grad(decorrelation_loss))(jnp.asarray(x)))
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(float(loss(jnp.asarray(x))), ref_decorr(x), rtol=1e-10)
    maps = np.random.default_rng(6).normal(size=(4, 2, 2, 3))  # pooled by spatial mean
    np.testing.assert_allclose(float(loss(jnp.asarray(maps))),
                               ref_decorr(maps.mean(axis=(1, 2))), rtol=1e-10)


# ---- FitNet ----

def test_hint_values_gradients_and_constant_global_features():
    rng = np.random.default_rng(7)
    fs = [rng.normal(size=(3, 4)), rng.normal(size=(3, 2))]
    gs = [rng.normal(size=(3, 4)), rng.normal(size=(3, 2))]
    for level in range(2):
        def fn(v, level=level):
            xs = [jnp.asarray(f) for f in fs]
            xs[level] = v
            return feature_hint_loss(xs, [jnp.asarray(g) for g in gs])

        def ref(v, level=level):
            xs = list(fs)
            xs[level] = v
            return ref_hint(xs, gs)

        _check(fn, ref, fs[level])
    g = jax.grad(lambda w: feature_hint_loss([jnp.asarray(f) for f in fs], w))(
        [jnp.asarray(x) for x in gs])
    assert all(np.all(np.asarray(x) == 0) for x in g)
    with pytest.raises(ValueError, match="levels"):
        feature_hint_loss([jnp.zeros((2, 2))], [])


# ---- FedProc ----

@pytest.mark.parametrize("seed,t", [(0, 0.5), (1, 1.0)])
def test_prototype_loss_values_and_gradients(seed, t):
    rng = np.random.default_rng(seed)
    f, y = rng.normal(size=(6, 3)), rng.integers(0, 4, 6)
    protos = rng.normal(size=(4, 3))
    present = np.array([True, True, False, True])
    fn = lambda v: prototype_contrastive_loss(v, jnp.asarray(y), jnp.asarray(protos),
                                              jnp.asarray(present), temperature=t)
    _check(fn, lambda v: ref_proto(v, y, protos, present, t), f)
    g = jax.grad(lambda p: prototype_contrastive_loss(jnp.asarray(f), jnp.asarray(y), p,
                                                      jnp.asarray(present)))(jnp.asarray(protos))
    assert np.all(np.asarray(g) == 0)


def test_prototype_loss_without_prototypes_is_zero_with_finite_gradient():
    f, y = np.random.default_rng(8).normal(size=(3, 2)), np.array([1, 1, 1])
    fn = lambda v: prototype_contrastive_loss(v, jnp.asarray(y), jnp.zeros((3, 2)),
                                              jnp.zeros(3, bool))
    assert float(jax.jit(fn)(jnp.asarray(f))) == 0.0
    assert np.all(np.asarray(jax.jit(jax.grad(fn))(jnp.asarray(f))) == 0)


def test_prototype_loss_with_a_zero_feature_row_has_a_finite_gradient():
    rng = np.random.default_rng(11)
    f, y = rng.normal(size=(4, 3)), np.array([0, 1, 1, 2])
    f[2] = 0.0  # e.g. a sample whose pre-ReLU features are all zero
    protos, present = rng.normal(size=(3, 3)), np.array([True, True, True])
    fn = lambda v: prototype_contrastive_loss(v, jnp.asarray(y), jnp.asarray(protos),
                                              jnp.asarray(present))
    np.testing.assert_allclose(float(jax.jit(fn)(jnp.asarray(f))),
                               ref_proto(f, y, protos, present, 0.5), rtol=1e-10)
    assert np.all(np.isfinite(np.asarray(jax.jit(jax.grad(fn))(jnp.asarray(f)))))


# ---- FedMLB ----

@pytest.mark.parametrize("seed,m,tau", [(0, 3, 1.0), (1, 1, 2.0), (2, 5, 0.5)])
def test_hybrid_path_losses_values_and_gradients(seed, m, tau):
    rng = np.random.default_rng(seed)
    z, y = rng.normal(size=(5, 4)), rng.integers(0, 3, 5)  # class 3 absent from the batch
    hyb = [rng.normal(size=(5, 4)) for _ in range(m)]
    for term in range(2):
        # w.r.t. the main pathway's logits
        fn = lambda v, t=term: hybrid_path_losses(v, [jnp.asarray(h) for h in hyb],
                                                  jnp.asarray(y), tau=tau)[t]
        _check(fn, lambda v, t=term: ref_mlb(v, hyb, y, tau)[t], z)

        # w.r.t. the last hybrid pathway's logits (the gradient flows into both sides)
        def fn_h(v, t=term):
            hs = [jnp.asarray(h) for h in hyb[:-1]] + [v]
            return hybrid_path_losses(jnp.asarray(z), hs, jnp.asarray(y), tau=tau)[t]

        _check(fn_h, lambda v, t=term: ref_mlb(z, hyb[:-1] + [v], y, tau)[t], hyb[-1])


def test_hybrid_path_losses_edge_cases():
    rng = np.random.default_rng(12)
    z, y = rng.normal(size=(4, 3)), np.zeros(4, int)  # a batch of one class
    ce, kl = hybrid_path_losses(jnp.asarray(z), [jnp.asarray(z)] * 2, jnp.asarray(y))
    assert float(kl) == pytest.approx(0.0, abs=1e-12)  # a pathway equal to the main one
    np.testing.assert_allclose(float(ce), ref_mlb(z, [z], y, 1.0)[0], rtol=1e-12)
    big = jnp.asarray(z * 1e3)  # saturated softmaxes stay finite
    g = jax.grad(lambda v: sum(hybrid_path_losses(v, [big[::-1]], jnp.asarray(y))))(big)
    assert np.all(np.isfinite(np.asarray(g)))
    with pytest.raises(ValueError, match="at least one hybrid pathway"):
        hybrid_path_losses(jnp.asarray(z), [], jnp.asarray(y))


def test_class_prototypes_sum_over_batches_to_the_class_means():
    rng = np.random.default_rng(9)
    f, y = rng.normal(size=(10, 3)), np.array([0, 0, 2, 2, 2, 0, 2, 2, 0, 0])
    s1, c1 = class_prototypes(jnp.asarray(f[:4]), jnp.asarray(y[:4]), 3)
    s2, c2 = class_prototypes(jnp.asarray(f[4:]), jnp.asarray(y[4:]), 3)
    protos, present = prototypes_from_sums(s1 + s2, c1 + c2)
    np.testing.assert_array_equal(np.asarray(present), [True, False, True])
    for c in (0, 2):
        np.testing.assert_allclose(np.asarray(protos[c]), f[y == c].mean(axis=0), rtol=1e-12)
    assert np.all(np.asarray(protos[1]) == 0)


def test_jit_and_vmap_over_a_client_axis():
    rng = np.random.default_rng(10)
    z = jnp.asarray(rng.normal(size=(2, 5, 4)))
    y = jnp.asarray(rng.integers(0, 4, (2, 5)))
    n = jnp.asarray(rng.integers(1, 9, (2, 4)).astype(float))
    batched = jax.jit(jax.vmap(lambda a, b, c: jnp.stack([
        logit_calibrated_cross_entropy(a, b, c), not_true_distillation(a, a[::-1], b),
        decorrelation_loss(a), feature_hint_loss([a], [a * 2]),
        prototype_contrastive_loss(a, b, a[:4], jnp.ones(4, bool))])))(z, y, n)
    for k in range(2):
        one = [logit_calibrated_cross_entropy(z[k], y[k], n[k]),
               not_true_distillation(z[k], z[k][::-1], y[k]), decorrelation_loss(z[k]),
               feature_hint_loss([z[k]], [z[k] * 2]),
               prototype_contrastive_loss(z[k], y[k], z[k][:4], jnp.ones(4, bool))]
        np.testing.assert_allclose(np.asarray(batched[k]), np.asarray(jnp.stack(one)),
                                   rtol=1e-10)

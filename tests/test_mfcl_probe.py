"""The converged linear probe of MFCL (``fedjax_rcl.mfcl.probe``): L-BFGS reaches the optimum
of the L2-penalised multinomial logistic regression (a float64 SciPy reference), converges on
separable data, and the penalty is the one with the best held-out accuracy."""

import jax
import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.special import log_softmax

from fedjax_rcl.mfcl.probe import (
    adam_probe,
    fit_logistic,
    heldout_rows,
    lbfgs_probe,
    standardise,
)


def _blobs(rng, n, d, c, spread=4.0):
    centres = rng.normal(size=(c, d)) * spread
    y = rng.integers(0, c, n)
    return (centres[y] + rng.normal(size=(n, d))).astype(np.float32), y


@pytest.mark.slow
def test_lbfgs_converges_on_separable_data():
    rng = np.random.default_rng(0)
    x, y = _blobs(rng, 400, 8, 3)
    xs, _ = standardise(x, x[:1])
    params, info = fit_logistic(xs, y, 1e-4, num_classes=3, max_iter=1000, tol=1e-6)
    pred = np.argmax(np.asarray(xs @ params["w"] + params["b"]), -1)
    assert np.mean(pred == y) == 1.0
    assert info["converged"] and info["grad_max_abs"] < 1e-6
    assert 1 <= info["iterations"] < 1000
    out = lbfgs_probe(x[:300], y[:300], x[300:], y[300:], num_classes=3, l2_grid=[1e-3],
                      holdout=0.1, max_iter=1000, tol=1e-6, key=jax.random.PRNGKey(0))
    assert out["linear_probe_train_accuracy"] == 1.0
    assert out["linear_probe_accuracy"] > 0.95
    assert out["linear_probe_converged"] and out["linear_probe_grad_max_abs"] < 1e-6
    assert out["linear_probe_heldout_accuracy"] == []  # one penalty: nothing to choose


def _reference(x, y, lam, c):
    """The same objective in float64, minimised by SciPy's L-BFGS-B to a tight tolerance."""
    n, d = x.shape
    onehot = np.eye(c)[y]

    def f(theta):
        w, b = theta[:d * c].reshape(d, c), theta[d * c:]
        logp = log_softmax(x @ w + b, axis=1)
        value = -np.mean(np.sum(onehot * logp, 1)) + 0.5 * lam * np.sum(w * w)
        g = (np.exp(logp) - onehot) / n
        return value, np.concatenate([(x.T @ g + lam * w).ravel(), g.sum(0)])

    res = minimize(f, np.zeros(d * c + c), jac=True, method="L-BFGS-B",
                   options={"maxiter": 10000, "gtol": 1e-12, "ftol": 1e-15})
    return res.x[:d * c].reshape(d, c), res.x[d * c:], res.fun


@pytest.mark.parametrize("lam,basis", [(1e-1, "auto"), (1e-3, "auto"), (1e-3, None)])
def test_lbfgs_matches_a_float64_scipy_reference(lam, basis):
    """Random labels (not separable): the float32 optimum agrees with SciPy's float64 one to
    1e-6 relative in the objective, 1e-4 in the class probabilities and the weights (the
    differences seen are below 2e-6), and in every prediction whose reference margin is not
    within 1e-3 of a tie; with the whitened search (``"auto"``: more rows than features) and
    without (None)."""
    rng = np.random.default_rng(1)
    n, d, c = 300, 12, 4
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, c, n)
    xs = np.asarray(standardise(x, x[:1])[0], np.float64)
    w_ref, b_ref, j_ref = _reference(xs, y, lam, c)
    params, info = fit_logistic(xs.astype(np.float32), y, lam, num_classes=c, max_iter=1000,
                                tol=1e-6, basis=basis)
    assert info["converged"]
    assert info["objective"] == pytest.approx(j_ref, rel=1e-6)
    w, b = np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)
    np.testing.assert_allclose(w, w_ref, atol=1e-4)
    # The bias is determined up to a constant shift (softmax is shift-invariant).
    np.testing.assert_allclose(b - b.mean(), b_ref - b_ref.mean(), atol=1e-4)
    logits_ref = xs @ w_ref + b_ref
    p = np.exp(log_softmax(xs @ w + b, axis=1))
    np.testing.assert_allclose(p, np.exp(log_softmax(logits_ref, axis=1)), atol=1e-4)
    top2 = np.sort(logits_ref, 1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3
    assert clear.mean() > 0.95
    np.testing.assert_array_equal(np.argmax(p, 1)[clear], np.argmax(logits_ref, 1)[clear])


@pytest.mark.slow
def test_the_penalty_is_chosen_by_heldout_accuracy():
    """Separable, unbalanced classes: a huge penalty flattens the weights, leaving the bias
    to predict the majority class (held-out accuracy = its share); every other penalty of the
    grid is perfect on the held-out rows, and of those equally accurate the most regularised
    is chosen, then refitted on every training row."""
    rng = np.random.default_rng(2)
    y = (rng.uniform(size=500) < 0.25).astype(np.int32)  # classes about 3:1
    x = (np.where(y[:, None] == 0, -2.0, 2.0) + rng.normal(size=(500, 6))).astype(np.float32)
    grid = [1e-4, 1e-2, 1.0, 1e4]
    out = lbfgs_probe(x[:400], y[:400], x[400:], y[400:], num_classes=2, l2_grid=grid,
                      holdout=0.25, max_iter=1000, tol=1e-6, key=jax.random.PRNGKey(3),
                      prefix="")
    acc = out["heldout_accuracy"]
    assert out["l2_grid"] == grid and len(acc) == 4
    assert acc[:3] == [1.0, 1.0, 1.0] and acc[3] < 0.85  # the majority class's share
    assert out["l2"] == 1.0
    # The reported held-out accuracies are those of independent fits on the same rows.
    held = heldout_rows(400, 0.25, jax.random.PRNGKey(3))
    xs, _ = standardise(x[:400], x[:1])
    for lam, a in zip(grid, acc, strict=True):
        params, _ = fit_logistic(xs, y[:400], lam, num_classes=2, rows=~held, tol=1e-6)
        pred = np.argmax(np.asarray(xs @ params["w"] + params["b"]), -1)
        assert abs(np.mean(pred[held] == y[:400][held]) - a) <= 1 / held.sum() + 1e-6
    # The refit on all rows with the chosen penalty is the reported probe.
    xs, xt = standardise(x[:400], x[400:])
    params, info = fit_logistic(xs, y[:400], 1.0, num_classes=2, tol=1e-6)
    assert info["converged"] and out["converged"]
    pred = np.argmax(np.asarray(xt @ params["w"] + params["b"]), -1)
    assert out["accuracy"] == pytest.approx(np.mean(pred == y[400:]), abs=0.011)


@pytest.mark.slow
def test_the_penalty_chosen_on_overfitting_features_is_the_best_heldout_one():
    """Many weak features and few rows: the held-out accuracies differ across the grid and
    the chosen penalty's is their maximum."""
    rng = np.random.default_rng(0)
    n, d, c = 300, 200, 3
    w = rng.normal(size=(d, c)) * 0.15
    x = rng.normal(size=(n + 500, d)).astype(np.float32)
    y = np.argmax(x @ w + np.array([1.0, 0, 0]) + rng.gumbel(size=(n + 500, c)), 1)
    out = lbfgs_probe(x[:n], y[:n], x[n:], y[n:], num_classes=c, l2_grid=[1e-5, 1e-1, 1e3],
                      holdout=0.3, max_iter=1000, tol=1e-5, key=jax.random.PRNGKey(0),
                      prefix="")
    acc = out["heldout_accuracy"]
    assert len(set(acc)) > 1
    assert acc[out["l2_grid"].index(out["l2"])] == max(acc)
    assert out["converged"] and all(i >= 1 for i in out["heldout_iterations"])


def test_heldout_rows_are_a_seeded_fraction():
    a = heldout_rows(1000, 0.1, jax.random.PRNGKey(0))
    assert a.dtype == bool and a.sum() == 100
    assert np.array_equal(a, heldout_rows(1000, 0.1, jax.random.PRNGKey(0)))
    assert not np.array_equal(a, heldout_rows(1000, 0.1, jax.random.PRNGKey(1)))
    assert heldout_rows(10, 0.0, jax.random.PRNGKey(0)).sum() == 0
    assert heldout_rows(5, 0.01, jax.random.PRNGKey(0)).sum() == 1  # at least one


def test_standardise_scales_then_uses_the_training_moments():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (50, 7)).astype(np.uint8)
    x[:, 3] = 0  # a constant feature (a dead unit, a black border) maps to 0
    tr, te = standardise(x[:40], x[40:], scale=1 / 255)
    f = x.astype(np.float64) / 255
    mean, std = f[:40].mean(0), f[:40].std(0) + 1e-6
    np.testing.assert_allclose(np.asarray(tr), (f[:40] - mean) / std, atol=1e-4)
    np.testing.assert_allclose(np.asarray(te), (f[40:] - mean) / std, atol=1e-4)
    assert tr.dtype == np.float32 and np.all(np.asarray(tr)[:, 3] == 0)


def test_adam_probe_separates_separable_classes():
    rng = np.random.default_rng(1)
    x, y = _blobs(rng, 600, 8, 3)
    out = adam_probe(x[:500], y[:500], x[500:], y[500:], num_classes=3, epochs=20, lr=1e-2,
                     batch_size=50, key=jax.random.PRNGKey(0))
    assert out["linear_probe_accuracy"] > 0.95
    # Labels unrelated to the features: test accuracy near chance (1/3).
    shuffled = rng.permutation(y)
    out = adam_probe(x[:500], shuffled[:500], x[500:], shuffled[500:], num_classes=3,
                     epochs=20, lr=1e-2, batch_size=50, key=jax.random.PRNGKey(0))
    assert out["linear_probe_accuracy"] < 0.55

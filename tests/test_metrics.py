"""Representation-collapse metrics against literal float64 NumPy definitions (explicit loops
over samples and classes forming the D x D covariances), closed forms, degenerate inputs and
input validation."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_rcl.metrics as metrics
from fedjax_rcl.metrics import (
    class_covariance_traces,
    effective_rank,
    mean_pairwise_cosine,
    spread_share,
    variability_collapse_index,
)

RTOL = 1e-9
EPS = np.finfo(np.float64).eps


# ------------------------------------------------------------------ brute-force references


def brute_covariances(x, y):
    """(Sigma_T, Sigma_W, Sigma_B), each D x D, by explicit loops in float64."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y)
    n, d = x.shape
    mu = np.zeros(d)
    for i in range(n):
        mu += x[i]
    mu /= n
    total = np.zeros((d, d))
    for i in range(n):
        diff = x[i] - mu
        total += np.outer(diff, diff)
    total /= n
    within = np.zeros((d, d))
    between = np.zeros((d, d))
    for c in sorted(set(y.tolist())):
        members = [i for i in range(n) if y[i] == c]
        mu_c = np.zeros(d)
        for i in members:
            mu_c += x[i]
        mu_c /= len(members)
        for i in members:
            diff = x[i] - mu_c
            within += np.outer(diff, diff)
        diff = mu_c - mu
        between += len(members) * np.outer(diff, diff)
    return total, within / n, between / n


def brute_effective_rank(x):
    total, _, _ = brute_covariances(x, np.zeros(len(x), dtype=int))
    s = np.linalg.svd(total, compute_uv=False)
    if s.sum() == 0:
        return 0.0
    p = s / s.sum()
    entropy = 0.0
    for pk in p:
        if pk > 0:
            entropy -= pk * np.log(pk)
    return float(np.exp(entropy))


def brute_vci(x, y):
    n, d = np.shape(x)
    total, _, between = brute_covariances(x, y)
    lam_max = np.linalg.svd(total, compute_uv=False).max()
    rank = np.linalg.matrix_rank(between, tol=lam_max * max(n, d) * EPS)
    if rank == 0:
        return float("nan")
    pinv = np.linalg.pinv(total, rtol=max(n, d) * EPS)
    return float(1.0 - np.trace(pinv @ between) / rank)


# ------------------------------------------------------------------ random inputs


def make_data(n, d, label_values, seed, layout="random"):
    """Class-structured features (class means + anisotropic noise + a common offset) and labels
    drawn from ``label_values``; every class present. ``layout``: "random", "singleton" (the
    last class has exactly one sample) or "one_per_class" (n == number of classes)."""
    rng = np.random.default_rng(seed)
    values = np.asarray(label_values)
    k = len(values)
    if layout == "one_per_class":
        assert n == k
        idx = rng.permutation(k)
    elif layout == "singleton":
        idx = rng.integers(0, k - 1, n)
        idx[: k - 1] = np.arange(k - 1)
        idx[-1] = k - 1
        idx = rng.permutation(idx)
    else:
        idx = rng.integers(0, k, n)
        idx[:k] = np.arange(k)
        idx = rng.permutation(idx)
    means = 2.0 * rng.normal(size=(k, d))
    noise = rng.normal(size=(n, d)) * rng.uniform(0.3, 2.0, size=d)
    x = means[idx] + noise + 3.0
    return x, values[idx]


CASES = [
    pytest.param(50, 5, range(3), "random", id="n50-d5-c3"),
    pytest.param(200, 16, range(10), "random", id="n200-d16-c10"),
    pytest.param(120, 64, range(4), "random", id="n120-d64-c4"),
    pytest.param(16, 16, range(3), "random", id="n16-d16-c3"),
    pytest.param(40, 1, range(3), "random", id="n40-d1-c3"),
    pytest.param(30, 64, range(5), "random", id="d>n-n30-d64-c5"),
    pytest.param(12, 40, range(2), "random", id="d>n-n12-d40-c2"),
    pytest.param(80, 8, [2, 7, 9], "random", id="labels-2-7-9"),
    pytest.param(60, 6, [-3, 0, 4], "random", id="labels-negative"),
    pytest.param(45, 7, range(4), "singleton", id="single-sample-class"),
    pytest.param(20, 30, range(6), "singleton", id="single-sample-class-d>n"),
    pytest.param(6, 4, range(6), "one_per_class", id="one-sample-per-class"),
]


@pytest.mark.parametrize(("n", "d", "labels", "layout"), CASES)
def test_effective_rank_matches_brute_force(n, d, labels, layout):
    x, _ = make_data(n, d, labels, seed=n * 1000 + d, layout=layout)
    expected = brute_effective_rank(x)
    got = effective_rank(x)
    assert isinstance(got, float)
    np.testing.assert_allclose(got, expected, rtol=RTOL)
    assert 1.0 <= got <= min(n - 1, d) + 1e-9


@pytest.mark.parametrize(("n", "d", "labels", "layout"), CASES)
def test_class_covariance_traces_match_brute_force(n, d, labels, layout):
    x, y = make_data(n, d, labels, seed=n * 1000 + d + 1, layout=layout)
    total, within, between = brute_covariances(x, y)
    got_w, got_b = class_covariance_traces(x, y)
    assert isinstance(got_w, float) and isinstance(got_b, float)
    np.testing.assert_allclose(got_b, np.trace(between), rtol=RTOL)
    if layout == "one_per_class":
        assert got_w == 0.0  # every class is one row: no within-class spread, exactly
        assert np.trace(within) < 1e-12 * np.trace(total)
    else:
        np.testing.assert_allclose(got_w, np.trace(within), rtol=RTOL)
    # Sigma_W + Sigma_B = Sigma_T: against the looped total and NumPy's population variance.
    np.testing.assert_allclose(got_w + got_b, np.trace(total), rtol=RTOL)
    np.testing.assert_allclose(got_w + got_b, np.var(x, axis=0).sum(), rtol=RTOL)


@pytest.mark.parametrize(("n", "d", "labels", "layout"), CASES)
def test_variability_collapse_index_matches_brute_force(n, d, labels, layout):
    x, y = make_data(n, d, labels, seed=n * 1000 + d + 2, layout=layout)
    expected = brute_vci(x, y)
    got = variability_collapse_index(x, y)
    assert isinstance(got, float)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=1e-9)
    assert -1e-9 <= got <= 1.0 + 1e-9
    if layout == "one_per_class":  # Sigma_W = 0: Sigma_B = Sigma_T, index 0
        assert abs(got) < 1e-9
    elif n > d + len(labels):  # full-rank within-class noise: strictly inside (0, 1)
        assert 1e-3 < got < 1.0 - 1e-3


# ------------------------------------------------------------------ closed forms


def isotropic(n, d, seed, spectrum=None, offset=5.0):
    """Features whose population covariance is exactly diag(spectrum) (identity by default) in
    a random orthonormal basis: sqrt(N) times orthonormal, centred columns."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, d))
    a -= a.mean(axis=0)
    q, _ = np.linalg.qr(a)  # columns orthonormal and orthogonal to the all-ones vector
    scale = np.ones(d) if spectrum is None else np.sqrt(np.asarray(spectrum, dtype=float))
    basis, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return np.sqrt(n) * (q * scale) @ basis.T + offset


@pytest.mark.parametrize(("n", "d"), [(50, 5), (100, 32), (65, 64), (300, 64)])
def test_effective_rank_of_identity_covariance_is_d(n, d):
    x = isotropic(n, d, seed=d)
    np.testing.assert_allclose(np.cov(x.T, bias=True), np.eye(d), atol=1e-12)  # construction
    np.testing.assert_allclose(effective_rank(x), d, rtol=RTOL)


def test_effective_rank_of_known_spectrum():
    spectrum = [4.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    p = np.array([4.0, 1.0, 1.0]) / 6.0
    expected = math.exp(-float(np.sum(p * np.log(p))))  # about 2.4495
    np.testing.assert_allclose(effective_rank(isotropic(40, 6, seed=3, spectrum=spectrum)),
                               expected, rtol=RTOL)


@pytest.mark.parametrize(("n", "d"), [(30, 8), (10, 50)])
def test_effective_rank_of_rank_one_spread_is_one(n, d):
    rng = np.random.default_rng(n + d)
    t = rng.normal(size=n)
    v = rng.normal(size=d)
    x = t[:, None] * v[None, :] + rng.normal(size=d)
    np.testing.assert_allclose(effective_rank(x), 1.0, rtol=RTOL)


@pytest.mark.parametrize(
    ("x", "y", "trace_within", "trace_between", "vci"),
    [
        # 1-D: classes {0, 2} and {10, 12}; means 1, 11, overall 6; total variance 26.
        pytest.param([[0.0], [2.0], [10.0], [12.0]], [0, 0, 1, 1], 1.0, 25.0, 1.0 / 26.0,
                     id="1d-two-classes"),
        # Class means at -1 and +1 along e1, within-class spread only along e2: the class means
        # explain all the variance along the between-class direction, so the index is 0.
        pytest.param([[-1.0, 1.0], [-1.0, -1.0], [1.0, 1.0], [1.0, -1.0]], [3, 3, 8, 8],
                     1.0, 1.0, 0.0, id="2d-orthogonal-within"),
        # Three classes of unequal sizes in 1-D: {0}, {1, 3}, {8, 8, 10}.
        pytest.param([[0.0], [1.0], [3.0], [8.0], [8.0], [10.0]], [0, 1, 1, 2, 2, 2],
                     (0 + 2 + (4 / 9 + 4 / 9 + 16 / 9)) / 6,
                     (1 * 25 + 2 * 9 + 3 * (26 / 3 - 5) ** 2) / 6,
                     None, id="1d-three-classes-unequal"),
    ],
)
def test_closed_form_traces_and_index(x, y, trace_within, trace_between, vci):
    got_w, got_b = class_covariance_traces(x, y)
    np.testing.assert_allclose([got_w, got_b], [trace_within, trace_between], rtol=1e-12)
    if vci is None:  # one dimension, rank(Sigma_B) = 1: 1 - Tr_B / Tr_T
        vci = 1.0 - trace_between / (trace_within + trace_between)
    np.testing.assert_allclose(variability_collapse_index(x, y), vci, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------ degenerate inputs


@pytest.mark.parametrize(("n", "d"), [(1, 5), (20, 7), (5, 40)])
def test_collapsed_features(n, d):
    """Every row equal (including N = 1): no spread, effective rank 0.0, traces 0, VCI nan."""
    row = np.random.default_rng(d).normal(size=d) * 7.3 + 0.1
    x = np.tile(row, (n, 1))
    y = np.arange(n) % 3
    assert effective_rank(x) == 0.0
    assert class_covariance_traces(x, y) == (0.0, 0.0)
    assert math.isnan(variability_collapse_index(x, y))


def test_one_class():
    x, _ = make_data(40, 6, [0], seed=11)
    y = np.full(40, 5)
    total, _, _ = brute_covariances(x, y)
    got_w, got_b = class_covariance_traces(x, y)
    assert got_b == 0.0
    np.testing.assert_allclose(got_w, np.trace(total), rtol=RTOL)
    assert math.isnan(variability_collapse_index(x, y))
    assert math.isnan(brute_vci(x, y))  # the reference agrees the rank is 0


@pytest.mark.parametrize("offset", [0.0, 3.7])
def test_equal_class_means_give_nan(offset):
    """Each class is symmetric about the same point, so all class means coincide: rank(Sigma_B)
    is 0 (with an offset only up to round-off, which the tolerance relative to Sigma_T
    absorbs), the index is undefined."""
    rng = np.random.default_rng(5)
    a, b = rng.normal(size=(2, 3, 4))
    x = np.concatenate([a, -a, b, -b]) + offset
    y = np.repeat([0, 1], 6)
    got_w, got_b = class_covariance_traces(x, y)
    assert got_b <= 1e-28 * got_w
    np.testing.assert_allclose(got_w, np.var(x, axis=0).sum(), rtol=RTOL)
    assert math.isnan(variability_collapse_index(x, y))


@pytest.mark.parametrize(("n", "d", "k"), [(60, 8, 4), (30, 50, 5), (90, 3, 2)])
def test_classes_collapsed_to_their_means(n, d, k):
    rng = np.random.default_rng(n + d + k)
    means = rng.normal(size=(k, d)) * 3 + 0.1
    y = np.concatenate([np.arange(k), rng.integers(0, k, n - k)]) * 4 + 1  # labels 1, 5, 9, ...
    x = means[(y - 1) // 4]
    total, _, between = brute_covariances(x, y)
    got_w, got_b = class_covariance_traces(x, y)
    assert got_w == 0.0
    np.testing.assert_allclose(got_b, np.trace(total), rtol=RTOL)
    np.testing.assert_allclose(got_b, np.trace(between), rtol=RTOL)
    vci = variability_collapse_index(x, y)
    assert abs(vci) < 1e-9
    np.testing.assert_allclose(vci, brute_vci(x, y), atol=1e-9)
    np.testing.assert_allclose(effective_rank(x), brute_effective_rank(x), rtol=RTOL)
    assert effective_rank(x) <= k - 1 + 1e-9


@pytest.mark.parametrize("scale", [1e200, 1e-200])
def test_scale_invariant_metrics_survive_extreme_scales(scale):
    """Effective rank and VCI do not depend on the features' scale; squaring 1e200 overflows
    and 1e-200 underflows in float64 unless the computation normalises first."""
    x, y = make_data(50, 6, range(3), seed=9)
    np.testing.assert_allclose(effective_rank(x * scale), brute_effective_rank(x), rtol=RTOL)
    np.testing.assert_allclose(variability_collapse_index(x * scale, y), brute_vci(x, y),
                               rtol=RTOL)


# ------------------------------------------------------------------ input types


@pytest.mark.parametrize("kind", ["numpy-float32", "jax-float32", "jax-bfloat16", "list"])
def test_other_array_types_give_the_float64_result(kind):
    """Inputs are converted to float64 NumPy: a float32 or JAX array gives the float64 result of
    the same values (to float64 precision, far tighter than float32 arithmetic could reach)."""
    x, y = make_data(60, 12, [1, 4, 6], seed=21)
    if kind == "numpy-float32":
        xs, ys = x.astype(np.float32), y.astype(np.int32)
    elif kind == "jax-float32":
        xs, ys = jnp.asarray(x, dtype=jnp.float32), jnp.asarray(y, dtype=jnp.int32)
    elif kind == "jax-bfloat16":
        xs, ys = jnp.asarray(x, dtype=jnp.bfloat16), jnp.asarray(y, dtype=jnp.int32)
    else:
        xs, ys = x.tolist(), y.tolist()
    x64 = np.asarray(np.asarray(xs).astype(np.float64))  # the same values, in float64
    if kind != "list":
        assert np.abs(x64 - x).max() > 1e-8  # the inputs really were rounded
    total, within, between = brute_covariances(x64, y)
    np.testing.assert_allclose(effective_rank(xs), brute_effective_rank(x64), rtol=RTOL)
    np.testing.assert_allclose(class_covariance_traces(xs, ys),
                               [np.trace(within), np.trace(between)], rtol=RTOL)
    np.testing.assert_allclose(variability_collapse_index(xs, ys), brute_vci(x64, y),
                               rtol=RTOL)
    # and exactly what the float64 NumPy input gives (same host computation)
    np.testing.assert_allclose(effective_rank(xs), effective_rank(x64), rtol=1e-13)
    np.testing.assert_allclose(variability_collapse_index(xs, ys),
                               variability_collapse_index(x64, y), rtol=1e-13)


def test_public_names():
    assert set(metrics.__all__) == {
        "ema", "effective_rank", "class_covariance_traces", "variability_collapse_index",
        "mean_pairwise_cosine", "spread_share", "recent_mean", "RECENT_WINDOWS"}
    assert metrics.ema(None, 0.5) == 0.5
    assert metrics.ema(0.5, 1.0, decay=0.75) == 0.625


# ------------------------------------------------------------------ validation

GOOD_X = np.arange(15, dtype=np.float64).reshape(5, 3) ** 1.5
GOOD_Y = np.array([0, 1, 0, 1, 2])
NAN_X = GOOD_X.copy()
NAN_X[1, 2] = np.nan
INF_X = GOOD_X.copy()
INF_X[3, 0] = -np.inf
INF_X[4, 1] = np.inf

FEATURE_ERRORS = [
    pytest.param(np.ones(5), r"features must be a 2-D array \[N, D\].*shape \(5,\) \(1-D\)",
                 id="1d"),
    pytest.param(np.ones((5, 3, 2)), r"features must be a 2-D array.*shape \(5, 3, 2\)",
                 id="3d"),
    pytest.param(np.ones((0, 3)), r"features must have at least one row \(N >= 1\); "
                 r"got shape \(0, 3\)", id="n0"),
    pytest.param(np.ones((5, 0)), r"features must have at least one column \(D >= 1\); "
                 r"got shape \(5, 0\)", id="d0"),
    pytest.param(NAN_X, r"features must contain only finite values; got 1 non-finite entries "
                 r"\(NaN or inf\) in an array of shape \(5, 3\), the first at \[1, 2\] = nan",
                 id="nan"),
    pytest.param(INF_X, r"features must contain only finite values; got 2 non-finite.*"
                 r"\[3, 0\] = -inf", id="inf"),
    pytest.param(GOOD_X.astype(np.complex128), r"features must have a real numeric dtype.*"
                 r"complex128", id="complex"),
    pytest.param(GOOD_X > 3, r"features must have a real numeric dtype.*bool", id="bool"),
    pytest.param([[1.0, 2.0], [3.0]], r"features must be a 2-D real array.*list", id="ragged"),
]

LABEL_ERRORS = [
    pytest.param(GOOD_Y[:, None], r"labels must be a 1-D integer array \[N\].*shape \(5, 1\)",
                 id="2d"),
    pytest.param(GOOD_Y[:4], r"labels must have one entry per row of features \(N = 5\); "
                 r"got labels of shape \(4,\)", id="short"),
    pytest.param([], r"labels must have one entry per row of features \(N = 5\); got labels "
                 r"of shape \(0,\)", id="empty"),
    pytest.param(GOOD_Y.astype(np.float32), r"labels must have an integer dtype.*float32",
                 id="float"),
    pytest.param(GOOD_Y > 0, r"labels must have an integer dtype.*bool", id="bool"),
]

WITH_LABELS = [
    pytest.param(class_covariance_traces, id="traces"),
    pytest.param(variability_collapse_index, id="vci"),
]


@pytest.mark.parametrize(("bad", "match"), FEATURE_ERRORS)
@pytest.mark.parametrize("fn", [pytest.param(lambda x, y: effective_rank(x), id="erank"),
                                *WITH_LABELS])
def test_bad_features_raise(fn, bad, match):
    with pytest.raises(ValueError, match=match):
        fn(bad, GOOD_Y)


@pytest.mark.parametrize(("bad", "match"), LABEL_ERRORS)
@pytest.mark.parametrize("fn", WITH_LABELS)
def test_bad_labels_raise(fn, bad, match):
    with pytest.raises(ValueError, match=match):
        fn(GOOD_X, bad)


@pytest.mark.parametrize("fn", WITH_LABELS)
def test_labels_checked_even_when_features_are_collapsed(fn):
    with pytest.raises(ValueError, match=r"labels must have one entry per row"):
        fn(np.ones((5, 3)), GOOD_Y[:3])


# ------------------------------------------------------------------ measures that keep the mean


def brute_uncentred_effective_rank(x):
    x = np.asarray(x, dtype=np.float64)
    n, d = x.shape
    second = np.zeros((d, d))
    for i in range(n):
        second += np.outer(x[i], x[i])
    s = np.linalg.svd(second / n, compute_uv=False)
    if s.sum() == 0:
        return 0.0
    p = s[s > 0] / s.sum()
    return float(np.exp(-sum(pk * np.log(pk) for pk in p)))


def brute_mean_cosine(x):
    rows = [r for r in np.asarray(x, dtype=np.float64) if np.any(r != 0)]
    total, pairs = 0.0, 0
    for i, a in enumerate(rows):
        for j, b in enumerate(rows):
            if i != j:
                total += float(a @ b) / (math.sqrt(a @ a) * math.sqrt(b @ b))
                pairs += 1
    return total / pairs if pairs else float("nan")


def brute_spread_share(x):
    total, _, _ = brute_covariances(x, np.zeros(len(x), dtype=int))
    second = sum(float(r @ r) for r in np.asarray(x, dtype=np.float64)) / len(x)
    return float(np.trace(total) / second)


@pytest.mark.parametrize(("n", "d", "labels", "layout"), CASES)
def test_measures_that_keep_the_mean_match_brute_force(n, d, labels, layout):
    x, _ = make_data(n, d, labels, seed=n * 1000 + d + 7, layout=layout)
    x[0] = 0.0  # a dead row (all-zero post-ReLU features): no direction, left out of the pairs
    np.testing.assert_allclose(effective_rank(x, centred=False),
                               brute_uncentred_effective_rank(x), rtol=RTOL)
    np.testing.assert_allclose(mean_pairwise_cosine(x), brute_mean_cosine(x), rtol=RTOL)
    np.testing.assert_allclose(spread_share(x), brute_spread_share(x), rtol=RTOL)
    assert 1.0 <= effective_rank(x, centred=False) <= min(n, d) + 1e-9
    assert 0.0 <= spread_share(x) <= 1.0


@pytest.mark.parametrize("size", [1e-3, 1e-6])
def test_a_point_with_a_small_spread_keeps_its_centred_rank_and_the_others_see_it(size):
    """Features gathered around one point with a small isotropic spread: the centred effective
    rank (scale-free) stays near D, while the uncentred rank goes to 1, the mean cosine to 1
    and the spread share to 0 -- the collapse the centred measures cannot see."""
    rng = np.random.default_rng(5)
    d = 32
    point = rng.uniform(1.0, 2.0, d)
    x = point + size * rng.normal(size=(4000, d))
    assert effective_rank(x) > 0.9 * d
    np.testing.assert_allclose(effective_rank(x, centred=False), 1.0, atol=50 * size)
    np.testing.assert_allclose(mean_pairwise_cosine(x), 1.0, atol=10 * size**2)
    share = d * size**2 / (d * size**2 + point @ point)
    np.testing.assert_allclose(spread_share(x), share, rtol=0.1)
    # and a healthy spread: zero-mean features have share 1 whatever their rank
    z = rng.normal(size=(500, d))
    np.testing.assert_allclose(spread_share(z - z.mean(axis=0)), 1.0, rtol=1e-12)


def test_degenerate_inputs_of_the_measures_that_keep_the_mean():
    assert effective_rank(np.zeros((4, 3)), centred=False) == 0.0
    assert effective_rank(np.ones((4, 3)), centred=False) == pytest.approx(1.0)
    assert math.isnan(spread_share(np.zeros((4, 3))))
    assert spread_share(np.full((4, 3), 2.5)) == 0.0
    assert math.isnan(mean_pairwise_cosine(np.ones((1, 3))))
    assert math.isnan(mean_pairwise_cosine(np.array([[0.0, 0.0], [1.0, 2.0]])))
    assert mean_pairwise_cosine(np.array([[1.0, 0.0], [0.0, 3.0]])) == 0.0
    assert mean_pairwise_cosine(np.array([[1.0, 1.0], [-2.0, -2.0]])) == pytest.approx(-1.0)
    # scale: rows of 1e200 and 1e-200 neither overflow nor underflow
    x, _ = make_data(30, 4, range(2), seed=3)
    for scale in (1e200, 1e-200):
        np.testing.assert_allclose(mean_pairwise_cosine(x * scale), brute_mean_cosine(x),
                                   rtol=RTOL)
        np.testing.assert_allclose(spread_share(x * scale), brute_spread_share(x), rtol=RTOL)
        np.testing.assert_allclose(effective_rank(x * scale, centred=False),
                                   brute_uncentred_effective_rank(x), rtol=RTOL)


@pytest.mark.parametrize(("bad", "match"), FEATURE_ERRORS)
@pytest.mark.parametrize("fn", [pytest.param(lambda x: effective_rank(x, centred=False),
                                             id="erank-uncentred"),
                                pytest.param(mean_pairwise_cosine, id="cosine"),
                                pytest.param(spread_share, id="share")])
def test_bad_features_raise_in_the_measures_that_keep_the_mean(fn, bad, match):
    with pytest.raises(ValueError, match=match):
        fn(bad)

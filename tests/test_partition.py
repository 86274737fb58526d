"""Tests for fedjax_rcl.data.partitioning (pure NumPy; no JAX needed)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fedjax_rcl.data import partitioning as P

N_CLASSES = 10


def _labels(n: int = 3003, seed: int = 0) -> np.ndarray:
    # Unequal class sizes (not all multiples of anything) and a size that no client count below
    # divides, so the remainder handling is exercised.
    return np.random.default_rng(seed).integers(0, N_CLASSES, size=n)


# (name, num_clients, kwargs, equal sizes?)
CASES = [
    ("iid", 20, dict(method="iid"), True),
    ("dirichlet-balanced", 20, dict(method="dirichlet", alpha=0.1), True),
    ("dirichlet-unbalanced", 20, dict(method="dirichlet", alpha=0.5, balanced=False), False),
    ("shards", 20, dict(method="shards", shards_per_client=2), True),
]
IDS = [c[0] for c in CASES]


def _check_valid(parts: list[np.ndarray], n: int, num_clients: int) -> None:
    assert len(parts) == num_clients
    for p in parts:
        assert p.dtype == np.int64 and p.ndim == 1
        assert np.all(np.diff(p) > 0), "sorted ascending, no repeats within a client"
        assert p.size == 0 or (p[0] >= 0 and p[-1] < n)
    every = np.concatenate(parts)
    assert np.unique(every).size == every.size, "clients must be disjoint"


# --------------------------------------------------------------------------------------------
# Properties shared by every method.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,num_clients,kwargs,equal", CASES, ids=IDS)
def test_disjoint_in_range_and_sizes(name, num_clients, kwargs, equal):
    labels = _labels()
    n = labels.size
    parts = P.partition(labels, num_clients, seed=3, **kwargs)
    _check_valid(parts, n, num_clients)
    sizes = np.array([p.size for p in parts])
    if equal:
        # floor(N / C) each; the N mod C left-over samples belong to no client.
        assert np.all(sizes == n // num_clients)
        assert sizes.sum() == n - n % num_clients
    else:
        assert sizes.min() >= P.MIN_CLIENT_SIZE_UNBALANCED
        assert sizes.sum() == n, "the unbalanced split uses every sample"
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))


@pytest.mark.parametrize("name,num_clients,kwargs,equal", CASES, ids=IDS)
def test_seed_determines_split(name, num_clients, kwargs, equal):
    labels = _labels()
    a = P.partition(labels, num_clients, seed=7, **kwargs)
    b = P.partition(labels, num_clients, seed=7, **kwargs)
    c = P.partition(labels, num_clients, seed=8, **kwargs)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_single_client_and_one_sample_per_client():
    labels = _labels(50)
    (only,) = P.partition(labels, 1, method="dirichlet", alpha=1.0, seed=0)
    assert np.array_equal(only, np.arange(50))
    parts = P.partition(labels, 50, method="iid", seed=0)
    assert sorted(int(p[0]) for p in parts) == list(range(50))


# --------------------------------------------------------------------------------------------
# Heterogeneity follows alpha.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("balanced,num_clients", [(True, 30), (False, 10)])
def test_label_skew_increases_as_alpha_falls(balanced, num_clients):
    labels = _labels(6000, seed=1)
    tv, eff, dom = [], [], []
    for alpha in [100.0, 1.0, 0.1, 0.05]:
        # Averaged over 3 seeds: the 0.1 -> 0.05 step is small (~0.06 in TV), and a single
        # split's noise should not decide the comparison.
        summaries = [
            P.heterogeneity_summary(
                P.class_counts(
                    labels,
                    P.partition(
                        labels,
                        num_clients,
                        method="dirichlet",
                        alpha=alpha,
                        balanced=balanced,
                        seed=seed,
                    ),
                    N_CLASSES,
                )
            )
            for seed in range(3)
        ]
        tv.append(np.mean([s["tv_to_global_mean"] for s in summaries]))
        eff.append(np.mean([s["effective_classes_mean"] for s in summaries]))
        dom.append(np.mean([s["dominant_fraction_mean"] for s in summaries]))
    assert all(a < b for a, b in itertools.pairwise(tv)), tv
    assert all(a > b for a, b in itertools.pairwise(eff)), eff
    assert all(a < b for a, b in itertools.pairwise(dom)), dom
    assert tv[0] < 0.15 and eff[0] > 8.5, "alpha=100 is close to IID"
    assert tv[-1] > 0.5, "alpha=0.05 is strongly skewed"


def test_dirichlet_balanced_client_follows_its_draw():
    # With a tiny alpha p_0 is (numerically) one-hot, and 600 samples of every class are there
    # to take, so client 0 -- filled first -- holds a single class.
    labels = np.repeat(np.arange(N_CLASSES), 600)
    parts = P.partition(labels, 20, method="dirichlet", alpha=1e-3, seed=4)
    _check_valid(parts, labels.size, 20)
    assert np.unique(labels[parts[0]]).size == 1
    assert all(p.size == 300 for p in parts)


def test_dirichlet_tiny_alpha_still_valid():
    # alpha=1e-3 makes many Dirichlet components exactly 0 in float64, so late clients run out of
    # positive-weight samples (balanced) and all eligible proportions can vanish (unbalanced):
    # both fallbacks must still give valid splits.
    labels = _labels(2000, seed=5)
    parts = P.partition(labels, 40, method="dirichlet", alpha=1e-3, seed=1)
    _check_valid(parts, labels.size, 40)
    assert {p.size for p in parts} == {50}
    parts = P.partition(labels, 3, method="dirichlet", alpha=1e-3, balanced=False, seed=1)
    _check_valid(parts, labels.size, 3)
    assert sum(p.size for p in parts) == labels.size


def test_dirichlet_unbalanced_gives_up_with_clear_error(monkeypatch):
    # 100 clients, 10 classes, alpha=0.01: each class lands on ~1 client, so 10 samples for
    # every client is out of reach; the reference would loop forever.
    monkeypatch.setattr(P, "_MAX_REDRAWS", 20)
    labels = np.repeat(np.arange(N_CLASSES), 500)
    with pytest.raises(ValueError, match=r"alpha=0\.01 .*20 redraws"):
        P.partition(labels, 100, method="dirichlet", alpha=0.01, balanced=False, seed=0)


# --------------------------------------------------------------------------------------------
# Shards.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 2, 5])
def test_shards_pure_when_classes_are_whole_shards(gamma):
    # 10 classes x 600 samples, 30 clients: shard size 6000 / (30 gamma) divides 600, so every
    # shard holds one class and a client at most gamma classes.
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(N_CLASSES), 600))
    parts = P.partition(labels, 30, method="shards", shards_per_client=gamma, seed=2)
    _check_valid(parts, labels.size, 30)
    for p in parts:
        assert p.size == 6000 // 30
        assert np.unique(labels[p]).size <= gamma
    # Every shard is used exactly once: all samples are assigned.
    assert sum(p.size for p in parts) == labels.size


def test_shards_straddling_class_boundaries():
    # Class sizes not multiples of the shard size: a shard may cross one class boundary (no class
    # is smaller than a shard), so a client can hold more than gamma classes, at most 2 * gamma.
    labels = _labels(3003, seed=2)  # ~300 per class; 40 shards of 75, 3 samples dropped
    gamma, num_clients = 2, 20
    parts = P.partition(labels, num_clients, method="shards", shards_per_client=gamma, seed=1)
    _check_valid(parts, labels.size, num_clients)
    shard = 3003 // (num_clients * gamma)
    counts = P.class_counts(labels, parts, N_CLASSES)
    assert np.all(counts.sum(axis=1) == shard * gamma)
    assert np.all((counts > 0).sum(axis=1) <= 2 * gamma)
    assert (counts > 0).sum(axis=1).max() > gamma, "some client straddles a class boundary"
    # Exact structure: in the stable label order of the kept samples, each client owns gamma
    # whole, aligned blocks of `shard` consecutive positions.
    kept = np.sort(np.concatenate(parts))
    assert kept.size == 3003 - 3003 % (num_clients * gamma)
    order = kept[np.argsort(labels[kept], kind="stable")]
    position = np.empty(3003, np.int64)
    position[order] = np.arange(order.size)
    for p in parts:
        blocks = np.sort(position[p]).reshape(gamma, shard)
        assert np.all(blocks[:, 0] % shard == 0)
        assert np.all(np.diff(blocks, axis=1) == 1)


# --------------------------------------------------------------------------------------------
# The vectorised weighted draw.
# --------------------------------------------------------------------------------------------


def _sequential_subset_law(w: np.ndarray, k: int) -> dict[frozenset, float]:
    """Exact law of the set drawn by k successive weighted draws without replacement."""
    law: dict[frozenset, float] = {}
    for seq in itertools.permutations(range(w.size), k):
        prob, left = 1.0, w.sum()
        for j in seq:
            prob *= w[j] / left
            left -= w[j]
        key = frozenset(seq)
        law[key] = law.get(key, 0.0) + prob
    return law


@pytest.mark.parametrize("k", [1, 2, 3])
def test_race_matches_successive_draws(k):
    w = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    exact = _sequential_subset_law(w, k)
    rng = np.random.default_rng(123)
    trials = 20000
    freq: dict[frozenset, int] = {}
    for _ in range(trials):
        s = frozenset(P._weighted_sample_without_replacement(np.log(w), k, rng).tolist())
        assert len(s) == k
        freq[s] = freq.get(s, 0) + 1
    assert set(freq) <= set(exact)
    for key, p in exact.items():
        f = freq.get(key, 0) / trials
        # 5 binomial standard errors (plus a floor): loose enough to never flake with the fixed
        # seed, tight enough to catch e.g. drawing with replacement or ignoring the weights.
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / trials) + 1e-3, (key, f, p)


def test_race_zero_weights_and_exhausted_classes():
    rng = np.random.default_rng(0)
    # Fewer positive weights than k: both positives always in, the third uniform over the zeros.
    w = np.array([1.0, 2.0, 0.0, 0.0])
    with np.errstate(divide="ignore"):
        logw = np.log(w)
    hits = np.zeros(4)
    for _ in range(2000):
        s = P._weighted_sample_without_replacement(logw, 3, rng)
        assert len(set(s.tolist())) == 3
        hits[s] += 1
    assert hits[0] == hits[1] == 2000
    assert abs(hits[2] / 2000 - 0.5) < 0.05
    # Zero weights are never taken while positive ones remain.
    for _ in range(200):
        s = P._weighted_sample_without_replacement(logw, 2, rng)
        assert set(s.tolist()) == {0, 1}
    # A heavily favoured class that runs out mid-draw: all 5 of its samples, then the rest of the
    # draws continue over the other class.
    logw = np.log(np.r_[np.full(5, 1e6), np.ones(95)])
    s = P._weighted_sample_without_replacement(logw, 50, rng)
    assert set(range(5)) <= set(s.tolist()) and s.size == 50


def _sequential_class_law(p: np.ndarray, left: np.ndarray, k: int) -> dict[tuple, float]:
    """Exact law of the class counts of k successive weighted draws without replacement, each
    remaining sample of class c weighing p[c] (a recursion over the draws)."""
    law = {tuple(np.zeros(p.size, int)): 1.0}
    for _ in range(k):
        nxt: dict[tuple, float] = {}
        for counts, prob in law.items():
            rem = left - np.asarray(counts)
            w = rem * p
            for c in np.flatnonzero(w > 0):
                new = list(counts)
                new[c] += 1
                nxt[tuple(new)] = nxt.get(tuple(new), 0.0) + prob * w[c] / w.sum()
        law = nxt
    return law


@pytest.mark.parametrize("size", [1, 3, 5])
def test_class_race_matches_successive_draws(size):
    """Version 2's balanced split draws a client's class counts with ``_class_race``: the
    law of successive weighted draws (a class that runs out drops out)."""
    p, left = np.array([0.6, 0.3, 0.1]), np.array([2, 3, 4])
    exact = _sequential_class_law(p, left, size)
    rng = np.random.default_rng(7)
    trials = 20000
    freq: dict[tuple, int] = {}
    for _ in range(trials):
        key = tuple(P._class_race(p, left, size, rng).tolist())
        freq[key] = freq.get(key, 0) + 1
    assert set(freq) <= set(exact)
    for key, q in exact.items():
        f = freq.get(key, 0) / trials
        assert abs(f - q) <= 5 * math.sqrt(q * (1 - q) / trials) + 1e-3, (key, f, q)


def test_class_race_fills_from_zero_weight_classes_when_the_rest_runs_out():
    rng = np.random.default_rng(0)
    counts = P._class_race(np.array([1.0, 0.0, 0.0]), np.array([2, 5, 5]), 6, rng)
    assert counts[0] == 2 and counts.sum() == 6 and (counts <= [2, 5, 5]).all()


def test_version_2_balanced_split_is_valid_seeded_and_as_skewed_as_version_1():
    labels = _labels()
    kw = dict(method="dirichlet", alpha=0.1, seed=3)
    v2 = P.partition(labels, 20, version=2, **kw)
    _check_valid(v2, labels.size, 20)
    assert {p.size for p in v2} == {labels.size // 20}
    again = P.partition(labels, 20, version=2, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(v2, again, strict=True))
    v1 = P.partition(labels, 20, **kw)  # version 1 stays the default and unchanged
    assert not all(np.array_equal(a, b) for a, b in zip(v1, v2, strict=True))
    skew = lambda parts: P.heterogeneity_summary(
        P.class_counts(labels, parts, N_CLASSES))["dominant_fraction_mean"]
    assert abs(skew(v1) - skew(v2)) < 0.15
    with pytest.raises(ValueError, match="version must be one of"):
        P.partition(labels, 20, version=3, **kw)


# --------------------------------------------------------------------------------------------
# Statistics, plot.
# --------------------------------------------------------------------------------------------


def test_class_counts_against_loop():
    labels = _labels(500, seed=9)
    parts = P.partition(labels, 7, method="dirichlet", alpha=0.3, seed=0)
    got = P.class_counts(labels, parts, N_CLASSES)
    want = np.zeros((7, N_CLASSES), int)
    for c, idx in enumerate(parts):
        for i in idx:
            want[c, labels[i]] += 1
    assert got.shape == (7, N_CLASSES) and np.issubdtype(got.dtype, np.integer)
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="num_classes"):
        P.class_counts(labels, parts, 3)


def test_heterogeneity_summary_known_values():
    s = P.heterogeneity_summary(np.array([[5, 5, 0], [0, 0, 10]]))
    # client 0: q=(.5,.5,0); client 1: q=(0,0,1); global g=(.25,.25,.5).
    want = dict(
        num_clients=2,
        num_classes=3,
        size_min=10,
        size_mean=10,
        size_max=10,
        classes_present_mean=1.5,
        effective_classes_mean=(2 + 1) / 2,  # exp(ln 2) and exp(0)
        dominant_fraction_mean=(0.5 + 1) / 2,
        tv_to_global_mean=0.5,  # 0.5*(.25+.25+.5) for both clients
    )
    assert set(s) == set(want)
    counts = ("num_clients", "num_classes", "size_min", "size_max")
    for key, v in want.items():
        assert s[key] == pytest.approx(v), key
        assert type(s[key]) is (int if key in counts else float), key

    iid = P.heterogeneity_summary(np.full((4, 5), 3))
    assert iid["effective_classes_mean"] == pytest.approx(5)
    assert iid["tv_to_global_mean"] == pytest.approx(0)
    assert iid["dominant_fraction_mean"] == pytest.approx(0.2)

    # An empty client counts in the sizes but has no label distribution.
    e = P.heterogeneity_summary(np.array([[0, 0], [4, 0], [2, 2]]))
    assert e["size_min"] == 0 and e["size_mean"] == pytest.approx(8 / 3)
    assert e["classes_present_mean"] == pytest.approx(1.5)
    assert e["tv_to_global_mean"] == pytest.approx((1 / 3 + 1 / 6) / 2)
    assert math.isnan(P.heterogeneity_summary(np.zeros((2, 2), int))["tv_to_global_mean"])
    with pytest.raises(ValueError, match="counts"):
        P.heterogeneity_summary(np.array([1, 2]))


@pytest.mark.parametrize("num_clients,num_classes,names", [(6, 4, True), (150, 60, False)])
def test_plot_writes_png(tmp_path, num_clients, num_classes, names):
    counts = np.random.default_rng(0).integers(0, 50, size=(num_clients, num_classes))
    path = tmp_path / "counts.png"
    class_names = [f"class{i}" for i in range(num_classes)] if names else None
    P.plot_class_counts(counts, path, class_names=class_names, title="t")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    with pytest.raises(ValueError, match="class_names"):
        P.plot_class_counts(counts, path, class_names=["a"])


# --------------------------------------------------------------------------------------------
# Reference split files.
# --------------------------------------------------------------------------------------------


def test_load_reference_split_round_trip(tmp_path):
    labels = _labels(400)
    parts = P.partition(labels, 8, method="dirichlet", alpha=0.05, seed=0)
    rng = np.random.default_rng(0)
    # Written the way the reference writes it: str() of {int: list} with shuffled lists.
    text = str({i: rng.permutation(p).tolist() for i, p in enumerate(parts)})
    assert text.startswith("{0: [")
    path = tmp_path / "dirichlet0.05_clients8.txt"
    path.write_text(text)
    got = P.load_reference_split(path, num_samples=400)
    assert len(got) == 8
    assert all(
        np.array_equal(a, b) and a.dtype == np.int64 for a, b in zip(got, parts, strict=True)
    )
    # Client ids in any order in the file; ordered by id in the result.
    path.write_text("{1: [5, 3], 0: [4]}")
    got = P.load_reference_split(path)
    assert [g.tolist() for g in got] == [[4], [3, 5]]


@pytest.mark.parametrize(
    "text,match",
    [
        ("__import__('os').getcwd()", "not a Python literal"),
        ("dict(a=1)", "not a Python literal"),
        ("{0: [1, 2], 1: [2, 3]}", "disjoint"),
        ("{0: [1, 1]}", "disjoint"),
        ("{0: [0, -1]}", ">= 0"),
        ("{0: [1], 1: [99]}", "< num_samples=10"),
        ("{1: [1], 2: [2]}", "client ids"),
        ("{'0': [1]}", "client ids"),
        ("{0: [1.0]}", "int indices"),
        ("{0: 3}", "int indices"),
        ("[[1, 2]]", "dict"),
        ("{}", "dict"),
        ("{0: [1, 2]", "not a Python literal"),
    ],
)
def test_load_reference_split_rejects(tmp_path, text, match):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        P.load_reference_split(path, num_samples=10)


# --------------------------------------------------------------------------------------------
# Argument errors.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "labels,num_clients,kwargs,arg",
    [
        (None, 5, dict(method="bogus"), "method"),
        (None, 5, dict(method="dirichlet"), "alpha"),
        (None, 5, dict(method="dirichlet", alpha=0.0), "alpha"),
        (None, 5, dict(method="dirichlet", alpha=-1.0), "alpha"),
        (None, 5, dict(method="dirichlet", alpha=float("nan")), "alpha"),
        (None, 5, dict(method="dirichlet", alpha="0.5"), "alpha"),
        (None, 5, dict(method="dirichlet", alpha=0.5, balanced="no"), "balanced"),
        (None, 5, dict(method="shards"), "shards_per_client"),
        (None, 5, dict(method="shards", shards_per_client=0), "shards_per_client"),
        (None, 5, dict(method="shards", shards_per_client=21), "shards_per_client"),
        (None, 5, dict(method="shards", shards_per_client=1.5), "shards_per_client"),
        (None, 0, dict(method="iid"), "num_clients"),
        (None, 101, dict(method="iid"), "num_clients"),
        (None, 2.0, dict(method="iid"), "num_clients"),
        (None, True, dict(method="iid"), "num_clients"),
        (None, 11, dict(method="dirichlet", alpha=1.0, balanced=False), "num_clients"),
        (None, 5, dict(method="iid", seed=-1), "seed"),
        (None, 5, dict(method="iid", seed=None), "seed"),
        (np.zeros((10, 10), int), 5, dict(method="iid"), "labels"),
        (np.zeros(100), 5, dict(method="iid"), "labels"),
        (np.full(100, -1), 5, dict(method="iid"), "labels"),
        (np.zeros(0, int), 1, dict(method="iid"), "labels"),
    ],
)
def test_argument_errors_name_the_argument(labels, num_clients, kwargs, arg):
    labels = _labels(100) if labels is None else labels
    kwargs = dict(seed=0) | kwargs
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        P.partition(labels, num_clients, **kwargs)


def test_unused_arguments_are_ignored():
    labels = _labels(100)
    a = P.partition(labels, 5, method="iid", seed=0, alpha=0.1, shards_per_client=3, balanced=False)
    b = P.partition(labels, 5, method="iid", seed=0)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))

"""Non-IID client partitions of a labelled train set, their statistics and a picture.

Everything here is plain NumPy (plus matplotlib for the plot): a partition is computed once on
the host, before training, and the engine turns it into an on-device index table.

A partition is a ``list[np.ndarray]``: one int64 array of train-set indices per client, sorted
ascending, pairwise disjoint. The methods (see :func:`partition`):

* ``iid`` -- uniform random equal split.
* ``dirichlet`` with ``balanced=True`` -- the FedRCL reference's split procedure (paper Table
  1), drawn anew from the seed: equal-size clients whose label mix follows a per-client
  Dirichlet draw.
* ``dirichlet`` with ``balanced=False`` -- MOON's / NIID-Bench's ``noniid-labeldir`` split: each
  class is divided among clients by a per-class Dirichlet draw, so client sizes vary.
* ``shards`` -- the pathological split of FedAvg (McMahan et al. 2017) used in FedRCL App. C.

:func:`load_reference_split` reads the split files shipped with the FedRCL reference so that
runs can use exactly the reference's clients.
"""

from __future__ import annotations

import ast
import math
import numbers
import os
import textwrap
from collections.abc import Sequence

import numpy as np

__all__ = [
    "METHODS",
    "PARTITIONS",
    "VERSIONS",
    "MIN_CLIENT_SIZE_UNBALANCED",
    "class_counts",
    "heterogeneity_summary",
    "load_reference_split",
    "partition",
    "plot_class_counts",
]

METHODS = ("iid", "dirichlet", "shards")
# Procedure versions (``partition(version=)``): a version's draws never change, so a run keeps
# its clients whatever version later ones use.
VERSIONS = (1, 2)
# A run config's choices: a split drawn by one of ``METHODS``, or read from a file
# (:func:`load_reference_split`).
PARTITIONS = (*METHODS, "file")

# NIID-Bench / MOON redraw the whole unbalanced Dirichlet split until every client holds at least
# this many samples (`min_require_size` in their `partition_data`).
MIN_CLIENT_SIZE_UNBALANCED = 10

# Cap on those redraws. The reference loops forever when the target is unreachable in practice
# (e.g. 100 clients, 10 classes, alpha=0.05: each class lands on a handful of clients); we stop
# and raise instead. One redraw costs O(N), so the cap bounds the time at roughly 1000 * O(N).
_MAX_REDRAWS = 1000


# --------------------------------------------------------------------------------------------
# Argument checks (one-line ValueErrors naming the argument, its value and what is allowed).
# --------------------------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    # bool is an int subclass; a flag passed where a count belongs is a bug, not a 0/1.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def _check_labels(labels: object) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"labels must be a 1-D array of class ids, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("labels must be non-empty, got 0 samples")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"labels must have an integer dtype, got {arr.dtype}")
    if arr.min() < 0:
        raise ValueError(f"labels must be >= 0, got min label {int(arr.min())}")
    return arr.astype(np.int64, copy=False)


def _check_count(name: str, value: object, low: int, high: int | None = None) -> int:
    if not _is_int(value) or value < low or (high is not None and value > high):
        allowed = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------------------------
# Partitions.
# --------------------------------------------------------------------------------------------


def partition(
    labels: np.ndarray | Sequence[int],
    num_clients: int,
    *,
    method: str,
    seed: int,
    alpha: float | None = None,
    shards_per_client: int | None = None,
    balanced: bool = True,
    version: int = 1,
) -> list[np.ndarray]:
    """Splits a labelled train set into disjoint client index sets.

    Methods (``N = len(labels)``, ``K = max(labels) + 1`` classes, ``C = num_clients``):

    * ``"iid"``: a uniform random permutation cut into ``C`` clients of ``floor(N / C)``
      samples. The ``N mod C`` left-over samples (a uniformly random subset) belong to no client,
      as in the reference's ``cifar_iid``. (MOON's ``homo`` uses ``np.array_split`` instead,
      giving sizes that differ by one; we keep equal sizes, as the contract asks.)
    * ``"dirichlet"``, ``balanced=True`` -- FedRCL reference (``cifar_dirichlet_balanced``,
      paper Table 1). Clients are filled one after another. Client ``i`` draws
      ``p_i ~ Dir(alpha * 1_K)`` and takes ``m = floor(N / C)`` not-yet-used samples by
      successive weighted draws without replacement, sample ``j`` having weight
      ``p_i[labels[j]]``. When a class runs out mid-draw the remaining draws simply continue over
      what is left, renormalised -- i.e. they move to the other classes in proportion to
      ``p_i``; nothing is re-drawn. All clients have size ``m``; the ``N mod C`` samples left
      at the end belong to no client (as in the reference). The ``m`` successive draws are done
      in one vectorised step with the exponential race (see
      :func:`_weighted_sample_without_replacement`), which has exactly the distribution of
      successive draws -- and is also how ``torch.multinomial(replacement=False)``, used by the
      reference, is implemented. Differences from the reference: (1) we work with log-weights
      in float64, whereas the reference puts ``p_i`` into a float32 tensor, where Dirichlet
      components below ~1e-45 become exactly 0 (about 1.5% of them for alpha = 0.05, K = 10;
      0.7% for K = 100); (2) if fewer than ``m`` remaining samples have positive weight, we
      take all of them and fill up with a uniform random choice among the remaining zero-weight
      samples (the limit of a tiny positive weight), while the reference's top-k then breaks
      ties among zeros arbitrarily, which can include samples already given to earlier clients
      (so its clients are not guaranteed disjoint); (3) the reference always
      uses seed 0 (``temp_seed(0)``) and NumPy's legacy + torch generators, so its exact split
      is only available through its shipped files (:func:`load_reference_split`).
    * ``"dirichlet"``, ``balanced=False`` -- MOON / NIID-Bench ``noniid-labeldir``
      (``partition_data``). For each class ``k`` in turn: shuffle its samples, draw
      ``q ~ Dir(alpha * 1_C)`` over clients, zero ``q_c`` for every client that already holds
      ``>= N / C`` samples, renormalise, and cut the shuffled class at
      ``floor(cumsum(q) * n_k)``. The whole split is redrawn until every client holds at least
      ``MIN_CLIENT_SIZE_UNBALANCED`` (10) samples; every sample is used. Differences: the
      reference loops forever when that is unreachable, we raise ``ValueError`` after
      ``_MAX_REDRAWS`` redraws (and at once when ``N < 10 * C``); if every still-eligible
      client's ``q_c`` underflows to 0 (the reference would divide 0 by 0) the whole class goes
      to one eligible client chosen uniformly, the ``alpha -> 0`` limit of the draw.
    * ``"shards"`` -- FedAvg's pathological split, FedRCL App. C with
      ``gamma = shards_per_client``: stable-sort the samples by label, cut them into
      ``C * gamma`` shards of ``floor(N / (C * gamma))`` consecutive samples and give each client
      ``gamma`` shards drawn uniformly without replacement. If ``C * gamma`` does not divide
      ``N``, a uniformly random subset of ``N mod (C * gamma)`` samples is dropped before
      sorting (so that no class is systematically short-changed). A client holds at most
      ``gamma`` classes when every class size is a multiple of the shard size (CIFAR-10 with
      100 clients and gamma = 2: 5000 = 20 * 250); otherwise a shard can straddle a class
      boundary and a client can hold more (at most ``2 * gamma`` if no class is smaller than a
      shard).

    Arguments that a method does not use (``alpha``, ``shards_per_client``, ``balanced``) are
    ignored, so a config may always carry them.

    Args:
      labels: int array ``[N]`` of class ids ``>= 0``.
      num_clients: number of clients ``C``, ``1 <= C <= N``.
      method: ``"iid"``, ``"dirichlet"`` or ``"shards"``.
      seed: non-negative int for ``np.random.default_rng``; the same seed (and arguments) gives
        the same split.
      alpha: Dirichlet concentration, finite and ``> 0``; required for ``"dirichlet"``. Smaller
        means more heterogeneous.
      shards_per_client: ``gamma >= 1``, with ``C * gamma <= N``; required for ``"shards"``.
      balanced: for ``"dirichlet"``: ``True`` for the FedRCL split, ``False`` for MOON's.
      version: ``1``, the procedures as first written; ``2``, the balanced Dirichlet split
        drawn in time linear in the samples (the same law, other draws for the same seed: see
        ``_dirichlet_balanced_linear``). The other methods are the same in both.

    Returns:
      ``C`` int64 arrays of train indices, each sorted ascending, pairwise disjoint.

    Raises:
      ValueError: on an invalid argument (the message names it), or when the unbalanced
        Dirichlet split cannot give every client 10 samples.
    """
    labels = _check_labels(labels)
    if version not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
    n = labels.size
    num_clients = _check_count("num_clients", num_clients, 1, n)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    rng = np.random.default_rng(int(seed))

    if method == "iid":
        return _iid(n, num_clients, rng)
    if method == "shards":
        if shards_per_client is None:
            raise ValueError("shards_per_client must be given for method='shards', got None")
        gamma = _check_count("shards_per_client", shards_per_client, 1, n // num_clients)
        return _shards(labels, num_clients, gamma, rng)

    # method == "dirichlet"
    if alpha is None:
        raise ValueError("alpha must be given for method='dirichlet', got None")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, numbers.Real)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise ValueError(f"alpha must be a finite float > 0, got {alpha!r}")
    if not isinstance(balanced, bool | np.bool_):
        raise ValueError(f"balanced must be a bool, got {balanced!r}")
    if balanced:
        draw = _dirichlet_balanced if version == 1 else _dirichlet_balanced_linear
        return draw(labels, num_clients, float(alpha), rng)
    if n < MIN_CLIENT_SIZE_UNBALANCED * num_clients:
        raise ValueError(
            f"num_clients={num_clients} is too large for balanced=False: every client needs "
            f">= {MIN_CLIENT_SIZE_UNBALANCED} samples but there are only {n}"
        )
    return _dirichlet_unbalanced(labels, num_clients, float(alpha), rng)


def _iid(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    size = n // num_clients
    perm = rng.permutation(n)[: size * num_clients].reshape(num_clients, size)
    return [np.sort(row).astype(np.int64) for row in perm]


def _weighted_sample_without_replacement(
    log_weights: np.ndarray, k: int, rng: np.random.Generator
) -> np.ndarray:
    """Draws ``k`` distinct positions with the law of ``k`` successive weighted draws.

    Successive draws: pick position ``j`` with probability ``w_j / sum(w)``, remove it, repeat
    ``k`` times. Exponential race (Efraimidis & Spirakis 2006; equivalently Gumbel-top-k, Kool et
    al. 2019): give each position an arrival time ``T_j = E_j / w_j`` with ``E_j ~ Exp(1)``
    i.i.d. and keep the ``k`` earliest. It has the same law: ``T_j ~ Exp(rate w_j)``
    independently, so the first arrival is ``j`` with probability ``w_j / sum(w)``, and by
    memorylessness the remaining times after that arrival are again independent exponentials
    with the same rates, so the next arrival is a weighted draw among what is left, and so on.
    We compare ``log T_j = log E_j - log w_j`` so that tiny weights (Dirichlet components with
    small alpha) do not underflow; order within the result is not meaningful.

    Positions with zero weight (``log_weights == -inf``) are never taken while a positive one
    is left. If fewer than ``k`` have positive weight, all of those are taken and the rest is a
    uniform random choice among the zero-weight positions (the limit of a tiny equal weight);
    successive draws are undefined there.

    Args:
      log_weights: float array ``[n]``, ``log w_j`` (``-inf`` for zero weight).
      k: number of positions to draw, ``0 <= k <= n``.
      rng: the generator; consumes ``n`` standard exponentials.

    Returns:
      int64 array ``[k]`` of distinct positions into ``log_weights``.
    """
    n = log_weights.size
    with np.errstate(divide="ignore"):  # an exponential of exactly 0 just arrives first
        log_e = np.log(rng.standard_exponential(n))
    if k == 0:
        return np.zeros(0, np.int64)
    positive = np.isfinite(log_weights)
    n_pos = int(positive.sum())
    if n_pos >= k:
        with np.errstate(invalid="ignore"):
            log_t = np.where(positive, log_e - log_weights, np.inf)
        if k == n:
            return np.arange(n, dtype=np.int64)
        return np.argpartition(log_t, k - 1)[:k].astype(np.int64)
    pos_idx = np.flatnonzero(positive)
    zero_idx = np.flatnonzero(~positive)
    fill = zero_idx[np.argpartition(log_e[zero_idx], k - n_pos - 1)[: k - n_pos]]
    return np.concatenate([pos_idx, fill]).astype(np.int64)


def _dirichlet_balanced(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    n = labels.size
    num_classes = int(labels.max()) + 1
    size = n // num_clients
    remaining = np.arange(n, dtype=np.int64)  # not-yet-used samples, kept as a compact array
    parts = []
    for _ in range(num_clients):
        p = rng.dirichlet(np.full(num_classes, alpha))
        with np.errstate(divide="ignore"):  # a component can underflow to 0 for tiny alpha
            log_p = np.log(p)
        chosen = _weighted_sample_without_replacement(log_p[labels[remaining]], size, rng)
        parts.append(np.sort(remaining[chosen]))
        keep = np.ones(remaining.size, bool)
        keep[chosen] = False
        remaining = remaining[keep]
    return parts


def _class_race(p: np.ndarray, left: np.ndarray, size: int, rng: np.random.Generator,
                e: np.ndarray | None = None) -> np.ndarray:
    """Class counts ``[K]`` of ``size`` successive weighted draws without replacement from
    ``left[k]`` samples of each class ``k``, each weighing ``p[k]`` (zero-weight samples taken
    uniformly once no positive one is left). ``e``: the ``[K, size]`` standard exponentials
    to use (drawn from ``rng`` if None). ``O(K size)``."""
    if e is None:
        e = rng.standard_exponential((p.size, size))
    rate = (left[:, None] - np.arange(size)[None, :]) * p[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        times = np.cumsum(np.where(rate > 0, e / rate, np.inf), axis=1)
    flat = times.ravel()
    finite = min(size, int(np.isfinite(flat).sum()))
    first = np.argpartition(flat, finite - 1)[:finite] if finite else np.zeros(0, np.int64)
    counts = np.bincount(first // size, minlength=p.size)
    if finite < size:  # the rest uniformly among the zero-weight samples left
        zero = np.where(p > 0, 0, left - counts)
        counts = counts + rng.multivariate_hypergeometric(zero, size - finite)
    return counts


def _dirichlet_balanced_linear(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """The balanced Dirichlet split (``_dirichlet_balanced``'s law) in ``O(N K)`` time.

    Client after client, ``size = N // C`` successive weighted draws without replacement from
    the samples left, a sample of class ``k`` weighing ``p_k`` (the client's Dirichlet draw).
    A weight depends on the class alone, so the draws are a sequence of classes followed by
    uniform choices within each class: the exponential race of ``_weighted_sample_without_
    replacement`` run on classes (``_class_race``: the ``i``-th arrival of class ``k``, with
    ``r_k`` samples left, comes ``E / ((r_k - i) p_k)`` after the previous one, the minimum of
    ``r_k - i`` exponentials of rate ``p_k``), the ``size`` earliest arrivals over all classes
    giving the client's class counts. Each class's samples are shuffled once and handed out in
    client order: a client's are a uniform choice among those left. Where fewer than ``size``
    samples of positive weight are left, the rest is drawn uniformly among the others (the
    limit of a tiny equal weight), as in version 1. Order of the draws: every client's
    proportions, then each class's shuffle, then the exponentials.
    """
    n = labels.size
    num_classes = int(labels.max()) + 1
    size = n // num_clients
    p = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
    pools = [rng.permutation(np.flatnonzero(labels == k)) for k in range(num_classes)]
    e = rng.standard_exponential((num_clients, num_classes, size))
    left = np.asarray([q.size for q in pools], np.int64)
    counts = np.zeros((num_clients, num_classes), np.int64)
    for c in range(num_clients):
        counts[c] = _class_race(p[c], left, size, rng, e[c])
        left -= counts[c]
    owner = np.concatenate([np.repeat(np.arange(num_clients), counts[:, k])
                            for k in range(num_classes)])
    sample = np.concatenate([pools[k][:counts[:, k].sum()] for k in range(num_classes)])
    order = np.lexsort((sample, owner))
    return np.split(sample[order].astype(np.int64), np.arange(1, num_clients) * size)


def _dirichlet_unbalanced(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    n = labels.size
    num_classes = int(labels.max()) + 1
    by_class = [np.flatnonzero(labels == k) for k in range(num_classes)]
    cap = n / num_clients  # NIID-Bench's balance rule: no new samples once a client has N/C
    for _ in range(_MAX_REDRAWS):
        owners, samples = [], []  # each class's samples and the client each goes to
        sizes = np.zeros(num_clients, np.int64)
        for idx_k in by_class:
            idx_k = rng.permutation(idx_k)
            q = rng.dirichlet(np.full(num_clients, alpha))
            q = q * (sizes < cap)
            total = q.sum()
            if total > 0:
                q = q / total
            else:
                # All eligible clients' proportions underflowed: the alpha -> 0 limit of the
                # draw puts the class on one (uniformly chosen) eligible client.
                q = np.zeros(num_clients)
                q[rng.choice(np.flatnonzero(sizes < cap))] = 1.0
            cuts = (np.cumsum(q) * idx_k.size).astype(np.int64)[:-1]
            # np.split(idx_k, cuts)'s pieces, client by client, without a Python loop over
            # the clients (a million clients take seconds).
            piece = np.diff(np.concatenate([[0], np.clip(cuts, 0, idx_k.size), [idx_k.size]]))
            piece = np.maximum(piece, 0)
            owners.append(np.repeat(np.arange(num_clients), piece))
            samples.append(idx_k)
            sizes += piece
        if sizes.min() >= MIN_CLIENT_SIZE_UNBALANCED:
            owner, sample = np.concatenate(owners), np.concatenate(samples).astype(np.int64)
            order = np.lexsort((sample, owner))
            return np.split(sample[order], np.cumsum(sizes)[:-1])
    raise ValueError(
        f"alpha={alpha} is too small for balanced=False with num_clients={num_clients} and "
        f"{num_classes} classes: no split gave every client >= {MIN_CLIENT_SIZE_UNBALANCED} "
        f"samples in {_MAX_REDRAWS} redraws; raise alpha, lower num_clients or use balanced=True"
    )


def _shards(
    labels: np.ndarray, num_clients: int, gamma: int, rng: np.random.Generator
) -> list[np.ndarray]:
    n = labels.size
    num_shards = num_clients * gamma
    shard_size = n // num_shards
    kept = np.arange(n, dtype=np.int64)
    if num_shards * shard_size < n:
        kept = np.sort(rng.choice(n, num_shards * shard_size, replace=False))
    by_label = kept[np.argsort(labels[kept], kind="stable")]
    shards = by_label.reshape(num_shards, shard_size)
    owner = rng.permutation(num_shards).reshape(num_clients, gamma)
    return [np.sort(shards[row].ravel()).astype(np.int64) for row in owner]


# --------------------------------------------------------------------------------------------
# Statistics and plot.
# --------------------------------------------------------------------------------------------


def class_counts(
    labels: np.ndarray | Sequence[int], parts: Sequence[np.ndarray], num_classes: int
) -> np.ndarray:
    """Per-client class histogram.

    Args:
      labels: int array ``[N]`` of class ids in ``[0, num_classes)``.
      parts: a partition: ``C`` integer index arrays into ``labels``.
      num_classes: ``K``.

    Returns:
      int64 array ``[C, K]``; entry ``[c, k]`` is the number of samples of class ``k`` held by
      client ``c``.
    """
    labels = _check_labels(labels)
    num_classes = _check_count("num_classes", num_classes, 1)
    if labels.max() >= num_classes:
        raise ValueError(
            f"num_classes must exceed every label, got {num_classes} with max label "
            f"{int(labels.max())}"
        )
    counts = np.zeros((len(parts), num_classes), np.int64)
    for c, idx in enumerate(parts):
        idx = np.asarray(idx, dtype=np.int64)
        counts[c] = np.bincount(labels[idx], minlength=num_classes)
    return counts


def heterogeneity_summary(counts: np.ndarray) -> dict[str, float]:
    """A few numbers describing how non-IID a partition is.

    With ``n_c = sum_k counts[c, k]`` and client label distribution ``q_c = counts[c] / n_c``,
    and the pooled distribution ``g = sum_c counts[c] / sum(counts)`` (over the partitioned
    samples, so left-over samples of an equal split do not count):

    * ``num_clients``, ``num_classes``: the shape of ``counts``.
    * ``size_min``, ``size_mean``, ``size_max``: min / mean / max of ``n_c`` over all clients.
    * ``classes_present_mean``: mean number of classes with ``counts[c, k] > 0``.
    * ``effective_classes_mean``: mean of ``exp(H(q_c))``, ``H`` the Shannon entropy in nats
      (``0 log 0 = 0``): ``K`` for a uniform mix, 1 for a single class.
    * ``dominant_fraction_mean``: mean of ``max_k q_c[k]``, the share of the largest class.
    * ``tv_to_global_mean``: mean total-variation distance ``0.5 * sum_k |q_c[k] - g[k]|``, in
      ``[0, 1]``; 0 when every client mirrors the pooled mix. (Zhao et al. 2018's "EMD" between
      label distributions is twice this.)

    The last four are means over clients with ``n_c > 0`` (an empty client has no label
    distribution); they are NaN if every client is empty.

    Args:
      counts: non-negative int array ``[C, K]``, e.g. from :func:`class_counts`.

    Returns:
      dict from the names above to Python numbers: ints for the counts (``num_clients``,
      ``num_classes``, ``size_min``, ``size_max``), floats for the means.
    """
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[0] == 0 or counts.shape[1] == 0:
        raise ValueError(
            f"counts must be a non-empty 2-D [clients, classes] array, got shape {counts.shape}"
        )
    if np.any(counts < 0):
        raise ValueError(f"counts must be >= 0, got min {counts.min()}")
    counts = counts.astype(np.float64)
    sizes = counts.sum(axis=1)
    out = {
        "num_clients": int(counts.shape[0]),
        "num_classes": int(counts.shape[1]),
        "size_min": int(sizes.min()),
        "size_mean": float(sizes.mean()),
        "size_max": int(sizes.max()),
    }
    nonempty = sizes > 0
    if not nonempty.any():
        nan = float("nan")
        out |= {
            "classes_present_mean": nan,
            "effective_classes_mean": nan,
            "dominant_fraction_mean": nan,
            "tv_to_global_mean": nan,
        }
        return out
    c = counts[nonempty]
    q = c / c.sum(axis=1, keepdims=True)
    g = c.sum(axis=0) / c.sum()
    plogp = np.where(q > 0, q * np.log(np.where(q > 0, q, 1.0)), 0.0)
    out |= {
        "classes_present_mean": float((c > 0).sum(axis=1).mean()),
        "effective_classes_mean": float(np.exp(-plogp.sum(axis=1)).mean()),
        "dominant_fraction_mean": float(q.max(axis=1).mean()),
        "tv_to_global_mean": float((0.5 * np.abs(q - g).sum(axis=1)).mean()),
    }
    return out


def plot_class_counts(
    counts: np.ndarray,
    path: str | os.PathLike[str],
    *,
    class_names: Sequence[str] | None = None,
    title: str | None = None,
):
    """Saves a clients x classes heatmap of ``counts`` as a PNG and returns its figure.

    Rows are clients (in id order), columns classes; the colour is the count on a square-root
    scale so that the few samples of minor classes stay visible next to a dominant class. Cells
    hold their numbers when the matrix is small (at most 20 x 20); tick labels are thinned by
    matplotlib when there are many clients or classes, so 100 x 100 or 1000 x 200 stays legible.
    A side panel shows each client's size. Uses the Agg canvas directly (no pyplot, no screen,
    no global backend change).

    Args:
      counts: non-negative int array ``[C, K]``, e.g. from :func:`class_counts`.
      path: where to write the PNG (parent directory must exist).
      class_names: optional ``K`` names for the class axis (used when ``K <= 40``).
      title: optional figure title; defaults to a description with ``C`` and ``K``.
    """
    from matplotlib import colors
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    counts = np.asarray(counts)
    if counts.ndim != 2 or 0 in counts.shape:
        raise ValueError(
            f"counts must be a non-empty 2-D [clients, classes] array, got shape {counts.shape}"
        )
    num_clients, num_classes = counts.shape
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(
            f"class_names must have one name per class ({num_classes}), got {len(class_names)}"
        )

    width = min(18.0, max(7.0, 0.3 * num_classes + 3.0))
    height = min(14.0, max(4.0, 0.18 * num_clients + 1.5))
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    ax, ax_size = fig.subplots(1, 2, sharey=True, width_ratios=[5, 1])

    vmax = max(1, int(counts.max()))
    im = ax.imshow(
        counts,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        norm=colors.PowerNorm(gamma=0.5, vmin=0, vmax=vmax),
    )
    # One slim colour bar to the right of both panels, so it does not split them.
    fig.colorbar(im, ax=[ax, ax_size], label="samples", fraction=0.04, aspect=40, pad=0.01)
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    if class_names is not None and num_classes <= 40:
        ax.set_xticks(
            np.arange(num_classes),
            [str(s) for s in class_names],
            rotation=60,
            ha="right",
            fontsize=8,
        )
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=min(num_classes, 20), integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=min(num_clients, 25), integer=True))
    if num_clients <= 20 and num_classes <= 20:
        for (r, c), v in np.ndenumerate(counts):
            if v:
                shade = "black" if v > 0.5 * vmax else "white"
                ax.text(c, r, str(int(v)), ha="center", va="center", fontsize=7, color=shade)

    sizes = counts.sum(axis=1)
    ax_size.barh(np.arange(num_clients), sizes, height=0.8, color="tab:gray")
    ax_size.set_xlabel("client size")
    ax_size.tick_params(axis="y", left=False)

    title = title or f"Samples per class for {num_clients} clients x {num_classes} classes"
    # Wrapped to the figure's width (about 9 characters per inch at the title's size), so that a
    # long title (a dataset path) is never cut at the edges.
    fig.suptitle(textwrap.fill(title, width=max(20, int(9 * width))))
    fig.savefig(os.fspath(path), format="png", dpi=110)
    return fig


# --------------------------------------------------------------------------------------------
# Reference split files.
# --------------------------------------------------------------------------------------------


def load_reference_split(
    path: str | os.PathLike[str], num_samples: int | None = None
) -> list[np.ndarray]:
    """Loads a client split file shipped with the FedRCL reference.

    The reference ships e.g. ``client_data/CIFAR10/balanced/dirichlet0.05_clients100.txt``: the
    ``str()`` of a Python dict ``{0: [10385, 38497, ...], 1: [...], ...}`` mapping int client ids
    to lists of int train indices (in draw order). The text is parsed with
    ``ast.literal_eval`` -- literals only, never code -- and validated.

    Args:
      path: the file.
      num_samples: if given, the train set size; every index must be below it.

    Returns:
      One int64 array per client, ordered by client id, each sorted ascending (the file's order
      carries no meaning: the reference shuffles each client's list).

    Raises:
      ValueError: if the file is not a dict literal, client ids are not the ints
        ``0..C-1``, a client's value is not a list/tuple/set of ints, an index is negative or
        ``>= num_samples``, or an index appears twice (within or across clients).
    """
    if num_samples is not None:
        num_samples = _check_count("num_samples", num_samples, 1)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        obj = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(
            f"reference split {os.fspath(path)!r} is not a Python literal ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(obj, dict) or not obj:
        raise ValueError(
            f"reference split {os.fspath(path)!r} must be a non-empty dict literal "
            f"{{client_id: [indices]}}, got {type(obj).__name__}"
        )
    keys = list(obj)
    if not all(_is_int(k) for k in keys) or sorted(keys) != list(range(len(keys))):
        shown = sorted(map(repr, keys))[:5]
        raise ValueError(
            f"reference split {os.fspath(path)!r}: client ids must be the ints "
            f"0..{len(keys) - 1}, got {shown}..."
        )
    parts = []
    for cid in range(len(keys)):
        value = obj[cid]
        if not isinstance(value, list | tuple | set) or not all(_is_int(i) for i in value):
            raise ValueError(
                f"reference split {os.fspath(path)!r}: client {cid} must map to a "
                f"list of int indices, got {type(value).__name__}"
            )
        parts.append(np.sort(np.fromiter(value, dtype=np.int64, count=len(value))))
    every = np.concatenate(parts)
    if every.size and every.min() < 0:
        raise ValueError(
            f"reference split {os.fspath(path)!r}: indices must be >= 0, got {int(every.min())}"
        )
    if num_samples is not None and every.size and every.max() >= num_samples:
        raise ValueError(
            f"reference split {os.fspath(path)!r}: indices must be < "
            f"num_samples={num_samples}, got {int(every.max())}"
        )
    uniq, reps = np.unique(every, return_counts=True)
    if uniq.size < every.size:
        dup = uniq[reps > 1]
        raise ValueError(
            f"reference split {os.fspath(path)!r}: clients must be disjoint, "
            f"{dup.size} indices appear more than once (e.g. {int(dup[0])})"
        )
    return parts

"""Representation-collapse metrics on a set of features: effective rank, within- and
between-class covariance traces, the variability collapse index, and two measures that keep
the features' mean: the mean pairwise cosine and the spread share.

Why both kinds: the effective rank and the VCI are taken on *centred* features and do not
depend on their scale, so features that collapse towards one point -- which centring removes --
can keep a high effective rank (the small residual around the point may be spread over many
directions). The mean pairwise cosine, the spread share and the effective rank of the
uncentred second moment (``effective_rank(x, centred=False)``) see that collapse: all three go
to 1, 0 and 1 as every feature approaches one direction.

These run on the host between rounds, on a few thousand test features, so they are computed
in float64 NumPy whatever the input's dtype or array type (NumPy or JAX, float32, bfloat16 or
float64 are all converted to float64 first). Float64 matters here: the quantities are
functions of covariance eigenvalues, and the covariance of nearly collapsed features is badly
conditioned (its small eigenvalues are at float32 round-off level relative to its large
ones), which a pseudo-inverse then amplifies.

Numerical choices shared by the functions (none changes the mathematical value):

* Covariances are shift-invariant, so rows are centred after subtracting a reference row
  (the first row overall, or the first row of each class): identical rows then centre to
  exactly zero, so fully collapsed features or classes give exactly zero spread rather than
  round-off.
* Every measure here but the traces is scale-invariant, so the (centred or raw) features are
  divided by their largest magnitude before any product is formed; features of any finite
  scale neither overflow nor underflow.

Every function validates its inputs where they enter and raises ``ValueError`` naming the
argument, what it got and what is allowed: ``features`` must be a 2-D real array ``[N, D]``
with ``N >= 1``, ``D >= 1`` and only finite values; ``labels`` must be a 1-D integer array of
length ``N`` (any integer values: they need not be contiguous or start at 0).
"""

from __future__ import annotations

import numpy as np

_EPS = float(np.finfo(np.float64).eps)


def _check_features(features) -> np.ndarray:
    try:
        x = np.asarray(features)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"features must be a 2-D real array [N, D]; got a {type(features).__name__} that "
            f"does not convert to an array ({e})") from e
    if x.ndim != 2:
        raise ValueError(
            f"features must be a 2-D array [N, D] (N samples, D feature dimensions); "
            f"got an array of shape {x.shape} ({x.ndim}-D)")
    n, d = x.shape
    if n < 1:
        raise ValueError(f"features must have at least one row (N >= 1); got shape {x.shape}")
    if d < 1:
        raise ValueError(
            f"features must have at least one column (D >= 1); got shape {x.shape}")
    kind = x.dtype.kind
    converted = None
    # 'V' without fields: extension floats such as bfloat16 (ml_dtypes, what JAX hands back).
    if kind in "fiu" or (kind == "V" and x.dtype.names is None):
        try:
            converted = x.astype(np.float64)
        except (TypeError, ValueError):
            converted = None
    if converted is None:
        raise ValueError(
            f"features must have a real numeric dtype (floating or integer); got dtype "
            f"{x.dtype} with shape {x.shape}")
    x = converted
    bad = ~np.isfinite(x)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise ValueError(
            f"features must contain only finite values; got {int(bad.sum())} non-finite "
            f"entries (NaN or inf) in an array of shape {x.shape}, the first at [{i}, {j}] = "
            f"{x[i, j]}")
    return x


def _check_labels(labels, n: int) -> np.ndarray:
    try:
        y = np.asarray(labels)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"labels must be a 1-D integer array [N]; got a {type(labels).__name__} that does "
            f"not convert to an array ({e})") from e
    if y.ndim != 1:
        raise ValueError(
            f"labels must be a 1-D integer array [N] (one class per feature row); got an "
            f"array of shape {y.shape} ({y.ndim}-D)")
    if y.shape[0] != n:
        raise ValueError(
            f"labels must have one entry per row of features (N = {n}); got labels of shape "
            f"{y.shape}")
    if y.dtype.kind not in "iu":
        raise ValueError(
            f"labels must have an integer dtype (signed or unsigned); got dtype {y.dtype} "
            f"with shape {y.shape}")
    return y


def _centred(x: np.ndarray) -> np.ndarray:
    """Rows minus their mean, computed after a shift by the first row (exact zeros when every
    row is equal)."""
    z = x - x[0]
    return z - z.mean(axis=0)


def _class_statistics(x: np.ndarray, y: np.ndarray):
    """Within-class centred rows ``[N, D]``, class counts ``[C]`` and the deviations of the
    class means from the overall mean ``[C, D]``."""
    _, first, inverse, counts = np.unique(y, return_index=True, return_inverse=True,
                                          return_counts=True)
    inverse = inverse.reshape(-1)
    # Shift each class by its own first row, so a class whose rows are equal centres to zeros.
    w = x - x[first][inverse]
    sums = np.zeros((len(counts), x.shape[1]))
    np.add.at(sums, inverse, w)
    shifted_means = sums / counts[:, None]  # mu_c - x[first_c]
    within = w - shifted_means[inverse]
    z = x - x[0]
    # mu_c - mu = (x[first_c] - x[0]) + (mu_c - x[first_c]) - (mu - x[0])
    deviations = (x[first] - x[0]) + shifted_means - z.mean(axis=0)
    return within, counts, deviations


def effective_rank(features, *, centred: bool = True) -> float:
    r"""Effective rank of the features' population covariance: the exponential of the Shannon
    entropy of its normalised singular values, a continuous count of the dimensions the
    features spread over (1 for a single direction, ``D`` for an isotropic spread).

    .. math::

        S = \frac{1}{N} \sum_{i=1}^{N} (x_i - \mu)(x_i - \mu)^\top, \qquad
        p_k = \frac{s_k(S)}{\sum_j s_j(S)}, \qquad
        \operatorname{erank}(X) = \exp\Big(-\sum_k p_k \log p_k\Big), \quad 0 \log 0 = 0,

    with :math:`\mu` the mean row and :math:`s_k(S)` the singular values of ``S``. With
    ``centred=False``, ``S`` is the uncentred second moment
    :math:`\frac{1}{N} \sum_i x_i x_i^\top` (:math:`\mu = 0` above): the count then includes
    the mean's direction, so features gathered around one point have an uncentred rank near 1
    whatever the shape of the small spread around it (which the centred rank measures).

    Roy & Vetterli, "The effective rank: a measure of effective dimensionality", EUSIPCO 2007
    (no arXiv version); used for representation collapse in FedRCL (Seo et al., "Relaxed
    Contrastive Learning for Federated Learning", CVPR 2024, Definition 2),
    https://arxiv.org/abs/2401.04928.

    When every singular value is 0 (every row equal, which includes ``N = 1``; uncentred: every
    row zero) the features have no spread, so there is no distribution over directions and no
    dimension to count: the result is 0.0 rather than the undefined ``exp(-0/0)``.

    For ``D > N`` the nonzero singular values are taken from the ``N x N`` Gram matrix of the
    centred rows divided by ``N``, which has the same nonzero spectrum as ``S``.

    Args:
        features: ``[N, D]`` real array (NumPy or JAX, any float or integer dtype), finite,
            ``N >= 1``.
        centred: the covariance (True, the paper's definition) or the uncentred second
            moment (False).

    Returns:
        The effective rank, a float in ``[1, min(N - 1, D)]`` (centred; ``[1, min(N, D)]``
        uncentred) up to round-off, or 0.0 for features without spread.
    """
    x = _check_features(features)
    n, d = x.shape
    c = _centred(x) if centred else x
    scale = np.max(np.abs(c))
    if scale == 0.0:
        return 0.0
    c = c / scale
    gram = c.T @ c if d <= n else c @ c.T  # both / N; the normalisation below cancels N
    s = np.abs(np.linalg.eigvalsh(gram))  # singular values of a symmetric matrix
    total = s.sum()
    if total == 0.0:
        return 0.0
    p = s[s > 0] / total
    return float(np.exp(-np.sum(p * np.log(p))))


def class_covariance_traces(features, labels) -> tuple[float, float]:
    r"""Traces of the within-class and between-class population covariances of the features.

    .. math::

        \Sigma_W = \frac{1}{N} \sum_c \sum_{i: y_i = c} (x_i - \mu_c)(x_i - \mu_c)^\top,
        \qquad
        \Sigma_B = \frac{1}{N} \sum_c N_c (\mu_c - \mu)(\mu_c - \mu)^\top,

    with :math:`\mu_c` the mean of the :math:`N_c` rows of class :math:`c` and :math:`\mu` the
    mean of all rows, so :math:`\Sigma_W + \Sigma_B = \Sigma_T`, the population total
    covariance. The traces are sums of squared distances; no ``D x D`` matrix is formed.
    A class whose rows are all equal contributes exactly 0 to the within-class trace.

    These are the covariances of neural-collapse analyses (Papyan, Han & Donoho, "Prevalence
    of neural collapse during the terminal phase of deep learning training", PNAS 2020,
    https://arxiv.org/abs/2008.08186), with the ``1/N`` weighting that makes them add up to the
    total covariance.

    Args:
        features: ``[N, D]`` real array (NumPy or JAX, any float or integer dtype), finite,
            ``N >= 1``.
        labels: ``[N]`` integer array, the class of each row (any integer values).

    Returns:
        ``(trace_within, trace_between)``: :math:`\operatorname{Tr}\Sigma_W` and
        :math:`\operatorname{Tr}\Sigma_B`, both ``>= 0``; ``trace_between`` is 0 with one
        class.
    """
    x = _check_features(features)
    y = _check_labels(labels, x.shape[0])
    n = x.shape[0]
    within, counts, deviations = _class_statistics(x, y)
    trace_within = np.sum(within * within) / n
    trace_between = np.sum(counts * np.sum(deviations * deviations, axis=1)) / n
    return float(trace_within), float(trace_between)


def variability_collapse_index(features, labels) -> float:
    r"""Variability collapse index (VCI): how much of the total feature variance along the
    class-mean directions is *not* explained by the class means. 0 when every class has
    collapsed to its mean (all variability is between classes), up to 1 when the class means
    explain nothing.

    .. math::

        \operatorname{VCI} = 1 - \frac{\operatorname{Tr}\big(\Sigma_T^{+} \Sigma_B\big)}
                                     {\operatorname{rank}(\Sigma_B)}, \qquad
        \Sigma_T = \frac{1}{N} \sum_{i=1}^{N} (x_i - \mu)(x_i - \mu)^\top,

    with :math:`\Sigma_B` as in :func:`class_covariance_traces` and :math:`\Sigma_T^{+}` the
    Moore-Penrose pseudo-inverse (the paper typesets it as a transpose; the pseudo-inverse is
    what is meant and what is computed). Since :math:`0 \preceq \Sigma_B \preceq \Sigma_T`,
    the index lies in ``[0, 1]``.

    Xu & Liu, "Quantifying the variability collapse of neural networks", ICML 2023,
    https://arxiv.org/abs/2306.03440.

    Tolerance: with :math:`\lambda_{\max}` the largest eigenvalue (= singular value) of
    :math:`\Sigma_T`, an eigenvalue of :math:`\Sigma_T` or of :math:`\Sigma_B` counts as zero
    when it is ``<= lambda_max * max(N, D) * eps`` (``eps`` = float64 machine epsilon,
    about 2.2e-16), both for the pseudo-inverse and for the rank. Both thresholds are relative
    to the total spread :math:`\Sigma_T` (which bounds :math:`\Sigma_B`), so between-class
    spread at round-off level of the total spread counts as none.

    Degenerate case: when :math:`\operatorname{rank}(\Sigma_B) = 0` (a single class present,
    all class means equal, or every row equal, including ``N = 1``) the index is 0/0,
    undefined: the result is ``float('nan')``.

    Args:
        features: ``[N, D]`` real array (NumPy or JAX, any float or integer dtype), finite,
            ``N >= 1``.
        labels: ``[N]`` integer array, the class of each row (any integer values).

    Returns:
        The index, a float in ``[0, 1]`` (up to round-off), or ``nan`` when
        :math:`\operatorname{rank}(\Sigma_B) = 0`.
    """
    x = _check_features(features)
    y = _check_labels(labels, x.shape[0])
    n, d = x.shape
    c = _centred(x)
    scale = np.max(np.abs(c))
    if scale == 0.0:  # no spread at all: Sigma_T = Sigma_B = 0
        return float("nan")
    _, counts, deviations = _class_statistics(x, y)
    # Sigma_T = V diag(sigma^2 / N) V^T from the SVD of the centred rows; Sigma_B = B^T B with
    # the rows of B the class-mean deviations weighted by sqrt(N_c / N). Both scaled by 1/scale.
    _, sigma, vt = np.linalg.svd(c / scale, full_matrices=False)
    lam_t = sigma**2 / n
    b = deviations / scale * np.sqrt(counts / n)[:, None]
    lam_b = np.linalg.svd(b, compute_uv=False) ** 2
    tol = lam_t.max() * max(n, d) * _EPS
    rank_b = int(np.sum(lam_b > tol))
    if rank_b == 0:
        return float("nan")
    keep = lam_t > tol
    # Tr(Sigma_T^+ Sigma_B) = Tr(B Sigma_T^+ B^T) = sum_k |B v_k|^2 / lambda_k over kept k.
    projected = b @ vt[keep].T
    explained = np.sum(projected**2 / lam_t[keep])
    return float(1.0 - explained / rank_b)


def mean_pairwise_cosine(features) -> float:
    r"""Mean cosine similarity of the features over all pairs of distinct rows, uncentred.

    .. math::

        \bar{c} = \frac{1}{M (M - 1)} \sum_{i \ne j} \frac{x_i^\top x_j}{\|x_i\| \|x_j\|}
                = \frac{\|\sum_i u_i\|^2 - M}{M (M - 1)}, \qquad u_i = x_i / \|x_i\|,

    over the ``M`` rows that are not zero (a zero row has no direction; post-ReLU features can
    be all zero for an image). 1 when every row points one way (features collapsed towards one
    point or ray), 0 for mutually orthogonal rows, down to :math:`-1/(M-1)`. FedRCL's penalty
    (Seo et al., CVPR 2024, Eq. 5, https://arxiv.org/abs/2401.04928) acts on same-class pairs
    whose cosine similarity exceeds a threshold; this is the plainest summary of that
    similarity over all pairs, and it does not remove the mean.

    Args:
        features: ``[N, D]`` real array (NumPy or JAX, any float or integer dtype), finite,
            ``N >= 1``.

    Returns:
        The mean cosine, a float in ``[-1/(M-1), 1]``, or ``nan`` when fewer than two rows are
        nonzero (no pair to compare).
    """
    x = _check_features(features)
    # Each row over its largest magnitude first: the norm neither overflows nor underflows.
    peak = np.max(np.abs(x), axis=1)
    x = x[peak > 0] / peak[peak > 0, None]
    m = x.shape[0]
    if m < 2:
        return float("nan")
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    total = u.sum(axis=0)
    return float((total @ total - m) / (m * (m - 1)))


def spread_share(features) -> float:
    r"""The share of the features' mean squared norm that is spread about their mean rather
    than the mean itself:

    .. math::

        \frac{\operatorname{Tr} \Sigma_T}{\frac{1}{N} \sum_i \|x_i\|^2}
        = \frac{\operatorname{Tr} \Sigma_T}{\operatorname{Tr} \Sigma_T + \|\mu\|^2},

    with :math:`\Sigma_T` the population covariance and :math:`\mu` the mean row. 0 when every
    row is the same point (full collapse), 1 for features centred at the origin. Unlike the
    effective rank and the VCI it depends on how large the spread is against the mean, which is
    what a collapse towards one point shrinks.

    Args:
        features: ``[N, D]`` real array (NumPy or JAX, any float or integer dtype), finite,
            ``N >= 1``.

    Returns:
        The share, a float in ``[0, 1]``, or ``nan`` when every row is zero (0/0).
    """
    x = _check_features(features)
    scale = np.max(np.abs(x))
    if scale == 0.0:
        return float("nan")
    x = x / scale
    c = _centred(x)
    spread = np.sum(c * c)
    return float(spread / np.sum(x * x))

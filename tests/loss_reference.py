"""Brute-force NumPy float64 references for the losses and Twin Normalization (docs/guide.md).

Written as plainly as possible, one explicit Python loop per anchor, so that each line can be
read against the formula it implements (docs/guide.md). Nothing here is fast and nothing here
shares code with ``fedjax_rcl``: these functions are the independent side of the comparison in
``tests/test_losses.py`` and ``tests/test_twin_norm.py``.

Conventions: features ``[B, ...]``; a 4-D input is NHWC ``[B, H, W, C]`` and is pooled
to ``[B, C]`` by the mean over H and W (the reference's ``F.adaptive_avg_pool2d(x, 1)`` on NCHW);
rows are L2-normalised as ``x / max(||x||, 1e-12)`` (the reference's ``F.normalize``); ``s_ij`` is
the dot product of normalised rows i and j (so ``s_ii`` is 1 except for zero rows, where it is 0).

Gradients of these functions are taken by :func:`numeric_grad` (central finite differences), which
is only meaningful where the loss is differentiable: hard mining (a min over classmates, a top-2
over other-class samples, a threshold gate) has kinks where two candidate similarities tie or a
similarity equals the threshold. :func:`hard_mining_margin` says how far an input is from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

NORM_EPS = 1e-12  # x / max(||x||, NORM_EPS), as F.normalize(p=2, eps=1e-12)
FD_STEP = 2e-5  # finite-difference step of numeric_grad (5-point stencil)


# ----------------------------------------------------------------------------------------------
# Shared plumbing: pooling, normalisation, similarities, scalar helpers.


def pool(features) -> np.ndarray:
    """``[B, C]`` or ``[B, H, W, C]`` -> ``[B, C]`` (spatial mean), as a float64 copy."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim == 2:
        return x.copy()
    if x.ndim != 4:
        raise ValueError(f"features must be [B, C] or [B, H, W, C], got shape {x.shape}")
    b_size, height, width, channels = x.shape
    out = np.zeros((b_size, channels))
    for b in range(b_size):
        for h in range(height):
            for w in range(width):
                out[b] += x[b, h, w]
        out[b] /= height * width
    return out


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Row i -> ``x_i / max(||x_i||, 1e-12)``."""
    out = np.zeros_like(x)
    for i in range(x.shape[0]):
        norm = math.sqrt(sum(float(v) * float(v) for v in x[i]))
        out[i] = x[i] / max(norm, NORM_EPS)
    return out


def cosine_matrix(features) -> np.ndarray:
    """``s[i, j]`` = dot product of the pooled, L2-normalised rows i and j."""
    f = l2_normalize(pool(features))
    b_size = f.shape[0]
    s = np.zeros((b_size, b_size))
    for i in range(b_size):
        for j in range(b_size):
            s[i, j] = float(np.dot(f[i], f[j]))
    return s


def logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def softplus(v: float) -> float:
    """``log(1 + e^v)``, stable for large |v|."""
    return max(v, 0.0) + math.log1p(math.exp(-abs(v)))


def _labels(labels, b_size: int) -> list[int]:
    out = [int(v) for v in np.asarray(labels).reshape(-1)]
    if len(out) != b_size:
        raise ValueError(f"{len(out)} labels for {b_size} feature rows")
    return out


def _classmates(y: list[int], i: int) -> list[int]:
    """Indices j != i with y_j == y_i."""
    return [j for j in range(len(y)) if j != i and y[j] == y[i]]


def _other_class(y: list[int], i: int) -> list[int]:
    """Indices k with y_k != y_i."""
    return [k for k in range(len(y)) if y[k] != y[i]]


def _check_mining(mining: str) -> None:
    if mining not in ("hard", "none"):
        raise ValueError(f"mining must be 'hard' or 'none', got {mining!r}")


# ----------------------------------------------------------------------------------------------
# The losses.


def supcon_loss(features, labels, *, temperature: float, mining: str = "hard") -> float:
    """Supervised contrastive loss, ``supcon_loss``.

    hard: ``l_i = -log(e^{p_i/t} / (e^{p_i/t} + sum_{top-2 other-class k} e^{s_ik/t}))`` with
    ``p_i = min_{j: y_j = y_i} s_ij`` (j = i included); ``l_i = 0`` without other-class samples;
    mean over all B anchors.
    none: ``l_i = mean_{j != i, y_j = y_i} -log(e^{s_ij/t} / sum_{k != i} e^{s_ik/t})``; mean over
    anchors with at least one classmate, 0 if there is none.
    """
    _check_mining(mining)
    t = float(temperature)
    s = cosine_matrix(features)
    b_size = s.shape[0]
    y = _labels(labels, b_size)

    if mining == "hard":
        total = 0.0
        for i in range(b_size):
            others = _other_class(y, i)
            if not others:
                continue  # l_i = 0
            same_class = [j for j in range(b_size) if y[j] == y[i]]  # includes i itself
            p_i = min(s[i, j] for j in same_class)
            negatives = sorted((s[i, k] for k in others), reverse=True)[: min(2, b_size)]
            logits = [p_i / t] + [v / t for v in negatives]
            total += logsumexp(logits) - p_i / t
        return total / b_size

    per_anchor = []
    for i in range(b_size):
        positives = _classmates(y, i)
        if not positives:
            continue
        log_denominator = logsumexp([s[i, k] / t for k in range(b_size) if k != i])
        terms = [log_denominator - s[i, j] / t for j in positives]
        per_anchor.append(sum(terms) / len(terms))
    return sum(per_anchor) / len(per_anchor) if per_anchor else 0.0


def rcl_penalty(
    features, labels, *, temperature: float, threshold: float, mining: str = "hard"
) -> float:
    """The relaxation penalty of ``rcl_loss`` (without the factor beta).

    hard: ``m_i = min_{j != i, y_j = y_i} s_ij``; ``q_i = m_i`` if i has a classmate and
    ``m_i >= threshold``, else ``q_i = -1``; ``pen_i = softplus((q_i - s_ii)/t)``; mean over all B.
    none: ``pen_i = log(1 + sum_{k != i, y_k = y_i, s_ik > threshold} e^{(s_ik - 1)/t})``; mean
    over anchors with at least one classmate, 0 if there is none.
    """
    _check_mining(mining)
    t = float(temperature)
    s = cosine_matrix(features)
    b_size = s.shape[0]
    y = _labels(labels, b_size)

    if mining == "hard":
        total = 0.0
        for i in range(b_size):
            mates = _classmates(y, i)
            q_i = -1.0
            if mates:
                m_i = min(s[i, j] for j in mates)
                if m_i >= threshold:
                    q_i = m_i
            total += softplus((q_i - s[i, i]) / t)
        return total / b_size

    per_anchor = []
    for i in range(b_size):
        mates = _classmates(y, i)
        if not mates:
            continue
        inner = sum(math.exp((s[i, k] - 1.0) / t) for k in mates if s[i, k] > threshold)
        per_anchor.append(math.log1p(inner))
    return sum(per_anchor) / len(per_anchor) if per_anchor else 0.0


def rcl_loss(
    features,
    labels,
    *,
    temperature: float = 0.05,
    threshold: float = 0.7,
    beta: float = 1.0,
    mining: str = "hard",
) -> float:
    """``supcon_loss + beta * penalty`` (``rcl_loss``)."""
    scl = supcon_loss(features, labels, temperature=temperature, mining=mining)
    pen = rcl_penalty(features, labels, temperature=temperature, threshold=threshold, mining=mining)
    return scl + beta * pen


def multilevel_rcl_loss(features_per_level, labels, **kw) -> float:
    """Mean over levels of :func:`rcl_loss` (``multilevel_rcl_loss``)."""
    levels = list(features_per_level)
    if not levels:
        raise ValueError("features_per_level is empty")
    return sum(rcl_loss(f, labels, **kw) for f in levels) / len(levels)


def moon_loss(z, z_global, z_prev, *, temperature: float = 0.5) -> float:
    """MOON Eq. 3: mean_b -log(e^{cos(z,zg)/t} / (e^{cos(z,zg)/t} + e^{cos(z,zp)/t}))."""
    t = float(temperature)
    a = l2_normalize(pool(z))
    g = l2_normalize(pool(z_global))
    p = l2_normalize(pool(z_prev))
    if not a.shape == g.shape == p.shape:
        raise ValueError(f"shapes differ: {a.shape}, {g.shape}, {p.shape}")
    total = 0.0
    for b in range(a.shape[0]):
        positive = float(np.dot(a[b], g[b])) / t
        negative = float(np.dot(a[b], p[b])) / t
        total += logsumexp([positive, negative]) - positive
    return total / a.shape[0]


def nt_xent_loss(z1, z2, *, temperature: float) -> float:
    """NT-Xent: 2K views, positive = the twin view, denominator over the other 2K-1 views."""
    t = float(temperature)
    a = l2_normalize(pool(z1))
    b = l2_normalize(pool(z2))
    if a.shape != b.shape:
        raise ValueError(f"z1 and z2 differ in shape: {a.shape} vs {b.shape}")
    k_size = a.shape[0]
    views = np.concatenate([a, b], axis=0)  # row r and row r + K are twins
    n = 2 * k_size
    total = 0.0
    for r in range(n):
        twin = r + k_size if r < k_size else r - k_size
        logits = [float(np.dot(views[r], views[k])) / t for k in range(n) if k != r]
        total += logsumexp(logits) - float(np.dot(views[r], views[twin])) / t
    return total / n


# ----------------------------------------------------------------------------------------------
# Twin Normalization.


def twin_norm(x, *, group_size: int, eps: float = 1e-5) -> np.ndarray:
    """``[2K, H, W, C]``: rows i and i+K share per-group mean and population variance."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 4:
        raise ValueError(f"twin_norm expects [2K, H, W, C], got shape {x.shape}")
    rows, _, _, channels = x.shape
    if rows % 2:
        raise ValueError(f"twin_norm needs view pairs (an even batch), got {rows} rows")
    if channels % group_size:
        raise ValueError(f"group_size {group_size} does not divide {channels} channels")
    k_size = rows // 2
    out = np.empty_like(x)
    for i in range(k_size):
        for start in range(0, channels, group_size):
            group = slice(start, start + group_size)
            values = [float(v) for r in (i, i + k_size) for v in x[r, :, :, group].ravel()]
            mean = math.fsum(values) / len(values)
            var = math.fsum((v - mean) ** 2 for v in values) / len(values)
            for r in (i, i + k_size):
                out[r, :, :, group] = (x[r, :, :, group] - mean) / math.sqrt(var + eps)
    return out


def group_norm(x, scale, bias, *, num_groups: int, eps: float = 1e-5) -> np.ndarray:
    """``[N, ..., C]``: each sample's groups of ``C / num_groups`` consecutive channels
    standardised with their own mean and population variance, then ``scale * . + bias``."""
    x = np.asarray(x, dtype=np.float64)
    scale, bias = np.asarray(scale, np.float64), np.asarray(bias, np.float64)
    channels = x.shape[-1]
    if channels % num_groups:
        raise ValueError(f"num_groups {num_groups} does not divide {channels} channels")
    size = channels // num_groups
    out = np.empty_like(x)
    for n in range(x.shape[0]):
        for start in range(0, channels, size):
            group = x[n, ..., start:start + size]
            values = [float(v) for v in group.ravel()]
            mean = math.fsum(values) / len(values)
            var = math.fsum((v - mean) ** 2 for v in values) / len(values)
            out[n, ..., start:start + size] = (group - mean) / math.sqrt(var + eps)
    return out * scale + bias


# ----------------------------------------------------------------------------------------------
# Gradients and distance to kinks.


def numeric_grad(
    f: Callable[[np.ndarray], float],
    x,
    *,
    step: float = FD_STEP,
    where: np.ndarray | None = None,
) -> np.ndarray:
    """Gradient of scalar ``f`` at ``x`` by the 5-point central stencil, in float64.

    ``(8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / (12 h)`` has truncation error
    ``h^4 f^(5) / 30`` and rounding error about ``1.5 eps |f| / h``; with h = 2e-5 on features of
    order 1 and temperatures >= 0.05 both are below 1e-9. Entries where ``where`` is False are
    left NaN (not computed), e.g. zero feature rows, where ``f`` is not differentiable.
    """
    x = np.array(x, dtype=np.float64)
    grad = np.full(x.shape, np.nan)
    for index in np.ndindex(*x.shape):
        if where is not None and not where[index]:
            continue
        values = {}
        for k in (-2, -1, 1, 2):
            shifted = x.copy()
            shifted[index] += k * step
            values[k] = float(f(shifted))
        grad[index] = (8.0 * (values[1] - values[-1]) - (values[2] - values[-2])) / (12.0 * step)
    return grad


def hard_mining_margin(features, labels, *, threshold: float | None = None) -> float:
    """Smallest distance of ``features`` to a kink of the mined losses (inf if none applies).

    Over anchors with a non-zero row: the gap between the two smallest same-class similarities
    (j = i included: SCL's positive), between the 2nd and 3rd largest other-class similarities
    (SCL's negatives), between the two smallest classmate similarities (penalty's m_i), and, with
    a threshold, ``|m_i - threshold|`` and ``|s_ik - threshold|`` for classmates k (both gates).
    Zero rows are skipped as anchors: their similarities are all exactly 0 and stay so under any
    perturbation of the other rows. A perturbation of size d in one input entry moves any
    similarity by at most ``d / ||pooled row||``.
    """
    s = cosine_matrix(features)
    norms = np.linalg.norm(pool(features), axis=1)
    b_size = s.shape[0]
    y = _labels(labels, b_size)
    gaps = [math.inf]
    for i in range(b_size):
        if norms[i] == 0.0:
            continue
        same = sorted(s[i, j] for j in range(b_size) if y[j] == y[i])
        if len(same) >= 2:
            gaps.append(same[1] - same[0])
        others = sorted((s[i, k] for k in _other_class(y, i)), reverse=True)
        if len(others) >= 3:
            gaps.append(others[1] - others[2])
        mates = sorted(s[i, j] for j in _classmates(y, i))
        if len(mates) >= 2:
            gaps.append(mates[1] - mates[0])
        if threshold is not None and mates:
            gaps.append(abs(mates[0] - threshold))
            gaps.extend(abs(v - threshold) for v in mates)
    return min(gaps)

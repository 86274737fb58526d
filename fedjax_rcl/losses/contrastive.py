"""Supervised and self-supervised contrastive losses: SCL, RCL (FedRCL) and NT-Xent (SimCLR).

Every loss here is a pure function of arrays: static shapes, masks instead of boolean indexing,
no Python branching on values, so it can be ``jit``-ed, ``vmap``-ed over clients and run inside
``lax.scan``. Features ``[B, ...]`` are pooled to ``[B, C]`` (mean over every axis between the
first and the last, i.e. global average pooling of NHWC maps) and L2-normalised with
``x / max(||x||, 1e-12)``; one ``[B, B]`` cosine-similarity matmul per call does the O(B^2 C)
work, everything after it is O(B^2).

Masked reductions never put ``inf`` or ``NaN`` in a branch that ``jnp.where`` discards (that
would poison the gradient); they use finite sentinels, and rows with nothing selected get a
finite value that the caller masks out.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

Array = jax.Array
# Features of one level: ``[B, C]`` or ``[B, ..., C]`` (e.g. NHWC maps, pooled over H, W).
Features = jax.Array
# Integer class labels ``[B]``.
Labels = jax.Array

_NORM_EPS = 1e-12
# Similarities lie in [-1, 1] (up to rounding); this sentinel is far outside, and finite.
_SIM_SENTINEL = 1e4
# Logit sentinel for masked log-sum-exp: finite in float32 and bfloat16.
_LOGIT_SENTINEL = 1e30
MININGS = ("hard", "none")
# Hard mining uses the ``min(2, B)`` hardest negatives (reference ``topk_neg: 2``).
_NUM_HARD_NEGATIVES = 2


# --------------------------------------------------------------------------------------------
# Shared helpers.
# --------------------------------------------------------------------------------------------


def pool_features(features: Features) -> Array:
    """Pools features ``[B, ..., C]`` to ``[B, C]`` by the mean over the middle axes.

    A 4-D NHWC map becomes its global average pool (the reference's ``adaptive_avg_pool2d``);
    ``[B, C]`` is returned as is. Low-precision inputs are promoted to at least float32.

    Args:
      features: ``[B, ..., C]`` with ``ndim >= 2``.

    Returns:
      ``[B, ..., C] -> [B, C]``.
    """
    features = jnp.asarray(features)
    if features.ndim < 2:
        raise ValueError(
            f"features must have shape [B, ..., C] (ndim >= 2), got shape {features.shape}; "
            "add a trailing channel axis for scalar features."
        )
    dtype = jnp.promote_types(features.dtype, jnp.float32)
    features = features.astype(dtype)
    if features.ndim > 2:
        features = jnp.mean(features, axis=tuple(range(1, features.ndim - 1)))
    return features


def l2_normalize(x: Array, *, eps: float = _NORM_EPS) -> Array:
    r"""Normalises the last axis: ``x / max(||x||, eps)``, with a finite gradient at ``x = 0``.

    .. math::
      \hat x = x / \max(\lVert x \rVert_2, \epsilon)

    Same as PyTorch's ``F.normalize`` (eps 1e-12). The norm is taken as
    ``sqrt(max(sum x^2, eps^2))``, equal in value, so that the gradient at a zero vector is
    ``1/eps`` times the incoming cotangent instead of ``NaN``.

    Args:
      x: ``[..., C]``.
      eps: the floor of the norm.

    Returns:
      ``[..., C] -> [..., C]``.
    """
    squared = jnp.sum(jnp.square(x), axis=-1, keepdims=True)
    return x / jnp.sqrt(jnp.maximum(squared, eps * eps))


def _normalized(features: Features) -> Array:
    return l2_normalize(pool_features(features))


def _cosine_matrix(unit: Array) -> Array:
    # Full float32 precision: the RCL gate compares similarities with a threshold and the
    # matmul is tiny next to the network (B^2 C per level), so TF32/bf16 passes are not worth it.
    return jnp.matmul(unit, unit.T, precision=jax.lax.Precision.HIGHEST)


def _masked_logsumexp(logits: Array, mask: Array) -> Array:
    """``log sum_{mask} exp(logits)`` over the last axis; finite junk on rows with no entry."""
    safe = jnp.where(mask, logits, -_LOGIT_SENTINEL)
    peak = jax.lax.stop_gradient(jnp.max(safe, axis=-1, keepdims=True))
    total = jnp.sum(jnp.where(mask, jnp.exp(safe - peak), 0.0), axis=-1)
    total = jnp.where(jnp.any(mask, axis=-1), total, 1.0)
    return jnp.log(total) + peak[..., 0]


def _masked_mean(values: Array, mask: Array) -> Array:
    """Mean of ``values`` where ``mask``; 0 when the mask is empty."""
    count = jnp.sum(mask)
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(count, 1).astype(values.dtype)


def _prepare(features: Features, labels: Labels) -> tuple[Array, Array, Array]:
    """Returns the cosine matrix ``[B, B]``, the same-label mask and the identity mask."""
    unit = _normalized(features)
    labels = jnp.asarray(labels)
    if labels.shape != unit.shape[:1]:
        raise ValueError(
            f"labels must have shape [B] = {unit.shape[:1]} to match features of shape "
            f"{jnp.shape(features)}, got {labels.shape}."
        )
    if unit.shape[0] == 0:
        raise ValueError("contrastive losses need a non-empty batch, got B = 0.")
    same = labels[:, None] == labels[None, :]
    eye = jnp.eye(unit.shape[0], dtype=bool)
    return _cosine_matrix(unit), same, eye


def _check_mining(mining: str) -> None:
    if mining not in MININGS:
        raise ValueError(f"mining must be one of {MININGS}, got {mining!r}.")


def _check_positive(name: str, value: float | Array) -> None:
    # Only concrete Python numbers can be checked here; traced values are the caller's to check.
    if isinstance(value, int | float) and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}.")


# --------------------------------------------------------------------------------------------
# SCL / RCL on a precomputed similarity matrix.
# --------------------------------------------------------------------------------------------


def _supcon_hard(sim: Array, same: Array, temperature: float | Array) -> Array:
    """Reference SCL: hardest positive vs the 2 hardest negatives, mean over all anchors."""
    batch = sim.shape[0]
    # Hardest positive; the set contains i itself, so it is never empty.
    positive = jnp.min(jnp.where(same, sim, _SIM_SENTINEL), axis=1)
    # Hardest other-class negatives; slots beyond the available negatives are masked out
    # (they contribute 0 to the denominator, as the reference's -inf logits do).
    other = ~same
    negatives, index = jax.lax.top_k(
        jnp.where(other, sim, -_SIM_SENTINEL), min(_NUM_HARD_NEGATIVES, batch)
    )
    valid = jnp.take_along_axis(other, index, axis=1)
    logits = jnp.concatenate([positive[:, None], negatives], axis=1) / temperature
    mask = jnp.concatenate([jnp.ones((batch, 1), bool), valid], axis=1)
    # With no valid negative the row is log(e^p / e^p) = 0 exactly, with zero gradient.
    per_anchor = _masked_logsumexp(logits, mask) - logits[:, 0]
    return jnp.mean(per_anchor)


def _supcon_none(sim: Array, same: Array, eye: Array, temperature: float | Array) -> Array:
    """Paper Eq. 2 (SupCon): every positive, denominator over every other sample."""
    positives = same & ~eye
    logits = sim / temperature
    log_prob = logits - _masked_logsumexp(logits, ~eye)[:, None]
    num_positives = jnp.sum(positives, axis=1)
    per_anchor = -jnp.sum(jnp.where(positives, log_prob, 0.0), axis=1) / jnp.maximum(
        num_positives, 1
    ).astype(logits.dtype)
    return _masked_mean(per_anchor, num_positives > 0)


def _penalty_hard(
    sim: Array, same: Array, eye: Array, temperature: float | Array, threshold: float | Array
) -> Array:
    """Reference RCL penalty: softplus((q_i - s_ii)/t) with the gated least-similar classmate."""
    classmates = same & ~eye
    least_similar = jnp.min(jnp.where(classmates, sim, _SIM_SENTINEL), axis=1)
    # The gate is a selection, not a quantity to differentiate: its decision carries no
    # gradient, while the selected similarity m_i does (as in the reference and Eq. 5).
    gate = jax.lax.stop_gradient(jnp.any(classmates, axis=1) & (least_similar >= threshold))
    q = jnp.where(gate, least_similar, -1.0)
    per_anchor = jax.nn.softplus((q - jnp.diagonal(sim)) / temperature)
    return jnp.mean(per_anchor)


def _penalty_none(
    sim: Array, same: Array, eye: Array, temperature: float | Array, threshold: float | Array
) -> Array:
    """Paper Eq. 5: log(1 + sum over classmates above the threshold of e^{(s_ik - 1)/t})."""
    classmates = same & ~eye
    active = jax.lax.stop_gradient(classmates & (sim > threshold))
    # (s - 1)/t <= ~0 for unit vectors, so the exponential never overflows in either branch.
    terms = jnp.where(active, jnp.exp((sim - 1.0) / temperature), 0.0)
    per_anchor = jnp.log1p(jnp.sum(terms, axis=1))
    return _masked_mean(per_anchor, jnp.any(classmates, axis=1))


def _rcl_terms(
    sim: Array,
    same: Array,
    eye: Array,
    *,
    temperature: float | Array,
    threshold: float | Array,
    mining: str,
    with_penalty: bool,
) -> tuple[Array, Array]:
    if mining == "hard":
        scl = _supcon_hard(sim, same, temperature)
        penalty = _penalty_hard(sim, same, eye, temperature, threshold) if with_penalty else None
    else:
        scl = _supcon_none(sim, same, eye, temperature)
        penalty = _penalty_none(sim, same, eye, temperature, threshold) if with_penalty else None
    if penalty is None:
        penalty = jnp.zeros((), scl.dtype)
    return scl, penalty


def _is_static_zero(value: float | Array) -> bool:
    return isinstance(value, int | float) and value == 0


# --------------------------------------------------------------------------------------------
# Public losses.
# --------------------------------------------------------------------------------------------


def supcon_loss(
    features: Features, labels: Labels, *, temperature: float | Array, mining: str = "hard"
) -> Array:
    r"""Supervised contrastive loss (SCL) of FedRCL, with the reference's hard mining by default.

    With cosine similarities :math:`s_{ij}` of the pooled, L2-normalised features:

    ``mining="hard"`` (reference, default): hardest positive and the two hardest negatives,

    .. math::
      p_i = \min_{j:\,y_j=y_i} s_{ij}, \qquad
      N_i = \operatorname{top}_{\min(2,B)}\{s_{ik} : y_k \ne y_i\}, \\
      \ell_i = -\log \frac{e^{p_i/\tau}}{e^{p_i/\tau} + \sum_{n\in N_i} e^{n/\tau}}, \qquad
      \mathcal L = \frac1B \sum_{i=1}^{B} \ell_i .

    The positive set contains i itself (so :math:`p_i = s_{ii}` without classmates); a missing
    negative slot contributes 0 to the denominator, so :math:`\ell_i = 0` when i has no
    other-class sample; the mean is over all B anchors.

    ``mining="none"`` (paper Eq. 2, SupCon):

    .. math::
      \ell_i = \frac{1}{|P_i|}\sum_{j\in P_i}
        -\log\frac{e^{s_{ij}/\tau}}{\sum_{k\ne i} e^{s_{ik}/\tau}}, \qquad
      P_i = \{j\ne i: y_j=y_i\},

    averaged over the anchors with :math:`P_i \ne \emptyset` (0 if there are none).

    Paper: Seo et al., "Relaxed Contrastive Learning for Federated Learning", CVPR 2024,
    https://arxiv.org/abs/2401.04928 (Eq. 2, after Khosla et al. https://arxiv.org/abs/2004.11362).
    The reference code (github.com/skynbe/FedRCL, ``CLLoss`` with ``topk_pos: 1``,
    ``topk_neg: 2``) does not implement Eq. 2: it keeps only the least-similar positive and the
    two most-similar negatives per anchor, and averages over all anchors; that version produced
    the paper's numbers and is the default here.

    Args:
      features: ``[B, ..., C]`` features of one level (pooled over the middle axes).
      labels: ``[B]`` integer labels.
      temperature: :math:`\tau > 0`.
      mining: ``"hard"`` (reference) or ``"none"`` (paper Eq. 2).

    Returns:
      ``[B, ..., C], [B] -> []`` the loss.
    """
    _check_mining(mining)
    _check_positive("temperature", temperature)
    sim, same, eye = _prepare(features, labels)
    if mining == "hard":
        return _supcon_hard(sim, same, temperature)
    return _supcon_none(sim, same, eye, temperature)


def rcl_loss_terms(
    features: Features,
    labels: Labels,
    *,
    temperature: float | Array = 0.05,
    threshold: float | Array = 0.7,
    mining: str = "hard",
) -> tuple[Array, Array]:
    r"""The two terms of :func:`rcl_loss`, ``(supcon, penalty)``, from one similarity matmul.

    ``rcl_loss(...) == supcon + beta * penalty``; useful to log each term.

    Args:
      features: ``[B, ..., C]`` features of one level.
      labels: ``[B]`` integer labels.
      temperature: :math:`\tau > 0`.
      threshold: the similarity threshold of the penalty.
      mining: ``"hard"`` (reference) or ``"none"`` (paper Eqs. 2 and 5).

    Returns:
      ``[B, ..., C], [B] -> ([], [])`` the SCL term and the (unweighted) penalty.
    """
    _check_mining(mining)
    _check_positive("temperature", temperature)
    sim, same, eye = _prepare(features, labels)
    return _rcl_terms(
        sim,
        same,
        eye,
        temperature=temperature,
        threshold=threshold,
        mining=mining,
        with_penalty=True,
    )


def rcl_loss(
    features: Features,
    labels: Labels,
    *,
    temperature: float | Array = 0.05,
    threshold: float | Array = 0.7,
    beta: float | Array = 1.0,
    mining: str = "hard",
) -> Array:
    r"""Relaxed contrastive loss: SCL plus a penalty on too-similar same-class pairs.

    :math:`\mathcal L_{RCL} = \mathcal L_{SCL} + \beta\,\mathcal P`, with
    :math:`\mathcal L_{SCL}` = :func:`supcon_loss` (same ``mining``) and, with
    :math:`s_{ij}` the cosine similarities and :math:`\delta` the threshold:

    ``mining="hard"`` (reference, default):

    .. math::
      m_i = \min_{j\ne i,\,y_j=y_i} s_{ij}, \qquad
      q_i = \begin{cases} m_i & \text{if } i \text{ has a classmate and } m_i \ge \delta \\
        -1 & \text{otherwise} \end{cases}, \\
      \mathcal P = \frac1B \sum_{i=1}^{B} \log\bigl(1 + e^{(q_i - s_{ii})/\tau}\bigr).

    The gate (the case split) is under ``stop_gradient``; the gradient flows through the
    selected :math:`m_i`.

    ``mining="none"`` (paper Eq. 5):

    .. math::
      \mathcal P_i = \log\Bigl(1 + \sum_{k\ne i,\,y_k=y_i,\,s_{ik}>\delta}
        e^{(s_{ik}-1)/\tau}\Bigr),

    averaged over the anchors with at least one classmate (0 if there are none).

    Paper: Seo et al., CVPR 2024, https://arxiv.org/abs/2401.04928 (Eq. 5). The reference code
    (``CLLoss`` pair ``penalty``: ``loss_type: unsupervised``, ``neg_sample_type:
    intra_class_thresholding``, ``threshold: 0.7``, ``temp: 0.05``, weight 1) differs from
    Eq. 5: it takes only the least-similar classmate, so it penalises an anchor only when all
    its classmates are above the threshold; its positive logit is :math:`s_{ii}` (about 1) and
    the penalty is a two-way softmax, averaged over all anchors. It is the default here.

    Args:
      features: ``[B, ..., C]`` features of one level (pooled over the middle axes).
      labels: ``[B]`` integer labels.
      temperature: :math:`\tau > 0` (reference 0.05), shared by both terms.
      threshold: :math:`\delta` (reference 0.7).
      beta: weight of the penalty (reference 1; 0 gives FedSCL and skips the penalty).
      mining: ``"hard"`` (reference) or ``"none"`` (paper Eqs. 2 and 5).

    Returns:
      ``[B, ..., C], [B] -> []`` the loss.
    """
    _check_mining(mining)
    _check_positive("temperature", temperature)
    sim, same, eye = _prepare(features, labels)
    with_penalty = not _is_static_zero(beta)
    scl, penalty = _rcl_terms(
        sim,
        same,
        eye,
        temperature=temperature,
        threshold=threshold,
        mining=mining,
        with_penalty=with_penalty,
    )
    return scl + beta * penalty if with_penalty else scl


def multilevel_rcl_loss(
    features_per_level: Sequence[Features],
    labels: Labels,
    *,
    temperature: float | Array = 0.05,
    threshold: float | Array = 0.7,
    beta: float | Array = 1.0,
    mining: str = "hard",
) -> Array:
    r"""Mean over feature levels of :func:`rcl_loss` (FedRCL's multi-level objective).

    .. math::
      \mathcal L = \frac1L \sum_{l=1}^{L} \mathcal L_{RCL}(f^{(l)}, y)

    FedRCL applies it to the stem output and the four stage outputs of ResNet-18, taken before
    the ReLU; the local objective is cross-entropy plus this loss.

    Paper: Seo et al., CVPR 2024, https://arxiv.org/abs/2401.04928 (Sec. 4, multi-level). The
    reference (``RCLClient._algorithm_rcl``, ``branch_level: [0,1,2,3,4]``) averages the SCL
    and penalty terms separately over levels and adds them with weight 1 each, which is the same
    number for ``beta=1``.

    Args:
      features_per_level: a sequence of L arrays ``[B, ..., C_l]`` (shapes may differ).
      labels: ``[B]`` integer labels.
      temperature: as in :func:`rcl_loss`.
      threshold: as in :func:`rcl_loss`.
      beta: as in :func:`rcl_loss`.
      mining: as in :func:`rcl_loss`.

    Returns:
      ``L x [B, ..., C_l], [B] -> []`` the loss.
    """
    features_per_level = tuple(features_per_level)
    if not features_per_level:
        raise ValueError("features_per_level must hold at least one level, got none.")
    losses = [
        rcl_loss(
            level, labels, temperature=temperature, threshold=threshold, beta=beta, mining=mining
        )
        for level in features_per_level
    ]
    return jnp.mean(jnp.stack(losses))


def nt_xent_loss(z1: Features, z2: Features, *, temperature: float | Array) -> Array:
    r"""NT-Xent (normalised temperature-scaled cross-entropy) over K pairs of views.

    With :math:`z = [z^{(1)}; z^{(2)}]` the 2K pooled, L2-normalised views, cosine
    similarities :math:`s_{ij}` and :math:`t(i) = (i + K) \bmod 2K` the twin view of i:

    .. math::
      \mathcal L = \frac{1}{2K} \sum_{i=1}^{2K}
        -\log \frac{e^{s_{i,t(i)}/\tau}}{\sum_{k\ne i} e^{s_{ik}/\tau}} .

    Paper: Chen et al., "A Simple Framework for Contrastive Learning of Visual
    Representations" (SimCLR), https://arxiv.org/abs/2002.05709 (Eq. 1); MFCL (Motamedi & Kim,
    "Modular Federated Contrastive Learning with Twin Normalization for Resource-limited
    Clients", TMLR) trains the server model with it (Eq. 7). Same as SimCLR's; every other view,
    the other sample's twin included, is a negative.

    Args:
      z1: ``[K, ..., C]`` first views (pooled over the middle axes).
      z2: ``[K, ..., C]`` second views, row i the twin of ``z1`` row i.
      temperature: :math:`\tau > 0`.

    Returns:
      ``[K, ..., C], [K, ..., C] -> []`` the loss.
    """
    _check_positive("temperature", temperature)
    if jnp.shape(z1) != jnp.shape(z2):
        raise ValueError(
            f"z1 and z2 must have the same shape (view pairs), got {jnp.shape(z1)} and "
            f"{jnp.shape(z2)}."
        )
    views = jnp.concatenate([_normalized(z1), _normalized(z2)], axis=0)
    num_views = views.shape[0]
    if num_views == 0:
        raise ValueError("nt_xent_loss needs at least one pair of views, got K = 0.")
    logits = _cosine_matrix(views) / temperature
    twin = (jnp.arange(num_views) + num_views // 2) % num_views
    positive = jnp.take_along_axis(logits, twin[:, None], axis=1)[:, 0]
    others = ~jnp.eye(num_views, dtype=bool)
    return jnp.mean(_masked_logsumexp(logits, others) - positive)

"""Pure losses of the FedRCL paper's client baselines (FedLC, FedNTD, FedDecorr, FitNet,
FedProc). Each is jit/vmap/grad-friendly: static shapes, no NaN gradients in the edge cases
(a class a client lacks, a batch of one class, a batch of one sample, a constant feature).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from fedjax_rcl.losses.contrastive import l2_normalize, pool_features


def logit_calibrated_cross_entropy(logits: jax.Array, labels: jax.Array,
                                   class_counts: jax.Array, *, tau: float = 1.0) -> jax.Array:
    """FedLC's calibrated cross-entropy.

    Zhang, Li, Li, Xu, Wu, "Federated Learning with Label Distribution Skew via Logits
    Calibration", ICML 2022 (arXiv 2209.00189).

    .. math::
        \\ell = \\frac{1}{B}\\sum_i -\\log \\frac{e^{z_{i,y_i} - \\tau n_{y_i}^{-1/4}}}
          {\\sum_{c: n_c > 0} e^{z_{ic} - \\tau n_c^{-1/4}}}

    The denominator runs over every class the client holds, the true one included, as the
    public implementations do (the paper's printed equation sums over ``c != y``). A class
    with ``n_c = 0`` leaves the softmax (its calibrated logit is -inf); labels always have
    ``n_y > 0`` since they come from the client's own data.

    Args:
      logits: ``[B, K]``.
      labels: ``int [B]``.
      class_counts: ``[K]``, the client's samples per class.
      tau: calibration strength.
    """
    counts = jnp.asarray(class_counts).astype(logits.dtype)
    held = counts > 0
    shift = tau * jnp.where(held, jnp.maximum(counts, 1.0), 1.0) ** -0.25
    z = jnp.where(held, logits - shift, -jnp.inf)
    log_p = jax.nn.log_softmax(z, axis=-1)
    picked = jnp.take_along_axis(log_p, labels[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return -jnp.mean(picked)


def _without_true_class(x: jax.Array, labels: jax.Array) -> jax.Array:
    """``[B, K] -> [B, K-1]``: each row without its label's column (static shapes)."""
    k = x.shape[-1]
    others = jnp.arange(k - 1)[None, :]
    idx = others + (others >= labels[:, None]).astype(jnp.int32)
    return jnp.take_along_axis(x, idx, axis=-1)


def not_true_distillation(logits: jax.Array, global_logits: jax.Array, labels: jax.Array, *,
                          tau: float = 1.0) -> jax.Array:
    """FedNTD's not-true distillation term.

    Lee, Jeong, Shin, Yun, "Preservation of the Global Knowledge by Not-True Distillation in
    Federated Learning", NeurIPS 2022 (arXiv 2106.03097).

    .. math::
        \\tau^2 \\frac{1}{B}\\sum_i \\mathrm{KL}\\big(\\operatorname{softmax}(\\tilde z^g_i/\\tau)
          \\,\\|\\, \\operatorname{softmax}(\\tilde z_i/\\tau)\\big)

    with ``z~`` the logits without the true class's column (``[B, K-1]``), the global model's
    treated as constants. The ``tau^2`` factor and the batch mean follow the authors' code
    (``KLDivLoss(reduction="batchmean")``).
    """
    local = _without_true_class(logits, labels) / tau
    glob = _without_true_class(jax.lax.stop_gradient(global_logits), labels) / tau
    log_q = jax.nn.log_softmax(glob, axis=-1)
    log_p = jax.nn.log_softmax(local, axis=-1)
    kl = jnp.sum(jnp.exp(log_q) * (log_q - log_p), axis=-1)
    return tau**2 * jnp.mean(kl)


def decorrelation_loss(features: jax.Array, *, eps: float = 1e-8) -> jax.Array:
    """FedDecorr's regulariser: squared correlations between representation dimensions.

    Shi, Liang, Zhang, Tan, Bai, "Towards Understanding and Mitigating Dimensional Collapse in
    Heterogeneous Federated Learning", ICLR 2023 (arXiv 2210.00226).

    .. math::
        Z_{:,a} = \\frac{X_{:,a} - \\bar X_{:,a}}{\\sqrt{\\epsilon + \\operatorname{var}(X_{:,a})}},
        \\quad K = Z^\\top Z, \\quad
        \\ell = \\frac{1}{N}\\operatorname{mean}_{a \\ne b} K_{ab}^2

    with the unbiased variance over the batch of ``N`` and ``eps = 1e-8`` (as the authors'
    code, github.com/Yujun-Shi/FedCLS); 0 when ``N = 1``. ``features`` ``[N, C]`` (4-D
    inputs are pooled by spatial mean).
    """
    x = pool_features(features)
    n, c = x.shape
    if n == 1 or c == 1:
        return jnp.zeros((), x.dtype)
    x = x - jnp.mean(x, axis=0, keepdims=True)
    var = jnp.sum(x * x, axis=0, keepdims=True) / (n - 1)
    z = x / jnp.sqrt(eps + var)
    k = z.T @ z
    off = k * (1.0 - jnp.eye(c, dtype=k.dtype))
    return jnp.sum(off * off) / (c * (c - 1)) / n


def feature_hint_loss(features: Sequence[jax.Array],
                      global_features: Sequence[jax.Array]) -> jax.Array:
    """FitNet's hint toward a frozen model's features, averaged over levels.

    Romero et al., "FitNets: Hints for Thin Deep Nets", ICLR 2015 (arXiv 1412.6550).

    .. math::
        \\frac{1}{L}\\sum_l \\operatorname{mean}\\big(f^{(l)} - f^{(l)}_g\\big)^2

    with the global features treated as constants.
    """
    if len(features) != len(global_features) or not features:
        raise ValueError(f"feature_hint_loss: {len(features)} levels vs "
                         f"{len(global_features)} global levels (need the same, >= 1)")
    terms = [jnp.mean(jnp.square(f - jax.lax.stop_gradient(g)))
             for f, g in zip(features, global_features, strict=True)]
    return jnp.mean(jnp.stack(terms))


def prototype_contrastive_loss(features: jax.Array, labels: jax.Array, prototypes: jax.Array,
                               present: jax.Array, *, temperature: float = 0.5) -> jax.Array:
    """FedProc's prototypical contrastive loss against global class prototypes.

    Mu et al., "FedProc: Prototypical Contrastive Federated Learning on Non-IID data"
    (arXiv 2109.12273).

    .. math::
        \\ell = \\operatorname{mean}_{i: y_i \\in P} -\\log
          \\frac{e^{\\cos(f_i, c_{y_i})/t}}{\\sum_{c \\in P} e^{\\cos(f_i, c)/t}}

    over the anchors whose class has a prototype (``P``: ``present``), 0 if none.

    Args:
      features: ``[B, D]`` (4-D pooled by spatial mean).
      labels: ``int [B]``.
      prototypes: ``[K, D]``, constants.
      present: ``[K]`` bool (or 0/1): which classes have a prototype.
      temperature: ``t``.
    """
    f = l2_normalize(pool_features(features))
    c = l2_normalize(jax.lax.stop_gradient(prototypes).astype(f.dtype))
    present = jnp.asarray(present).astype(bool)
    s = (f @ c.T) / temperature
    log_p = jax.nn.log_softmax(jnp.where(present[None, :], s, -jnp.inf), axis=-1)
    labels = labels.astype(jnp.int32)
    own = present[labels]
    picked = jnp.take_along_axis(log_p, labels[:, None], axis=-1)[:, 0]
    picked = jnp.where(own, picked, 0.0)
    return -jnp.sum(picked) / jnp.maximum(jnp.sum(own), 1)


def class_prototypes(features: jax.Array, labels: jax.Array,
                     num_classes: int) -> tuple[jax.Array, jax.Array]:
    """Per-class sums of the (pooled, unnormalised) features and per-class counts:
    ``([K, D], [K])``, to be summed over batches and clients and divided at the end."""
    f = pool_features(features)
    onehot = jax.nn.one_hot(labels, num_classes, dtype=f.dtype)
    return onehot.T @ f, jnp.sum(onehot, axis=0)


def prototypes_from_sums(sums: jax.Array, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(prototypes [K, D], present [K])``: class means where a class was seen, else 0."""
    present = counts > 0
    protos = sums / jnp.where(present, counts, 1.0)[:, None]
    return jnp.where(present[:, None], protos, 0.0), present


def hybrid_path_losses(logits: jax.Array, hybrid_logits: Sequence[jax.Array], labels: jax.Array,
                       *, tau: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """FedMLB's two regularisers over its hybrid pathways: their cross-entropy and their
    distillation into the main pathway, each averaged over the ``M`` pathways.

    Kim, Kim, Han, "Multi-Level Branched Regularization for Federated Learning", ICML 2022
    (arXiv 2207.06936).

    .. math::
        \\ell_{CE} = \\frac{1}{M}\\sum_m \\frac{1}{B}\\sum_i -\\log
          \\operatorname{softmax}(z^{(m)}_i)_{y_i}, \\qquad
        \\ell_{KL} = \\frac{1}{M}\\sum_m \\frac{1}{B}\\sum_i
          \\mathrm{KL}\\big(\\operatorname{softmax}(z^{(m)}_i/\\tau) \\,\\|\\,
          \\operatorname{softmax}(z_i/\\tau)\\big)

    ``z`` the main pathway's logits, ``z^(m)`` pathway ``m``'s (the local blocks up to ``m``,
    the global model's after). As the authors' code, the gradient flows through both sides of
    the KL (the hybrid pathway is not a fixed teacher) and there is no ``tau^2`` factor.

    Args:
      logits: ``[B, K]``, the main pathway.
      hybrid_logits: ``M >= 1`` arrays ``[B, K]``.
      labels: ``int [B]``.
      tau: the distillation temperature.

    Returns:
      ``(l_CE, l_KL)``, scalars.
    """
    if not hybrid_logits:
        raise ValueError("hybrid_path_losses: needs at least one hybrid pathway")
    labels = labels.astype(jnp.int32)[:, None]
    log_q = jax.nn.log_softmax(logits / tau, axis=-1)
    ces, kls = [], []
    for z in hybrid_logits:
        ces.append(-jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), labels,
                                                 axis=-1)))
        log_p = jax.nn.log_softmax(z / tau, axis=-1)
        kls.append(jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)))
    return jnp.mean(jnp.stack(ces)), jnp.mean(jnp.stack(kls))

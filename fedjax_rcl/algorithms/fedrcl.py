"""FedRCL's client (and FedSCL, its beta = 0 ablation): cross-entropy plus the relaxed
supervised contrastive loss on every feature level.

Seo, Kim, Kim, Han, "Relaxed Contrastive Learning for Federated Learning", CVPR 2024
(arXiv 2401.04928).

.. math::
    \\ell(w) = \\ell_{CE}(w) + \\frac{1}{L} \\sum_{l=1}^{L}
      \\big(\\mathcal L_{SCL}(f^{(l)}_w, y) + \\beta\\, \\mathcal P(f^{(l)}_w, y)\\big)

over the model's levels (ResNet-18: the stem output and the four stage outputs, pre-ReLU). The
loss is ``fedjax_rcl.losses`` (``mining="hard"``: the authors' released code, which produced the
paper's numbers; ``"none"``: the paper's Eq. 2 and 5). Unlike the reference, no frozen
global-model forward is run: its default loss never uses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.engine.algorithm import ClientAlgorithm
from fedjax_rcl.losses import rcl_loss_terms, supcon_loss
from fedjax_rcl.losses.contrastive import MININGS
from fedjax_rcl.validation import check_levels, finite, one_of


def select_levels(features: Sequence, levels: Sequence[int] | None) -> tuple:
    """The chosen feature levels (``None``: all; negative indices count from the last)."""
    return tuple(features) if levels is None else tuple(features[i] for i in levels)


@dataclasses.dataclass
class FedRCLConfig:
    """``algorithm=fedrcl`` and ``fedscl`` (which forces beta = 0); the authors' defaults.

    Attributes:
      temperature: tau of the contrastive and penalty terms.
      threshold: the cosine similarity above which same-class pairs are penalised.
      beta: the weight of the relaxation penalty (0 is FedSCL).
      mining: ``hard`` is the authors' released loss (hardest positive, two hardest
        negatives); ``none`` the paper's Eq. 2 and 5.
      levels: the feature levels the loss applies to; null: every level, ``[-1]``: the last
        (the paper's ablation).
    """

    temperature: float = 0.05
    threshold: float = 0.7
    beta: float = 1.0
    mining: str = "hard"
    levels: list[int] | None = None

    def check(self, ctx) -> list[str]:
        p = []
        if not (finite(self.temperature) and self.temperature > 0):
            p.append(f"temperature={self.temperature!r}: must be > 0")
        if not (finite(self.threshold) and -1 <= self.threshold <= 1):
            p.append(f"threshold={self.threshold!r}: must be a cosine similarity in [-1, 1]")
        if not (finite(self.beta) and self.beta >= 0):
            p.append(f"beta={self.beta!r}: must be >= 0")
        one_of(p, "mining", self.mining, MININGS)
        return p + check_levels(self.levels, ctx)


def fedrcl(settings: FedRCLConfig | None = None) -> ClientAlgorithm:
    """FedRCL's local objective with the section's settings (None: the authors' defaults); a
    ``beta`` of 0 is FedSCL and skips the penalty entirely."""
    s = settings or FedRCLConfig()
    temperature, threshold, beta, mining = s.temperature, s.threshold, s.beta, s.mining
    levels = None if s.levels is None else tuple(s.levels)

    def objective(out, params, batch, ctx):
        del params, ctx
        feats = select_levels(out.features, levels)
        ce = cross_entropy(out.logits, batch.labels)
        # FedSCL: build only the terms that count (a traced beta, a grid's sweep, keeps all).
        if isinstance(beta, (int, float)) and beta == 0:
            scl = jnp.mean(jnp.stack([
                supcon_loss(f, batch.labels, temperature=temperature, mining=mining)
                for f in feats
            ]))
            return ce + scl, {"ce": ce, "scl": scl}
        terms = [rcl_loss_terms(f, batch.labels, temperature=temperature, threshold=threshold,
                                mining=mining) for f in feats]
        scl = jnp.mean(jnp.stack([t[0] for t in terms]))
        penalty = jnp.mean(jnp.stack([t[1] for t in terms]))
        return ce + scl + beta * penalty, {"ce": ce, "scl": scl, "penalty": penalty}

    return ClientAlgorithm(objective)


def fedscl(settings: FedRCLConfig | None = None) -> ClientAlgorithm:
    """FedSCL: FedRCL without the penalty (beta = 0, whatever the section's), the paper's
    ablation."""
    return fedrcl(dataclasses.replace(settings or FedRCLConfig(), beta=0.0))


registry.register_algorithm("fedrcl", lambda s, model: fedrcl(s), config=FedRCLConfig)
registry.register_algorithm("fedscl", lambda s, model: fedscl(s), section="fedrcl")

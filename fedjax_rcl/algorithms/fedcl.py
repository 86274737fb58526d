"""FedCL (FedRCL's ablation, paper Table 3): cross-entropy plus InfoNCE between two augmented
views of each sample, on every feature level.

.. math::
    \\ell(w) = \\ell_{CE}(w) + \\frac{1}{L} \\sum_{l=1}^{L}
      \\mathcal L_{NT\\text{-}Xent}(f^{(l)}_w(x'), f^{(l)}_w(x''))

The sample's second view is its only positive; every other view in the batch is a negative
(SimCLR, arXiv 2002.05709). Cross-entropy is taken on both views.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.algorithms.fedrcl import select_levels
from fedjax_rcl.engine.algorithm import ClientAlgorithm
from fedjax_rcl.losses import nt_xent_loss
from fedjax_rcl.validation import check_levels, finite


@dataclasses.dataclass
class FedCLConfig:
    """``algorithm=fedcl``: InfoNCE between two views of each sample (FedRCL's ablation).

    Attributes:
      temperature: tau of the InfoNCE term.
      levels: the feature levels it applies to; null: every level, ``[-1]``: the last.
    """

    temperature: float = 0.05
    levels: list[int] | None = None

    def check(self, ctx) -> list[str]:
        p = []
        if not (finite(self.temperature) and self.temperature > 0):
            p.append(f"temperature={self.temperature!r}: must be > 0")
        return p + check_levels(self.levels, ctx)


def fedcl(settings: FedCLConfig | None = None) -> ClientAlgorithm:
    """FedCL's local objective on two views per sample, with the section's settings (None:
    the defaults)."""
    s = settings or FedCLConfig()
    temperature, levels = s.temperature, None if s.levels is None else tuple(s.levels)

    def objective(out, params, batch, ctx):
        del params, ctx
        b = batch.labels.shape[0]
        ce = cross_entropy(out.logits, batch.labels)
        cl = jnp.mean(jnp.stack([
            nt_xent_loss(f[:b], f[b:], temperature=temperature)
            for f in select_levels(out.features, levels)
        ]))
        return ce + cl, {"ce": ce, "nt_xent": cl}

    return ClientAlgorithm(objective)


registry.register_algorithm(
    "fedcl", lambda s, model: fedcl(s),
    config=FedCLConfig, num_views=2)

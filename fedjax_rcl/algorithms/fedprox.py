"""FedProx's client: cross-entropy plus a proximal term to the round's global model.

Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020 (arXiv 1812.06127).

.. math::
    \\ell(w) = \\ell_{CE}(w) + \\frac{\\mu}{2} \\lVert w - w_g \\rVert_2^2

FedRCL's tables use mu = 0.001 (paper App. E).
"""

from __future__ import annotations

import dataclasses

from optax import tree_utils as otu

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.engine.algorithm import ClientAlgorithm
from fedjax_rcl.validation import finite


@dataclasses.dataclass
class FedProxConfig:
    """``algorithm=fedprox``.

    Attributes:
      mu: the weight of the proximal term ``mu/2 ||w - w_global||^2`` (FedRCL's tables: 0.001).
    """

    mu: float = 0.001

    def check(self, ctx) -> list[str]:
        return [] if finite(self.mu) and self.mu >= 0 else [f"mu={self.mu!r}: must be >= 0"]


def fedprox(settings: FedProxConfig | None = None) -> ClientAlgorithm:
    """FedProx's local objective with the section's proximal weight (None: the defaults)."""
    mu = (settings or FedProxConfig()).mu

    def objective(out, params, batch, ctx):
        ce = cross_entropy(out.logits, batch.labels)
        prox = otu.tree_norm(otu.tree_sub(params, ctx.global_params), squared=True)
        return ce + 0.5 * mu * prox, {"ce": ce, "prox": prox}

    return ClientAlgorithm(objective)


registry.register_algorithm("fedprox", lambda s, model: fedprox(s), config=FedProxConfig)

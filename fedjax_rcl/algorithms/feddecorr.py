"""FedDecorr's client: cross-entropy plus a penalty on correlated representation dimensions.

Shi, Liang, Zhang, Tan, Bai, "Towards Understanding and Mitigating Dimensional Collapse in
Heterogeneous Federated Learning", ICLR 2023 (arXiv 2210.00226).

.. math::
    \\ell(w) = \\ell_{CE}(w) + \\beta \\frac{1}{N} \\operatorname{mean}_{a \\ne b} K_{ab}^2,
    \\qquad K = Z^\\top Z

with ``Z`` the batch's representations (the embedding the classifier reads) standardised per
dimension over the batch. Heterogeneous clients collapse their representations onto few
dimensions; decorrelating them keeps the rank up. FedRCL's tables use beta = 0.01.
"""

from __future__ import annotations

import dataclasses

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.engine.algorithm import ClientAlgorithm
from fedjax_rcl.losses.baselines import decorrelation_loss
from fedjax_rcl.validation import finite


@dataclasses.dataclass
class FedDecorrConfig:
    """``algorithm=feddecorr``.

    Attributes:
      beta: the weight of the decorrelation regulariser (FedRCL's tables: 0.01).
    """

    beta: float = 0.01

    def check(self, ctx) -> list[str]:
        del ctx
        ok = finite(self.beta) and self.beta >= 0
        return [] if ok else [f"beta={self.beta!r}: must be >= 0"]


def feddecorr(settings: FedDecorrConfig | None = None) -> ClientAlgorithm:
    """FedDecorr's local objective with the section's weight (None: the defaults)."""
    beta = (settings or FedDecorrConfig()).beta

    def objective(out, params, batch, ctx):
        del params, ctx
        ce = cross_entropy(out.logits, batch.labels)
        decorr = decorrelation_loss(out.embedding)
        return ce + beta * decorr, {"ce": ce, "decorr": decorr}

    return ClientAlgorithm(objective)


registry.register_algorithm("feddecorr", lambda s, model: feddecorr(s),
                            config=FedDecorrConfig)

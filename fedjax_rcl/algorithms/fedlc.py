"""FedLC's client: cross-entropy on logits calibrated by the client's label counts.

Zhang, Li, Li, Xu, Wu, "Federated Learning with Label Distribution Skew via Logits
Calibration", ICML 2022 (arXiv 2209.00189).

.. math::
    \\ell(w) = \\frac{1}{B} \\sum_i -\\log
      \\frac{e^{f_{y_i}(x_i) - \\tau n_{y_i}^{-1/4}}}{\\sum_c e^{f_c(x_i) - \\tau n_c^{-1/4}}}

with ``n_c`` this client's number of samples of class ``c`` (the engine's
``LocalContext.label_counts``; a class the client lacks leaves the softmax). Rare classes get
their logits pushed down during training, so the client's model is not pulled toward its
frequent classes. FedRCL's tables use tau = 1 (paper App. E).
"""

from __future__ import annotations

import dataclasses

from fedjax_rcl import registry
from fedjax_rcl.engine.algorithm import ClientAlgorithm
from fedjax_rcl.losses.baselines import logit_calibrated_cross_entropy
from fedjax_rcl.validation import finite


@dataclasses.dataclass
class FedLCConfig:
    """``algorithm=fedlc``.

    Attributes:
      tau: the strength of the label-count calibration of the logits (FedRCL's tables: 1).
    """

    tau: float = 1.0

    def check(self, ctx) -> list[str]:
        del ctx
        return [] if finite(self.tau) and self.tau >= 0 else [f"tau={self.tau!r}: must be >= 0"]


def fedlc(settings: FedLCConfig | None = None) -> ClientAlgorithm:
    """FedLC's local objective with the section's calibration strength (None: the
    defaults)."""
    tau = (settings or FedLCConfig()).tau

    def objective(out, params, batch, ctx):
        del params
        loss = logit_calibrated_cross_entropy(out.logits, batch.labels, ctx.label_counts,
                                              tau=tau)
        return loss, {"calibrated_ce": loss}

    return ClientAlgorithm(objective)


registry.register_algorithm("fedlc", lambda s, model: fedlc(s), config=FedLCConfig)

"""FedNTD's client: cross-entropy plus distillation from the global model on the classes that
are not the sample's own.

Lee, Jeong, Shin, Yun, "Preservation of the Global Knowledge by Not-True Distillation in
Federated Learning", NeurIPS 2022 (arXiv 2106.03097).

.. math::
    \\ell(w) = \\ell_{CE}(w) + \\beta\\, \\tau^2 \\frac{1}{B} \\sum_i
      \\mathrm{KL}\\big(\\tilde q^{\\tau}_{w_g}(x_i) \\,\\|\\, \\tilde q^{\\tau}_w(x_i)\\big)

where ``q~`` is the softmax at temperature ``tau`` over the logits with the true class's
removed. Local training forgets the global model's knowledge outside the client's labels;
keeping the not-true predictions close to the global model's preserves it without fighting
the local cross-entropy on the true class. The global model runs in evaluation mode without
gradient. FedRCL's tables use beta = 0.3, tau = 1 (paper App. E).
"""

from __future__ import annotations

import dataclasses

import jax

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.engine.algorithm import ClientAlgorithm
from fedjax_rcl.losses.baselines import not_true_distillation
from fedjax_rcl.models.base import ModelFns
from fedjax_rcl.validation import finite


@dataclasses.dataclass
class FedNTDConfig:
    """``algorithm=fedntd`` (FedRCL's tables: 0.3, 1).

    Attributes:
      beta: the weight of the not-true distillation from the global model.
      tau: its temperature.
    """

    beta: float = 0.3
    tau: float = 1.0

    def check(self, ctx) -> list[str]:
        del ctx
        p = []
        if not (finite(self.beta) and self.beta >= 0):
            p.append(f"beta={self.beta!r}: must be >= 0")
        if not (finite(self.tau) and self.tau > 0):
            p.append(f"tau={self.tau!r}: must be > 0")
        return p


def fedntd(model: ModelFns, settings: FedNTDConfig | None = None) -> ClientAlgorithm:
    """FedNTD's local objective with the section's weight ``beta`` and temperature ``tau``
    (None: the defaults)."""
    s = settings or FedNTDConfig()
    beta, tau = s.beta, s.tau

    def objective(out, params, batch, ctx):
        del params
        ce = cross_entropy(out.logits, batch.labels)
        glob, _ = model.apply(ctx.global_params, ctx.global_model_state, batch.images,
                              train=False)
        ntd = not_true_distillation(out.logits, jax.lax.stop_gradient(glob.logits),
                                    batch.labels, tau=tau)
        return ce + beta * ntd, {"ce": ce, "ntd": ntd}

    return ClientAlgorithm(objective)


registry.register_algorithm("fedntd", lambda s, model: fedntd(model, s),
                            config=FedNTDConfig)

"""FedAvg + FitNet: cross-entropy plus a hint pulling the local features toward the frozen
global model's.

Romero et al., "FitNets: Hints for Thin Deep Nets", ICLR 2015 (arXiv 1412.6550), used as a
federated baseline in FedMLB (Kim, Kim, Han, ICML 2022) and FedRCL's tables.

.. math::
    \\ell(w) = \\ell_{CE}(w) + \\lambda \\frac{1}{L} \\sum_{l=1}^{L}
      \\operatorname{mean}\\big(f^{(l)}_w(x) - f^{(l)}_{w_g}(x)\\big)^2

over the model's feature levels (FedRCL's levels: stem and stage outputs, pre-ReLU). The levels
here are spatially mean-pooled (``ModelOutput.features``), where the original hints compare
whole feature maps: the pooled hint is the weaker constraint. The global model runs in
evaluation mode without gradient. FedRCL's tables use lambda = 0.001.
"""

from __future__ import annotations

import dataclasses

import jax

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.engine.algorithm import ClientAlgorithm
from fedjax_rcl.losses.baselines import feature_hint_loss
from fedjax_rcl.models.base import ModelFns
from fedjax_rcl.validation import finite


@dataclasses.dataclass
class FitNetConfig:
    """``algorithm=fitnet``.

    Attributes:
      weight: the weight of the hint loss to the frozen global model's levels (FedRCL's
        tables: 0.001).
    """

    weight: float = 0.001

    def check(self, ctx) -> list[str]:
        del ctx
        ok = finite(self.weight) and self.weight >= 0
        return [] if ok else [f"weight={self.weight!r}: must be >= 0"]


def fitnet(model: ModelFns, settings: FitNetConfig | None = None) -> ClientAlgorithm:
    """FedAvg + FitNet's local objective with the section's hint weight (lambda; None: the
    defaults)."""
    weight = (settings or FitNetConfig()).weight

    def objective(out, params, batch, ctx):
        del params
        ce = cross_entropy(out.logits, batch.labels)
        glob, _ = model.apply(ctx.global_params, ctx.global_model_state, batch.images,
                              train=False)
        hint = feature_hint_loss(out.features, jax.lax.stop_gradient(glob.features))
        return ce + weight * hint, {"ce": ce, "hint": hint}

    return ClientAlgorithm(objective)


registry.register_algorithm("fitnet", lambda s, model: fitnet(model, s), config=FitNetConfig)

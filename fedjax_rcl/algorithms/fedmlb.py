"""FedMLB's client: cross-entropy plus hybrid pathways through the frozen global model's blocks.

Kim, Kim, Han, "Multi-Level Branched Regularization for Federated Learning", ICML 2022
(arXiv 2207.06936).

The model is cut into ``M`` blocks (ResNet: the stem and the four stages; the CNN: its two conv
blocks and two hidden dense layers). Hybrid pathway ``m`` runs the local model's blocks
``1..m`` and then the global model's blocks ``m+1..M`` and classifier, ``z^(m)``:

.. math::
    \\ell(w) = \\ell_{CE}(z, y) + \\lambda_1 \\frac{1}{M}\\sum_m \\ell_{CE}(z^{(m)}, y)
      + \\lambda_2 \\frac{1}{M}\\sum_m \\mathrm{KL}\\big(\\sigma(z^{(m)}/\\tau)\\,\\|\\,
        \\sigma(z/\\tau)\\big)

The global blocks are frozen (no gradient reaches the global parameters, which are not
trained) but the gradient flows through them into the local blocks: each local block must
produce features the global model's later blocks can classify, which keeps local models
congruent with the global one without extra communication. The global blocks run in
evaluation mode. FedRCL's tables use lambda1 = lambda2 = 1, tau = 1 (paper App. E).
"""

from __future__ import annotations

import dataclasses

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.engine.algorithm import ClientAlgorithm
from fedjax_rcl.losses.baselines import hybrid_path_losses
from fedjax_rcl.models.base import ModelFns
from fedjax_rcl.validation import finite


@dataclasses.dataclass
class FedMLBConfig:
    """``algorithm=fedmlb`` (FedRCL's tables: 1, 1, 1).

    Attributes:
      lambda1: the weight of the hybrid pathways' cross-entropy.
      lambda2: the weight of the hybrid pathways' distillation from the main pathway.
      tau: the distillation temperature.
    """

    lambda1: float = 1.0
    lambda2: float = 1.0
    tau: float = 1.0

    def check(self, ctx) -> list[str]:
        p = []
        for name in ("lambda1", "lambda2"):
            v = getattr(self, name)
            if not (finite(v) and v >= 0):
                p.append(f"{name}={v!r}: must be >= 0")
        if not (finite(self.tau) and self.tau > 0):
            p.append(f"tau={self.tau!r}: must be > 0")
        if ctx.algorithm == "fedmlb" and ctx.num_blocks == 0:
            p.append(f"model={ctx.model} cannot be entered after a block, which FedMLB's "
                     "hybrid pathways need (register it with num_blocks > 0; built in: "
                     "cnn, pfl_cnn, resnet10, resnet18, resnet34)")
        return p


def fedmlb(model: ModelFns, settings: FedMLBConfig | None = None) -> ClientAlgorithm:
    """FedMLB's local objective with the section's hybrid-CE weight ``lambda1``, hybrid-KL
    weight ``lambda2`` and temperature ``tau`` (None: the defaults)."""
    s = settings or FedMLBConfig()
    lambda1, lambda2, tau = s.lambda1, s.lambda2, s.tau

    def objective(out, params, batch, ctx):
        del params
        if not out.blocks:
            raise ValueError("fedmlb: the model returned no blocks (ModelOutput.blocks)")
        ce = cross_entropy(out.logits, batch.labels)
        # One image per sample: with num_views = 1 the batch rows are the samples.
        hybrid = [model.apply_from(ctx.global_params, ctx.global_model_state, h,
                                   start=m + 1).logits
                  for m, h in enumerate(out.blocks)]
        ce_h, kl_h = hybrid_path_losses(out.logits, hybrid, batch.labels, tau=tau)
        loss = ce + lambda1 * ce_h + lambda2 * kl_h
        return loss, {"ce": ce, "hybrid_ce": ce_h, "hybrid_kl": kl_h}

    return ClientAlgorithm(objective)


registry.register_algorithm(
    "fedmlb", lambda s, model: fedmlb(model, s),
    config=FedMLBConfig)

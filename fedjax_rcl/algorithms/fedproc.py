"""FedProc's client: cross-entropy plus a contrastive loss toward the global class prototypes,
which the server aggregates from the clients' reports and broadcasts each round.

Mu, Shen, Cheng, Geng, Fu, Zhang, Zhang, "FedProc: Prototypical Contrastive Federated Learning
on Non-IID data" (arXiv 2109.12273).

.. math::
    \\ell(w) = \\ell_{CE}(w) + \\mu \\frac{1}{B} \\sum_i -\\log
      \\frac{e^{\\cos(z_i, c_{y_i})/t}}{\\sum_{c \\in \\mathcal C} e^{\\cos(z_i, c)/t}},
    \\qquad c_k = \\frac{\\sum_{\\text{clients}} \\sum_{i: y_i = k} z_i}{|\\{i: y_i = k\\}|}

with ``z`` the representation the classifier reads and ``C`` the classes some client has
reported. The engine's broadcast path carries the prototypes: each client reports per-class
sums and counts of ``z`` over the training steps of its last local epoch
(``ClientAlgorithm.report``), the server sums the reports of the round's clients and divides
(``server_message``), and every client reads the result next round
(``LocalContext.server_message``). Before any report (round 0) no class has a prototype and the
term is 0. Differences from the paper, kept simple on purpose: the prototypes are taken during
the last epoch's training steps rather than in a separate pass after training, and the
weight ``mu`` is constant where the paper shifts weight from the prototype loss toward
cross-entropy over the rounds.
"""

from __future__ import annotations

import dataclasses

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.engine.algorithm import ClientAlgorithm
from fedjax_rcl.losses.baselines import (
    class_prototypes,
    prototype_contrastive_loss,
    prototypes_from_sums,
)
from fedjax_rcl.validation import finite


@dataclasses.dataclass
class FedProcConfig:
    """``algorithm=fedproc``.

    Attributes:
      mu: the weight of the prototype contrastive loss.
      temperature: its temperature.
    """

    mu: float = 1.0
    temperature: float = 0.5

    def check(self, ctx) -> list[str]:
        del ctx
        p = []
        if not (finite(self.mu) and self.mu >= 0):
            p.append(f"mu={self.mu!r}: must be >= 0")
        if not (finite(self.temperature) and self.temperature > 0):
            p.append(f"temperature={self.temperature!r}: must be > 0")
        return p


def fedproc(settings: FedProcConfig | None = None) -> ClientAlgorithm:
    """FedProc's local objective, report and server message, with the section's settings
    (None: the defaults)."""
    s = settings or FedProcConfig()
    mu, temperature = s.mu, s.temperature

    def objective(out, params, batch, ctx):
        del params
        ce = cross_entropy(out.logits, batch.labels)
        prototypes, present = ctx.server_message
        proto = prototype_contrastive_loss(out.embedding, batch.labels, prototypes, present,
                                           temperature=temperature)
        return ce + mu * proto, {"ce": ce, "proto": proto}

    def report(out, batch):
        return class_prototypes(out.embedding, batch.labels, out.logits.shape[-1])

    def server_message(summed):
        sums, counts = summed
        return prototypes_from_sums(sums, counts)

    return ClientAlgorithm(objective, report=report,
                           server_message=server_message)


registry.register_algorithm("fedproc", lambda s, model: fedproc(s), config=FedProcConfig)

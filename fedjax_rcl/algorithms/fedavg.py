"""FedAvg's client: plain cross-entropy on the local data.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017 (arXiv 1602.05629).

.. math::
    \\ell(w) = \\frac{1}{B} \\sum_i -\\log \\operatorname{softmax}(f_w(x_i))_{y_i}
"""

from __future__ import annotations

import optax

from fedjax_rcl.algorithms.base import ApplyFn, Batch, ClientAlgorithm, LocalContext
from fedjax_rcl.types import Params


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy: ``[B, K], [B] -> []``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def fedavg(apply_fn: ApplyFn) -> ClientAlgorithm:
    """FedAvg's local objective: cross-entropy."""

    def local_loss(params: Params, batch: Batch, ctx: LocalContext):
        del ctx
        out = apply_fn(params, batch.images, train=True)
        ce = cross_entropy(out.logits, batch.labels)
        return ce, {"ce": ce}

    return ClientAlgorithm(name="fedavg", local_loss=local_loss)

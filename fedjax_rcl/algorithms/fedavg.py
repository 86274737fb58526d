"""FedAvg's client: plain cross-entropy on the local data.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017 (arXiv 1602.05629).

.. math::
    \\ell(w) = \\frac{1}{B} \\sum_i -\\log \\operatorname{softmax}(f_w(x_i))_{y_i}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedjax_rcl import registry
from fedjax_rcl.engine.algorithm import ClientAlgorithm


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy: ``[V * B, K], [B] -> []``.

    With ``V`` views stacked on the batch axis the labels are tiled to match.
    """
    reps = logits.shape[0] // labels.shape[0]
    labels = jnp.tile(labels, reps) if reps > 1 else labels
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def fedavg() -> ClientAlgorithm:
    """FedAvg's local objective: cross-entropy."""

    def objective(out, params, batch, ctx):
        del params, ctx
        ce = cross_entropy(out.logits, batch.labels)
        return ce, {"ce": ce}

    return ClientAlgorithm(objective)


registry.register_algorithm("fedavg", lambda settings, model: fedavg())

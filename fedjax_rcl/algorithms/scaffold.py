"""SCAFFOLD: local steps corrected by control variates, option II.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML
2020 (arXiv 1910.06378), Algorithm 1. Each local step moves against the drift of the client's
gradient from the server's:

.. math::
    y \\leftarrow y - \\eta\\,(g_i(y) + c - c_i),\\qquad
    c_i^+ = c_i - c + \\frac{x - y_i}{K \\eta},\\qquad
    c \\leftarrow c + \\frac{1}{N} \\sum_{i \\in S} (c_i^+ - c_i)

with ``x`` the round's global model, ``y_i`` the client's trained model, ``K`` its local steps
and ``N`` the population. The correction is added to the client optimizer's update (after
momentum and weight decay), as MOON's and NIID-Bench's SCAFFOLD apply it; ``K * eta`` is the
sum of the step sizes taken (``RoundContext.lr_sum``), exact under a decaying rate too. The
server control variate ``c`` is the algorithm's server state, each client's ``c_i`` a row of the
client-state table (zero for a client that never trained); the global model is averaged and
stepped by the configured server optimizer (its ``server.lr`` is SCAFFOLD's global step size).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.engine.algorithm import ClientAlgorithm, zeros_like_params


def scaffold() -> ClientAlgorithm:
    """SCAFFOLD (option II): cross-entropy, control-variate corrected steps."""

    def objective(out, params, batch, ctx):
        del params, ctx
        ce = cross_entropy(out.logits, batch.labels)
        return ce, {"ce": ce}

    def correct_update(updates, params, ctx, learning_rate):
        del params  # -lr (c - c_i), in each leaf's own type
        return jax.tree.map(lambda u, c, ci: u - (learning_rate * (c - ci)).astype(u.dtype),
                            updates, ctx.server_state, ctx.client_state)

    def update_client_state(c_i, params, model_state, ctx):
        del model_state
        # A client that took no step (smaller than a batch under drop_last) keeps its c_i.
        return jax.tree.map(
            lambda ci, c, x, y: jnp.where(ctx.lr_sum > 0, ci - c + (x - y) / ctx.lr_sum, ci),
            c_i, ctx.server_state, ctx.global_params, params)

    def client_result(old, new, params, model_state, ctx):
        del params, model_state, ctx
        return jax.tree.map(jnp.subtract, new, old)

    def update_server_state(c, summed_deltas, mean_params, ctx):
        return (jax.tree.map(lambda c, d: c + d / ctx.num_clients, c, summed_deltas),
                mean_params)

    return ClientAlgorithm(objective, init_client_state=zeros_like_params,
                           update_client_state=update_client_state, client_result=client_result,
                           init_server_state=zeros_like_params,
                           update_server_state=update_server_state,
                           correct_update=correct_update)


registry.register_algorithm("scaffold", lambda settings, model: scaffold())

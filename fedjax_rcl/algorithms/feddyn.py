"""FedDyn: a dynamic regulariser that aligns the clients' stationary points with the global one.

Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021 (arXiv
2111.04263), Algorithm 1. Client ``k`` minimises

.. math::
    L_k(\\theta) - \\langle g_k, \\theta \\rangle + \\frac{\\alpha}{2}
    \\lVert \\theta - \\theta^{t-1} \\rVert^2,\\qquad
    g_k \\leftarrow g_k - \\alpha\\,(\\theta_k^t - \\theta^{t-1})

(``g_k``, its last local gradient, is its client state, zero before it first trains); the server
keeps

.. math::
    h^t = h^{t-1} - \\frac{\\alpha}{N} \\sum_{k \\in P_t} (\\theta_k^t - \\theta^{t-1}),\\qquad
    \\theta^t = \\bar\\theta_{P_t} - \\frac{1}{\\alpha} h^t

with ``N`` the population and ``bar theta`` the mean of the round's models (the paper's is
uniform: ``aggregation=uniform``; the configured mean is used). ``h`` is the algorithm's server
state; ``theta^t`` is what the server optimizer then takes (with ``server.optimizer=fedavg``,
exactly).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from optax import tree_utils as otu

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy
from fedjax_rcl.engine.algorithm import ClientAlgorithm, zeros_like_params
from fedjax_rcl.validation import finite


@dataclasses.dataclass
class FedDynConfig:
    """``algorithm=feddyn``.

    Attributes:
      alpha: the regularisation weight (the paper's CIFAR-10 runs: 0.01 to 0.1).
    """

    alpha: float = 0.01

    def check(self, ctx) -> list[str]:
        del ctx
        return [] if finite(self.alpha) and self.alpha > 0 else [
            f"alpha={self.alpha!r}: must be > 0"]


def feddyn(settings: FedDynConfig | None = None) -> ClientAlgorithm:
    """FedDyn's client objective and server correction with the section's regularisation
    weight (None: the defaults)."""
    alpha = (settings or FedDynConfig()).alpha

    def objective(out, params, batch, ctx):
        ce = cross_entropy(out.logits, batch.labels)
        linear = otu.tree_vdot(ctx.client_state, params)
        prox = otu.tree_norm(otu.tree_sub(params, ctx.global_params), squared=True)
        return ce - linear + 0.5 * alpha * prox, {"ce": ce, "linear": linear, "prox": prox}

    def update_client_state(g, params, model_state, ctx):
        del model_state
        return jax.tree.map(lambda g, y, x: g - alpha * (y - x), g, params, ctx.global_params)

    def client_result(old, new, params, model_state, ctx):
        del old, new, model_state
        return jax.tree.map(lambda y, x: (y - x).astype(jnp.float32), params, ctx.global_params)

    def update_server_state(h, summed_moves, mean_params, ctx):
        h = jax.tree.map(lambda h, d: h - alpha * d / ctx.num_clients, h, summed_moves)
        return h, jax.tree.map(lambda m, h: (m - h / alpha).astype(m.dtype), mean_params, h)

    return ClientAlgorithm(objective, init_client_state=zeros_like_params,
                           update_client_state=update_client_state, client_result=client_result,
                           init_server_state=zeros_like_params,
                           update_server_state=update_server_state)


registry.register_algorithm("feddyn", lambda s, model: feddyn(s), config=FedDynConfig)

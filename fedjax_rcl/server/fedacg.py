"""FedACG: the server broadcasts a look-ahead model and clients stay near it.

Kim, Kim, Han, "Communication-Efficient Federated Learning with Accelerated Client Gradient",
CVPR 2024 (arXiv 2201.03172). With server momentum ``m``:

.. math::
    \\tilde\\theta = \\theta + \\lambda m \\ \\text{(broadcast)}, \\qquad
    \\ell_k(w) = \\ell_{\\text{algorithm}}(w) + \\beta \\lVert w - \\tilde\\theta \\rVert^2,

    d = \\operatorname{mean}_k \\theta_k - \\tilde\\theta, \\quad m \\leftarrow \\lambda m + d,
    \\quad \\theta \\leftarrow \\theta + m = \\operatorname{mean}_k \\theta_k .

So ``m`` is the last server step ``theta_new - theta``: the transformation is SGD on the
pseudo-gradient (learning rate 1: the new model is the clients' mean) that remembers its last
update, and the look-ahead is read from that memory. Any client algorithm combines with it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from fedjax_rcl import registry
from fedjax_rcl.server.optimizers import ServerOptimizer
from fedjax_rcl.validation import finite


class LastUpdateState(NamedTuple):
    """The previous call's updates (zeros before the first)."""

    last: optax.Updates


def remember_last_update() -> optax.GradientTransformation:
    """Passes updates through unchanged and keeps a copy of them in its state."""

    def init(params):
        return LastUpdateState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        del state, params
        return updates, LastUpdateState(updates)

    return optax.GradientTransformation(init, update)


@dataclasses.dataclass
class FedACGConfig:
    """``server.optimizer=fedacg``.

    Attributes:
      lookahead: lambda: clients start from ``theta + lambda m``.
      beta: the weight of the clients' ``||w - look-ahead||^2`` term.
    """

    lookahead: float = 0.85
    beta: float = 0.001

    def check(self, ctx) -> list[str]:
        del ctx
        p = []
        if not (finite(self.lookahead) and 0 <= self.lookahead < 1):
            p.append(f"lookahead={self.lookahead!r}: must be in [0, 1)")
        if not (finite(self.beta) and self.beta >= 0):
            p.append(f"beta={self.beta!r}: must be >= 0")
        return p


def fedacg(lr: float = 1.0, settings: FedACGConfig | None = None) -> ServerOptimizer:
    """FedACG with the section's look-ahead ``lambda = lookahead`` and client regulariser
    weight ``beta`` (None: the defaults)."""
    s = settings or FedACGConfig()
    lookahead, beta = s.lookahead, s.beta
    tx = optax.chain(optax.sgd(lr), remember_last_update())

    def client_start(params, opt_state):
        m = opt_state[1].last
        return jax.tree.map(lambda p, x: p + lookahead * x, params, m)

    def client_penalty(params, start):
        return beta * otu.tree_norm(otu.tree_sub(params, jax.lax.stop_gradient(start)),
                                    squared=True)

    return ServerOptimizer(tx, client_start=client_start, client_penalty=client_penalty,
                           penalty_name="acg")


registry.register_server_optimizer("fedacg", lambda s, lr: fedacg(lr, s), config=FedACGConfig)

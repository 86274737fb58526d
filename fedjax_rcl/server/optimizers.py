"""Server optimizers as optax transformations of the pseudo-gradient.

The engine hands the server optimizer the pseudo-gradient

.. math::
    g = \\theta - \\operatorname{mean}_k(\\theta_k) = -d

so that plain SGD with learning rate 1 reproduces FedAvg (``theta <- mean(theta_k)``), and any
optax optimizer becomes a server optimizer (Reddi et al., "Adaptive Federated Optimization",
ICLR 2021, arXiv 2003.00295). A ``ServerOptimizer`` may also change what the clients start
from and add a term to every client's objective (FedACG, ``server/fedacg.py``): the engine's one
broadcast path (``engine.round``) reads both from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from fedjax_rcl import registry
from fedjax_rcl.types import Params
from fedjax_rcl.validation import finite


@dataclasses.dataclass(frozen=True)
class ServerOptimizer:
    """What the server does with the clients' models, and what it sends them.

    Attributes:
      tx: optax transformation of the pseudo-gradient ``g = theta - mean_k theta_k``; its
        update is added to ``theta``.
      client_start: ``(params, opt_state) -> params`` the clients start local training from
        (and that ``LocalContext.global_params`` holds); None: the global model itself.
      client_penalty: ``(params, start) -> []`` added to every client's local objective, for
        any client algorithm; None: nothing.
      penalty_name: the metric name of that term.
    """

    tx: optax.GradientTransformation
    client_start: Callable[[Params, optax.OptState], Params] | None = None
    client_penalty: Callable[[Params, Params], jax.Array] | None = None
    penalty_name: str = "server_penalty"

    def start(self, params: Params, opt_state: optax.OptState) -> Params:
        """The model the clients start from this round."""
        return params if self.client_start is None else self.client_start(params, opt_state)


@dataclasses.dataclass
class FedAvgMConfig:
    """``server.optimizer=fedavgm``.

    Attributes:
      beta: the server momentum (FedRCL's tables: 0.4).
    """

    beta: float = 0.4

    def check(self, ctx) -> list[str]:
        del ctx
        ok = finite(self.beta) and 0 <= self.beta < 1
        return [] if ok else [f"beta={self.beta!r}: must be in [0, 1)"]


@dataclasses.dataclass
class FedAdamConfig:
    """``server.optimizer=fedadam`` (no bias correction).

    Attributes:
      b1: the decay of the first moment.
      b2: the decay of the second moment.
      tau: the adaptivity (added to the root of the second moment, which starts at tau^2).
    """

    b1: float = 0.9
    b2: float = 0.99
    tau: float = 1e-3

    def check(self, ctx) -> list[str]:
        del ctx
        p = [f"{k}={v!r}: must be in [0, 1)" for k, v in (("b1", self.b1), ("b2", self.b2))
             if not (finite(v) and 0 <= v < 1)]
        if not (finite(self.tau) and self.tau > 0):
            p.append(f"tau={self.tau!r}: must be > 0")
        return p


def fedavg(lr: float = 1.0) -> ServerOptimizer:
    """FedAvg: ``theta <- theta - lr g``; with ``lr = 1`` the new model is the clients' mean.

    McMahan et al., AISTATS 2017 (arXiv 1602.05629).
    """
    return ServerOptimizer(optax.sgd(lr))


def fedavgm(lr: float = 1.0, settings: FedAvgMConfig | None = None) -> ServerOptimizer:
    """FedAvgM: server momentum ``beta`` (the section's; None: the defaults) on
    ``d = mean_k theta_k - theta``.

    .. math::
        m \\leftarrow \\beta m + d, \\qquad \\theta \\leftarrow \\theta + \\eta m

    Hsu, Qi, Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated
    Visual Classification" (arXiv 1909.06335); FedRCL's tables use beta = 0.4. optax's SGD
    trace ``m' = g + beta m'`` is ``-m`` for ``g = -d``, and its update ``-lr m'`` is ``lr m``.
    """
    return ServerOptimizer(optax.sgd(lr, momentum=(settings or FedAvgMConfig()).beta))


class FedAdamState(NamedTuple):
    """First and second moments of the pseudo-gradient."""

    mu: optax.Updates
    nu: optax.Updates


def scale_by_fedadam(b1: float, b2: float, tau: float) -> optax.GradientTransformation:
    """Adam's scaling as FedAdam states it: no bias correction, ``v_0 = tau^2``.

    .. math::
        m \\leftarrow b_1 m + (1 - b_1) g, \\quad v \\leftarrow b_2 v + (1 - b_2) g^2, \\quad
        u = \\frac{m}{\\sqrt{v} + \\tau}

    (``optax.scale_by_adam`` always debiases and starts ``v`` at 0.)
    """

    def init(params):
        return FedAdamState(otu.tree_zeros_like(params), otu.tree_full_like(params, tau * tau))

    def update(updates, state, params=None):
        del params
        mu = otu.tree_update_moment(updates, state.mu, b1, 1)
        nu = otu.tree_update_moment_per_elem_norm(updates, state.nu, b2, 2)
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + tau), mu, nu)
        return out, FedAdamState(mu, nu)

    return optax.GradientTransformation(init, update)


# FedAdam's server learning rate when ``server.lr`` is null.
FEDADAM_LR = 0.01


def fedadam(lr: float = FEDADAM_LR, settings: FedAdamConfig | None = None) -> ServerOptimizer:
    """FedAdam on ``d = mean_k theta_k - theta``, without bias correction, with the section's
    ``b1``, ``b2`` and ``tau`` (None: the defaults).

    .. math::
        m \\leftarrow b_1 m + (1-b_1) d, \\quad v \\leftarrow b_2 v + (1-b_2) d^2 \\
        (v_0 = \\tau^2), \\quad \\theta \\leftarrow \\theta + \\eta \\frac{m}{\\sqrt v + \\tau}

    Reddi et al., "Adaptive Federated Optimization", ICLR 2021 (arXiv 2003.00295), Alg. 2.
    With ``g = -d`` the moments are those of ``g`` up to the sign of ``m``.
    """
    s = settings or FedAdamConfig()
    return ServerOptimizer(optax.chain(scale_by_fedadam(s.b1, s.b2, s.tau), optax.scale(-lr)))


registry.register_server_optimizer("fedavg", lambda s, lr: fedavg(lr))
registry.register_server_optimizer("fedavgm", lambda s, lr: fedavgm(lr, s),
                                   config=FedAvgMConfig)
registry.register_server_optimizer("fedadam", lambda s, lr: fedadam(lr, s), config=FedAdamConfig,
                                   default_lr=FEDADAM_LR)


def server_optimizer(cfg) -> ServerOptimizer:
    """The configured server optimizer (``cfg.server``), ``server.lr`` null meaning the
    optimizer's default."""
    entry = registry.server_optimizer(cfg.server.optimizer)
    settings = getattr(cfg.server, entry.name, None)
    lr = entry.default_lr if cfg.server.lr is None else cfg.server.lr
    return entry.build(settings, lr)

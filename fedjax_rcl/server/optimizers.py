"""Server optimizers as optax transformations of the pseudo-gradient (SPEC §6).

The engine hands the server optimizer the pseudo-gradient

.. math::
    g = \\theta - \\operatorname{mean}_k(\\theta_k)

so that plain SGD with learning rate 1 reproduces FedAvg (``theta <- mean(theta_k)``), and any
optax optimizer becomes a server optimizer (Reddi et al., "Adaptive Federated Optimization",
ICLR 2021, arXiv 2003.00295).
"""

from __future__ import annotations

import optax

SERVER_OPTIMIZERS = ("fedavg",)


def server_optimizer(name: str, *, lr: float = 1.0) -> optax.GradientTransformation:
    """Builds a server optimizer by config name.

    Args:
      name: ``fedavg`` (SGD on the pseudo-gradient; ``lr=1`` is the plain mean).
      lr: server learning rate.
    """
    if name == "fedavg":
        return optax.sgd(lr)
    raise ValueError(f"server.optimizer={name!r}: allowed {SERVER_OPTIMIZERS}")

"""Client algorithms: one module each, registered here by config name.

A registry entry builds the algorithm from the run config (its own config section holds its
hyperparameters) and may ask the model for extras (MOON's projection head). The engine never
names an algorithm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fedjax_rcl.algorithms.base import Batch, ClientAlgorithm, LocalContext, Objective
from fedjax_rcl.algorithms.fedavg import cross_entropy, fedavg
from fedjax_rcl.algorithms.fedcl import fedcl
from fedjax_rcl.algorithms.fedprox import fedprox
from fedjax_rcl.algorithms.fedrcl import fedrcl, fedscl
from fedjax_rcl.algorithms.moon import moon


@dataclasses.dataclass(frozen=True)
class Registered:
    """How the config builds one algorithm.

    Attributes:
      make: ``(cfg, model: ModelFns) -> ClientAlgorithm``.
      model_kwargs: ``cfg -> dict`` of extra ``get_model`` arguments.
      num_views: augmented views per sample (known before the model is built).
      section: the config section holding its hyperparameters (None: it has none).
    """

    make: Callable
    model_kwargs: Callable = lambda cfg: {}
    num_views: int = 1
    section: str | None = None


def _rcl_kwargs(cfg):
    s = cfg.fedrcl
    return dict(temperature=s.temperature, mining=s.mining, levels=s.levels)


ALGORITHMS: dict[str, Registered] = {
    "fedavg": Registered(lambda cfg, model: fedavg()),
    "fedprox": Registered(lambda cfg, model: fedprox(mu=cfg.fedprox.mu), section="fedprox"),
    "fedscl": Registered(lambda cfg, model: fedscl(**_rcl_kwargs(cfg)), section="fedrcl"),
    "fedrcl": Registered(
        lambda cfg, model: fedrcl(threshold=cfg.fedrcl.threshold, beta=cfg.fedrcl.beta,
                                  **_rcl_kwargs(cfg)),
        section="fedrcl",
    ),
    "fedcl": Registered(
        lambda cfg, model: fedcl(temperature=cfg.fedcl.temperature, levels=cfg.fedcl.levels),
        num_views=2,
        section="fedcl",
    ),
    "moon": Registered(
        lambda cfg, model: moon(model, mu=cfg.moon.mu, temperature=cfg.moon.temperature),
        model_kwargs=lambda cfg: {"projection_dim": cfg.moon.projection_dim},
        section="moon",
    ),
}


def registered(name: str) -> Registered:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"algorithm={name!r}: allowed {', '.join(ALGORITHMS)}") from None


def make_algorithm(cfg, model) -> ClientAlgorithm:
    """Builds the configured client algorithm (``cfg.algorithm``) with its settings."""
    return registered(cfg.algorithm).make(cfg, model)


__all__ = [
    "ALGORITHMS",
    "Batch",
    "ClientAlgorithm",
    "LocalContext",
    "Objective",
    "Registered",
    "cross_entropy",
    "fedavg",
    "fedcl",
    "fedprox",
    "fedrcl",
    "fedscl",
    "make_algorithm",
    "moon",
    "registered",
]

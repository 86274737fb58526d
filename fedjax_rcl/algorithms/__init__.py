"""Client algorithms: one module each.

Each module defines its local objective (a factory of pure functions returning a
``ClientAlgorithm``), its config section (a dataclass with defaults and a ``check``) and
registers both with ``fedjax_rcl.registry.register_algorithm``. Importing this package registers
them all (the list below), so a new algorithm is one new module here, its line below and its
test. The engine never names an algorithm.
"""

from __future__ import annotations

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy, fedavg
from fedjax_rcl.algorithms.fedcl import fedcl
from fedjax_rcl.algorithms.fedprox import fedprox
from fedjax_rcl.algorithms.fedrcl import fedrcl, fedscl
from fedjax_rcl.algorithms.moon import moon
from fedjax_rcl.engine.algorithm import Batch, ClientAlgorithm, LocalContext, Objective

# isort: split
# Every built-in algorithm's module registers itself when imported: these and the five imported
# above for their names are all of them (a new algorithm is a new module and a name here). The
# order is the registry's, which the configuration reference and a run's config.yaml follow.
from fedjax_rcl.algorithms import (  # noqa: F401
    feddecorr,
    feddyn,
    fedlc,
    fedmlb,
    fedntd,
    fedproc,
    fitnet,
    mfcl,
    scaffold,
)

# Every registered algorithm by name (built-in and the user's), a live view of the registry.
ALGORITHMS = registry.ALGORITHMS


def make_algorithm(cfg, model) -> ClientAlgorithm:
    """Builds the configured client algorithm (``cfg.algorithm``) with its section's settings."""
    entry = registry.algorithm(cfg.algorithm)
    settings = getattr(cfg, entry.section) if entry.section else None
    return entry.build(settings, model)


def model_kwargs(cfg) -> dict:
    """Extra model arguments the configured algorithm asks for (MOON's projection head)."""
    entry = registry.algorithm(cfg.algorithm)
    return entry.model_kwargs(getattr(cfg, entry.section) if entry.section else None)


__all__ = [
    "ALGORITHMS",
    "Batch",
    "ClientAlgorithm",
    "LocalContext",
    "Objective",
    "cross_entropy",
    "fedavg",
    "fedcl",
    "fedprox",
    "fedrcl",
    "fedscl",
    "make_algorithm",
    "model_kwargs",
    "moon",
]

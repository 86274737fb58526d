"""Client algorithms: one module each.

Each module defines its local objective (a factory of pure functions returning a
``ClientAlgorithm``), its config section (a dataclass with defaults and a ``check``) and
registers both with ``fedjax_rcl.registry.register_algorithm``; ``registry.load_builtins``
imports every module of this package, so a new algorithm is one new module here (and its
test). The engine never names an algorithm.
"""

from __future__ import annotations

from fedjax_rcl import registry
from fedjax_rcl.algorithms.fedavg import cross_entropy, fedavg
from fedjax_rcl.algorithms.fedcl import fedcl
from fedjax_rcl.algorithms.fedprox import fedprox
from fedjax_rcl.algorithms.fedrcl import fedrcl, fedscl
from fedjax_rcl.algorithms.moon import moon
from fedjax_rcl.engine.algorithm import Batch, ClientAlgorithm, LocalContext, Objective

# The other modules of this package (each registers itself): a new algorithm is a new module.
registry.import_modules(__name__)
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

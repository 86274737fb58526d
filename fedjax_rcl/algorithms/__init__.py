"""Client algorithms: one module each, registered here by config name.

Each entry maps ``(config, apply_fn) -> ClientAlgorithm``; the engine never names an algorithm.
"""

from __future__ import annotations

from collections.abc import Callable

from fedjax_rcl.algorithms.base import (
    ApplyFn,
    Batch,
    ClientAlgorithm,
    LocalContext,
    LocalLoss,
)
from fedjax_rcl.algorithms.fedavg import cross_entropy, fedavg

ALGORITHMS: dict[str, Callable[..., ClientAlgorithm]] = {
    "fedavg": lambda cfg, apply_fn: fedavg(apply_fn),
}


def make_algorithm(cfg, apply_fn: ApplyFn) -> ClientAlgorithm:
    """Builds the configured client algorithm (``cfg.algorithm``) with its settings."""
    try:
        builder = ALGORITHMS[cfg.algorithm]
    except KeyError:
        raise ValueError(
            f"algorithm={cfg.algorithm!r}: allowed {', '.join(ALGORITHMS)}"
        ) from None
    return builder(cfg, apply_fn)


__all__ = [
    "ALGORITHMS",
    "ApplyFn",
    "Batch",
    "ClientAlgorithm",
    "LocalContext",
    "LocalLoss",
    "cross_entropy",
    "fedavg",
    "make_algorithm",
]

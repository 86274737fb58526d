"""Metrics computed on the host between rounds."""

from __future__ import annotations

from fedjax_rcl.metrics.representation import (
    class_covariance_traces,
    effective_rank,
    mean_pairwise_cosine,
    spread_share,
    variability_collapse_index,
)


def ema(previous: float | None, value: float, decay: float = 0.9) -> float:
    """The paper's smoothed accuracy: ``ema_t = decay * ema_{t-1} + (1 - decay) * acc_t``,
    ``ema_0 = acc_0`` (FedRCL reports it at rounds 500 and 1000)."""
    return value if previous is None else decay * previous + (1.0 - decay) * value


__all__ = ["class_covariance_traces", "effective_rank", "ema", "mean_pairwise_cosine",
           "spread_share", "variability_collapse_index"]

"""Metrics computed on the host between rounds."""

from __future__ import annotations

import math
from collections.abc import Sequence

from fedjax_rcl.metrics.representation import (
    class_covariance_traces,
    effective_rank,
    mean_pairwise_cosine,
    spread_share,
    variability_collapse_index,
)


def ema(previous: float | None, value: float, decay: float = 0.9, rounds: int = 1) -> float:
    """The smoothed test accuracy FedRCL reports at rounds 500 and 1000, with ``decay`` per
    round: ``ema_t = decay * ema_{t-1} + (1 - decay) * acc_t`` over rounds ``t``, started at the
    first evaluation (``ema = acc`` there; no zero start, which would pull early values down).

    ``rounds``: the rounds since the previous evaluation. An evaluation every ``k`` rounds
    applies ``decay**k`` once (``ema = decay**k * ema_prev + (1 - decay**k) * acc``): the same
    time constant in rounds, exact only for ``k = 1`` -- it treats the ``k - 1`` rounds not
    evaluated as if their accuracy were this evaluation's. (The paper's text gives the decay;
    that it is per round is read from its wording, as the authors' released code computes no
    EMA.)"""
    if previous is None:
        return value
    keep = decay ** rounds
    return keep * previous + (1.0 - keep) * value


# The windows of rounds over which the metrics lines give the mean raw test accuracy.
RECENT_WINDOWS = (10, 50)


def recent_mean(history: Sequence[tuple[int, float]], last_round: int, window: int) -> float:
    """The mean raw test accuracy of the evaluations in rounds ``last_round - window + 1 ..
    last_round`` (``history``: ``(round, accuracy)`` pairs, any order): a figure that does not
    depend on the evaluation cadence the way the EMA does (every ``k`` rounds, it averages
    ``window / k`` evaluations of the same rounds). NaN when no evaluation falls in the window."""
    hit = [float(a) for r, a in history if last_round - window < r <= last_round]
    return math.fsum(hit) / len(hit) if hit else math.nan


__all__ = ["RECENT_WINDOWS", "class_covariance_traces", "effective_rank", "ema",
           "mean_pairwise_cosine", "recent_mean", "spread_share", "variability_collapse_index"]

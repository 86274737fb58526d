"""What a ``metrics.jsonl`` line of a federated run holds, for the code that reads it back.

A line is one evaluation: the loop's own keys (``LOOP_KEYS``), one mean value per term of the
local objective (``ce``, ``scl``, ``penalty``, ... -- whatever the algorithm reports), and on
analysis rounds the representation analysis (``global_*``/``local_*`` statistics, the analysed
client and the participation histogram). Terms differ between algorithms and the analysis
appears only on some lines, so readers take the keys from every line, not the first.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

__all__ = ["ANALYSIS_KEYS", "ANALYSIS_PREFIXES", "LOOP_KEYS", "is_analysis_key", "loss_terms"]

# Written by the loop on every line.
LOOP_KEYS = ("round", "test_accuracy", "test_accuracy_ema", "ema_rounds", "test_accuracy_last10",
             "test_accuracy_last50", "test_loss", "train_loss", "round_s", "elapsed_s",
             "total_s")
# Diagnostics of local training, not loss terms: the share of float16 steps skipped for
# non-finite gradients (``precision=fp16``).
DIAGNOSTIC_KEYS = ("amp_skipped",)
# Written on analysis rounds (``engine.analysis``).
ANALYSIS_PREFIXES = ("global_", "local_")
ANALYSIS_KEYS = ("local_client", "participation")


def is_analysis_key(key: str) -> bool:
    """Whether ``key`` is part of the representation analysis."""
    return key in ANALYSIS_KEYS or key.startswith(ANALYSIS_PREFIXES)


def loss_terms(rows: Sequence[dict]) -> list[str]:
    """The local objective's terms found in any line, in first-seen order."""
    seen: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if (key not in LOOP_KEYS and key not in DIAGNOSTIC_KEYS and not is_analysis_key(key)
                    and isinstance(value, numbers.Real) and not isinstance(value, bool)):
                seen.setdefault(key, None)
    return list(seen)

"""Checking settings where they enter: the error every check raises and the helpers they share.

The bottom of the package: the config, the algorithms' and server optimizers' config sections,
the trackers and the run directory all report a bad value the same way, before anything is
compiled: one line per problem, ``"field=value: what is allowed"``, gathered into one
``ConfigError`` (the command line prints its lines and exits with status 2). This module
imports nothing else from the package, so every layer may use it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["CheckContext", "ConfigError", "check_levels", "did_you_mean", "finite", "one_of",
           "require"]


class ConfigError(ValueError):
    """A bad configuration. ``str(err)`` is one line per problem, each naming the field."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class CheckContext(NamedTuple):
    """What a config section's ``check`` may consult besides its own values.

    Attributes:
      model: the configured model name.
      num_levels: how many feature levels that model returns (None: unknown model).
      num_blocks: how many blocks it can be entered after (``ModelEntry.num_blocks``; None:
        unknown model).
      algorithm: the configured algorithm (every section is checked, the active one or not:
        a check about the model's abilities applies only when its algorithm runs).
      norm: the configured normalisation (``norm``) of the models that offer a choice.
    """

    model: str
    num_levels: int | None
    num_blocks: int | None = None
    algorithm: str | None = None
    norm: str | None = None


def finite(x) -> bool:
    """A real number, not NaN or infinite (bools are not numbers here)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def require(problems: list[str], ok: bool, name: str, value, allowed: str) -> None:
    """Appends ``"name=value: allowed"`` to ``problems`` unless ``ok``."""
    if not ok:
        problems.append(f"{name}={value!r}: {allowed}")


def did_you_mean(value, allowed: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the allowed name closest to a misspelt ``value``, or
    ``""`` when none is close (``difflib``'s ratio of at least 0.6)."""
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def one_of(problems: list[str], name: str, value, allowed: Iterable[str]) -> None:
    """Appends ``"name=value: allowed: a, b, c"`` with a suggestion for a misspelling unless
    ``value`` is one of ``allowed``."""
    allowed = list(allowed)
    if value not in allowed:
        problems.append(f"{name}={value!r}: allowed: {', '.join(map(str, allowed))}"
                        f"{did_you_mean(value, allowed)}")


def check_levels(levels, ctx: CheckContext) -> list[str]:
    """Problems with a ``levels`` list (None: all) for the model of ``ctx``: the indices must
    be distinct and within the model's feature levels (negative ones count from the end)."""
    n = ctx.num_levels
    if levels is None or n is None:
        return []
    ok = len(levels) > 0 and all(-n <= i < n for i in levels)
    ok = ok and len({i % n for i in levels}) == len(levels)
    return [] if ok else [
        f"levels={list(levels)!r}: model={ctx.model} has {n} feature levels: give distinct "
        f"indices in [{-n}, {n - 1}] (null for all, [-1] for the last)"]

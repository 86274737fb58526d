"""Sweeps: several runs in one program (``fedjax_rcl.grid``), one per seed of ``seeds`` and
value of one float setting (``fedrcl.beta=[0.5,1,2]`` on the command line), and their names.
"""

from __future__ import annotations

import dataclasses

from fedjax_rcl.config.schema import CoreConfig, field_type

# A grid member's directory is part of the run directory's layout, which rundir names.
from fedjax_rcl.rundir import grid_members as grid_members
from fedjax_rcl.rundir import member_name as member_name
from fedjax_rcl.validation import ConfigError

# Float settings that decide the program's shapes: their values cannot share one program.
SHAPE_SETTINGS = {"participation": "sets how many clients a round trains"}
SWEEPABLE = ("float", "float | None")


def sweep_overrides(overrides: list[str]) -> list[str]:
    """``key=[v0,v1,...]`` for a float setting as ``sweep.key=key sweep.values=[...]``; a
    list for any other single-valued setting is refused with what a sweep takes."""
    out, swept = [], []
    for o in overrides:
        key, _, value = o.partition("=")
        key, value = key.strip(), value.strip()
        kind = field_type(key)
        if not value.startswith("[") or kind is None or kind.startswith("list"):
            out.append(o)
        elif kind in SWEEPABLE:
            swept.append(key)
            out += [f"sweep.key={key}", f"sweep.values={value}"]
        else:
            raise ConfigError([f"{key}={value}: a list of values is a sweep, of one float "
                               f"setting (e.g. fedrcl.beta=[0.5,1,2], alpha=[0.1,0.3], "
                               f"lr=[0.05,0.1]); {key} is {kind}"])
    if len(swept) > 1:
        raise ConfigError([f"{', '.join(swept)}: lists for {len(swept)} settings; a grid "
                           "sweeps one setting (with seeds=[...] beside it)"])
    return out


def with_setting(cfg, key: str, value):
    """``cfg`` with the dotted ``key`` set to ``value`` (nested dataclasses replaced)."""
    head, _, rest = key.partition(".")
    inner = with_setting(getattr(cfg, head), rest, value) if rest else value
    return dataclasses.replace(cfg, **{head: inner})


def is_grid(cfg: CoreConfig) -> bool:
    """Whether ``cfg`` is several runs in one program (``seeds`` or a ``sweep``)."""
    return bool(cfg.seeds) or cfg.sweep.key is not None

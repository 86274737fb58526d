"""The config digest that checkpoints carry, and which keys a resumed run may change: a hash of
every setting that decides a run's results, so that ``resume`` refuses a config that would not
continue the run it says it continues.

Which settings count is declared where each setting is (``fedjax_rcl.fields``): a
``resume_safe`` one never, a ``digest_neutral`` one only off its declared default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from fedjax_rcl import registry
from fedjax_rcl.config.schema import CoreConfig, schema
from fedjax_rcl.fields import declared
from fedjax_rcl.provenance import file_sha256

# The core config's own keys: a dataclass among them is one of its sections, any other an
# algorithm's (in the digest only while that algorithm runs).
_CORE_KEYS = frozenset(f.name for f in dataclasses.fields(CoreConfig))


def keys_declared(**treatment: bool) -> list[str]:
    """The dotted keys of the run config (``schema()``, the registered sections included) whose
    declared treatment has these flags: ``keys_declared(resume_safe=True)`` are the keys a
    resumed run may change, ``keys_declared(report=False)`` those reports ignore."""
    return sorted(k for k, d in declared(schema()).items()
                  if all(getattr(d.treatment, name) == value
                         for name, value in treatment.items()))


def flat_keys(d: dict, prefix: str = "") -> dict:
    """A nested mapping as dotted keys: ``{"server": {"lr": 1}} -> {"server.lr": 1}``."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _result_settings(cfg: CoreConfig) -> dict:
    """The flat settings that decide a run's results: every core key but those declared
    ``resume_safe`` and the ``digest_neutral`` ones at their declared default, plus the
    sections of the algorithm and server optimizer in use (the other sections are inert)."""
    flat = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "server":
            flat.update({f"server.{k}": v for k, v in flat_keys(dataclasses.asdict(value)).items()
                         if "." not in k or k.startswith(f"{value.optimizer}.")})
        elif dataclasses.is_dataclass(value) and f.name not in _CORE_KEYS:
            entry = registry.ALGORITHMS.get(cfg.algorithm)
            if entry is not None and entry.section == f.name:
                flat.update(flat_keys(dataclasses.asdict(value), f"{f.name}."))
        elif dataclasses.is_dataclass(value):
            flat.update(flat_keys(dataclasses.asdict(value), f"{f.name}."))
        else:
            flat[f.name] = value
    if cfg.partition == "file" and cfg.split_file is not None:
        # The file's contents decide the split: a run resumed with the same path but another
        # split is refused (None where it cannot be read).
        flat["split_file.sha256"] = file_sha256(cfg.split_file)
    settings = declared(cfg)
    return {k: v for k, v in flat.items() if k not in settings or not (
        settings[k].treatment.resume_safe
        or (settings[k].treatment.digest_neutral and v == settings[k].default))}


def changed_keys(old: CoreConfig, new: CoreConfig) -> list[str]:
    """Dotted keys whose values differ and that would change results (any but those declared
    ``resume_safe``; the sections of algorithms and server optimizers not in use change
    nothing).

    A key counts when it decides the results of either config and its value differs between
    the two, so that switching algorithms names ``algorithm`` (and any key of the new
    algorithm's section given a new value), not every key of the old algorithm's section."""
    a, b = _result_settings(old), _result_settings(new)
    every_a = flat_keys(dataclasses.asdict(old))
    every_b = flat_keys(dataclasses.asdict(new))
    return sorted(k for k in a.keys() | b.keys()
                  if every_a.get(k, a.get(k)) != every_b.get(k, b.get(k)))


def config_digest(cfg: CoreConfig) -> str:
    """A hash of every result-affecting setting (checkpoints carry it)."""
    return hashlib.sha256(json.dumps(_result_settings(cfg), sort_keys=True).encode()
                          ).hexdigest()[:16]

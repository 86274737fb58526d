"""The config digest that checkpoints carry, and which keys a resumed run may change: a hash of
every setting that decides a run's results, so that ``resume`` refuses a config that would not
continue the run it says it continues.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from fedjax_rcl import registry
from fedjax_rcl.config.schema import CoreConfig, TrackingConfig
from fedjax_rcl.provenance import file_sha256

# Keys that a resumed run may change without changing any result.
RESUME_SAFE_KEYS = ("rounds", "checkpoint_every", "keep_checkpoints", "eval_batch_size",
                    "data_dir", "run_dir", "distributed.coordinator_address",
                    "distributed.process_id", "analysis_every", "analysis_images",
                    "client_metrics",
                    *(f"tracking.{f.name}" for f in dataclasses.fields(TrackingConfig)))


# Settings added after runs existed, at their default (what a run's config without them
# means): left out of the digest while they hold it, so that checkpoints written before a
# setting existed still resume. A new setting joins them.
DIGEST_NEUTRAL_DEFAULTS = {"mfcl.bn_statistics": "running", "init_threefry_partitionable": False,
                           "client_eval": False, "precision": "fp32", "seeds": [],
                           "runs_in_parallel": 1, "sweep.key": None, "sweep.values": [],
                           "mfcl.probe": "lbfgs",
                           "mfcl.probe_l2_grid": [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0],
                           "mfcl.probe_holdout": 0.1, "mfcl.probe_max_iter": 1000,
                           "mfcl.probe_tol": 1e-5, "mfcl.probe_controls": True,
                           "mfcl.tn_variance": "pooled", "mfcl.probe_projection": False,
                           "split_file": None, "transforms": "fedrcl",
                           "partition_version": 1, "drop_last": False,
                           "sampling_version": 1}


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
    """The flat settings that decide a run's results: every core key but ``RESUME_SAFE_KEYS``
    and ``plugins``, plus the sections of the algorithm and server optimizer in use (the
    other sections are inert)."""
    flat = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "server":
            flat.update({f"server.{k}": v for k, v in flat_keys(dataclasses.asdict(value)).items()
                         if "." not in k or k.startswith(f"{value.optimizer}.")})
        elif f.name == "tracking":
            continue  # where metrics are mirrored changes no result
        elif f.name == "sweep":
            flat.update(flat_keys(dataclasses.asdict(value), "sweep."))
        elif dataclasses.is_dataclass(value) and f.name != "distributed":
            entry = registry.ALGORITHMS.get(cfg.algorithm)
            if entry is not None and entry.section == f.name:
                flat.update(flat_keys(dataclasses.asdict(value), f"{f.name}."))
        elif dataclasses.is_dataclass(value):
            flat.update(flat_keys(dataclasses.asdict(value), f"{f.name}."))
        elif f.name != "plugins":
            flat[f.name] = value
    if cfg.partition == "file" and cfg.split_file is not None:
        # The file's contents decide the split: a run resumed with the same path but another
        # split is refused (None where it cannot be read).
        flat["split_file.sha256"] = file_sha256(cfg.split_file)
    return {k: v for k, v in flat.items() if k not in RESUME_SAFE_KEYS
            and not (k in DIGEST_NEUTRAL_DEFAULTS and v == DIGEST_NEUTRAL_DEFAULTS[k])}


def changed_keys(old: CoreConfig, new: CoreConfig) -> list[str]:
    """Dotted keys whose values differ and that would change results (see RESUME_SAFE_KEYS;
    the sections of algorithms and server optimizers not in use change nothing).

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

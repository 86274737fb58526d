"""The kinds of run, and the one lookup from a run's config to its kind.

Every run goes through the shared run loop (``fedjax_rcl.loop``); what differs between kinds
is how a run is started, continued and evaluated:

* ``single``: one federated run (``fedjax_rcl.training``);
* ``grid``: several federated runs in one compiled program, ``seeds=[...]`` or a ``sweep``
  (``fedjax_rcl.grid``), each member an ordinary single run's directory;
* ``mfcl``: MFCL's two phases and its probe (``fedjax_rcl.mfcl.run``).

A ``RunKind`` is one row of hooks; ``kind_of`` picks the row from the config (and, when a run
is started, the command asked for), so the entry points (``fedjax_rcl.api``) dispatch once,
here, and never on the kind themselves. The checks the kinds share (the command an algorithm
runs with, the config digest of a checkpoint restored) are ``loop.require_command`` and
``loop.restore_checked``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

from fedjax_rcl import grid, registry, training
from fedjax_rcl.config import CoreConfig, is_grid
from fedjax_rcl.data import ImageDataset
from fedjax_rcl.mfcl import run as mfcl_run
from fedjax_rcl.validation import ConfigError

__all__ = ["COMMAND_DEFAULTS", "KINDS", "RunKind", "kind_of"]


@dataclasses.dataclass(frozen=True)
class RunKind:
    """How one kind of run is started, continued and evaluated.

    Attributes:
      name: ``"single"``, ``"grid"`` or ``"mfcl"``.
      start: ``(cfg, *, dataset, log, command, callbacks, progress[, warn]) -> result``: a new
        run directory trained to the config's end; ``result["run_dir"]`` names it.
      continue_run: ``(run_dir, cfg, *, force, dataset, progress, log, command, callbacks)
        -> result``: the run continued from its newest complete checkpoint (``cfg`` already
        read and checked by ``loop.resume_config``).
      evaluate: ``(run_dir, cfg, *, dataset, strict) -> dict``: the run's newest complete
        checkpoint on the full test set.
      warns: ``start`` takes ``warn=`` (where the warnings about settings go).
      members: ``(run_dir, cfg) -> [config]``: the configs of the runs inside this one, each
        with its own ``run_dir`` (a grid's members); none for the other kinds.
    """

    name: str
    start: Callable[..., dict]
    continue_run: Callable[..., dict]
    evaluate: Callable[..., dict]
    warns: bool = False
    members: Callable[[Path, CoreConfig], list[CoreConfig]] = lambda run_dir, cfg: []


def _evaluate_single(run_dir: Path, cfg: CoreConfig, *, dataset: ImageDataset | None = None,
                     strict: bool = False) -> dict:
    del cfg  # read again with the checkpoint
    return training.evaluate_run(run_dir, dataset=dataset, strict=strict)


def _evaluate_mfcl(run_dir: Path, cfg: CoreConfig, *, dataset: ImageDataset | None = None,
                   strict: bool = False) -> dict:
    """MFCL has no federated model to test: its evaluation is the linear probe on the trained
    server network's features, which the run itself computes at its end."""
    del cfg, dataset, strict
    raise ConfigError([f"run_dir={str(run_dir)!r}: an MFCL run; its evaluation is the linear "
                       "probe, which 'fedjax-rcl mfcl' and 'fedjax-rcl resume' write to "
                       "metrics.jsonl (the line with \"phase\": \"probe\"); eval evaluates "
                       "the checkpoints of 'fedjax-rcl train' runs"])


KINDS: dict[str, RunKind] = {
    "single": RunKind("single", training.train, training.continue_run, _evaluate_single,
                      warns=True),
    "grid": RunKind("grid", grid.train_grid, grid.continue_grid, grid.evaluate_grid,
                    warns=True, members=lambda run_dir, cfg: grid.member_configs(cfg, run_dir)),
    "mfcl": RunKind("mfcl", mfcl_run.run_mfcl, mfcl_run.resume_mfcl, _evaluate_mfcl),
}

# The settings each command starts from before the YAML file and the overrides.
COMMAND_DEFAULTS: Mapping[str, Mapping[str, object]] = MappingProxyType({
    "train": MappingProxyType({}),
    "mfcl": MappingProxyType(mfcl_run.MFCL_DEFAULTS),
})


def kind_of(cfg: CoreConfig, command: str | None = None) -> RunKind:
    """The kind of run ``cfg`` is: ``command`` (``"train"`` or ``"mfcl"``: the command asked
    to start it; default the one its algorithm names) ``mfcl`` is MFCL's; else several runs
    (``seeds`` or a ``sweep``) are a grid, one a single run. A command that does not run the
    config's algorithm is refused by that kind's ``start``, in its own words."""
    command = command or registry.algorithm(cfg.algorithm).command
    if command == "mfcl":
        return KINDS["mfcl"]
    return KINDS["grid"] if is_grid(cfg) else KINDS["single"]

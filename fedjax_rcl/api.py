"""The entry points of runs, for the command line and for Python: start, continue, evaluate.

Each command that trains is a *program* over the shared run loop (``fedjax_rcl.loop``):
``train`` (``fedjax_rcl.training``: federated rounds) and ``mfcl`` (``fedjax_rcl.mfcl.run``:
MFCL's two phases and probe). A registered algorithm names the command that runs it
(``registry.AlgorithmEntry.command``), so ``resume`` continues any run by reading which
program its config belongs to; neither program knows the other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fedjax_rcl import registry, training
from fedjax_rcl.config import CoreConfig
from fedjax_rcl.data import ImageDataset
from fedjax_rcl.loop import resume_config
from fedjax_rcl.mfcl import run as mfcl_run

__all__ = ["PROGRAMS", "evaluate", "resume", "start"]

# command -> (start(cfg, **kw), continue_run(run_dir, cfg, **kw)).
PROGRAMS: dict[str, tuple[Callable[..., dict], Callable[..., dict]]] = {
    "train": (training.train, training.continue_run),
    "mfcl": (mfcl_run.run_mfcl, mfcl_run.resume_mfcl),
}


def _program(cfg: CoreConfig):
    return PROGRAMS[registry.algorithm(cfg.algorithm).command]


def start(cfg: CoreConfig, **kwargs) -> dict:
    """Starts a run of ``cfg`` with the program its algorithm names; returns its last
    metrics record."""
    return _program(cfg)[0](cfg, **kwargs)


def resume(run_dir: str | Path, overrides=(), *, force: bool = False,
           dataset: ImageDataset | None = None, progress: bool = True,
           log: Callable[[str], None] = print, command: str | None = None) -> dict:
    """Continues any run from its newest complete checkpoint, identically to an
    uninterrupted run. Overrides that would change its results are refused unless
    ``force``."""
    run_dir = Path(run_dir)
    cfg = resume_config(run_dir, overrides, force=force)
    return _program(cfg)[1](run_dir, cfg, force=force, dataset=dataset, progress=progress,
                            log=log, command=command)


def evaluate(run_dir: str | Path, *, dataset: ImageDataset | None = None) -> dict:
    """Evaluates a federated run's newest complete checkpoint on the full test set."""
    return training.evaluate_run(run_dir, dataset=dataset)

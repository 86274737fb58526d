"""Experiment trackers beside ``metrics.jsonl``: TensorBoard event files and Weights & Biases.

``metrics.jsonl`` stays the run's record (``report``, ``resume`` and ``eval`` read only it);
a tracker mirrors each of its lines as it is written, so that a researcher's usual dashboard
shows the run live. Both are optional and chosen in the config::

    tracking:
      tensorboard: true     # <run_dir>/tensorboard/, tensorboardX (pure Python, no TensorFlow)
      wandb: true           # needs `pip install wandb` and a login (or wandb_mode: offline)
      wandb_project: fedjax-rcl

Every numeric field of a line becomes a scalar at step ``round`` (lists, such as the
participation histogram, are left to ``metrics.jsonl``). The keys change no result, so they
may be switched on or off when resuming.

Resuming rewinds a run to its last checkpoint and recomputes the rounds after it; a resumed
run is identical to an uninterrupted one, so a tracker never shows a round twice: TensorBoard
purges the events from the resumed round on (``purge_step``), and W&B continues the same run
(its id is kept in ``<run_dir>/wandb.json``) and skips the rounds it already has.
"""

from __future__ import annotations

import json
import numbers
import secrets
from pathlib import Path
from typing import Any

from fedjax_rcl.config.schema import TrackingConfig
from fedjax_rcl.rundir import atomic_write_text


def scalars(record: dict) -> dict[str, float]:
    """The fields of a metrics line a tracker plots: numbers, not ``round`` nor booleans."""
    return {k: float(v) for k, v in record.items()
            if k != "round" and isinstance(v, numbers.Real) and not isinstance(v, bool)}


class _TensorBoard:
    def __init__(self, run_dir: Path, resumed_at: int):
        from tensorboardX import SummaryWriter

        # purge_step: a resumed run's events from the resumed round on replace the old ones.
        self._writer = SummaryWriter(str(run_dir / "tensorboard"),
                                     purge_step=resumed_at + 1 if resumed_at else None)

    def log(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=record["round"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _WandB:
    def __init__(self, run_dir: Path, settings: TrackingConfig, config: dict):
        import wandb

        self._state_path = run_dir / "wandb.json"
        state = (json.loads(self._state_path.read_text()) if self._state_path.exists()
                 else {"id": secrets.token_hex(4), "last_round": 0})
        self._state = state
        self._run = wandb.init(project=settings.wandb_project, entity=settings.wandb_entity,
                               id=state["id"], resume="allow", name=run_dir.name,
                               dir=str(run_dir), config=config, mode=settings.wandb_mode)
        self._save_state()

    def _save_state(self) -> None:
        atomic_write_text(self._state_path, json.dumps(self._state))

    def log(self, record: dict) -> None:
        if record["round"] <= self._state["last_round"]:
            return  # sent before an interruption; identical after an exact resume
        self._run.log(scalars(record), step=record["round"])
        self._state["last_round"] = record["round"]
        self._save_state()

    def close(self) -> None:
        self._run.finish()


class Trackers:
    """The trackers a config selects, fed each ``metrics.jsonl`` line (``log``) as it is
    written; ``close`` at the end of the loop, finished or interrupted."""

    def __init__(self, settings: TrackingConfig, run_dir: Path, *, resumed_at: int,
                 config: dict[str, Any]):
        self._sinks: list = []
        if settings.tensorboard:
            self._sinks.append(_TensorBoard(run_dir, resumed_at))
        if settings.wandb:
            self._sinks.append(_WandB(run_dir, settings, config))

    def log(self, record: dict) -> None:
        for sink in self._sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()

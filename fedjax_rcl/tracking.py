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

import dataclasses
import importlib.util
import json
import numbers
import secrets
from pathlib import Path
from typing import Any

from fedjax_rcl.rundir import atomic_write_text
from fedjax_rcl.validation import one_of

WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass
class TrackingConfig:
    """Where the metrics are mirrored besides ``metrics.jsonl`` (no result changes).

    Attributes:
      tensorboard: write TensorBoard event files to ``<run_dir>/tensorboard`` (needs
        tensorboardX).
      wandb: mirror the run to Weights & Biases (needs wandb and a login, or offline mode).
      wandb_project: the W&B project.
      wandb_entity: the W&B entity; null: the logged-in user's default.
      wandb_mode: ``offline`` keeps the run local (``wandb sync`` later).
    """

    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "fedjax-rcl"
    wandb_entity: str | None = None
    wandb_mode: str = "online"

    def check(self, ctx) -> list[str]:
        del ctx
        p = []
        if self.tensorboard and importlib.util.find_spec("tensorboardX") is None:
            p.append("tensorboard=True: needs tensorboardX, which is not installed "
                     "(pip install 'fedjax-rcl[tensorboard]'), or set tracking.tensorboard=false")
        if self.wandb and importlib.util.find_spec("wandb") is None:
            p.append("wandb=True: needs wandb, which is not installed (pip install wandb), or set "
                     "tracking.wandb=false")
        one_of(p, "wandb_mode", self.wandb_mode, WANDB_MODES)
        if not self.wandb_project:
            p.append(f"wandb_project={self.wandb_project!r}: must be a non-empty name")
        return p


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

"""The run directory: its name, its files, and the lock that keeps a second process out.

``RunDir`` alone knows the layout of a run directory; every module that reads or writes one
goes through it::

    RUN_DIR/config.yaml          the resolved config
    RUN_DIR/metrics.jsonl        one line per evaluation, appended as it comes
    RUN_DIR/clients.jsonl        per-client lines (``client_metrics``, ``client_eval``)
    RUN_DIR/commands.txt         each process's command; environment.jsonl its machine
    RUN_DIR/accuracy.png         the plot of metrics.jsonl
    RUN_DIR/checkpoints/<step>/  Orbax checkpoints (an MFCL run: checkpoints/phase1/<round>/,
                                 checkpoints/phase2/<epoch>/, and resources.json)
    RUN_DIR/<member>/            a grid's members (``seed-1``, ``fedrcl.beta-0.5-seed-1``),
                                 each an ordinary run directory

Rules that keep a run's results safe:

* ``train`` never writes into a directory that holds any part of a run (it says to ``resume``);
  default names are unique even for runs started in the same second.
* ``train`` and ``resume`` hold an exclusive lock (``RUN_DIR/.lock``, ``flock``) for as long as
  they run; a second process is refused with the holder's pid. The kernel drops the lock when
  its holder dies, so a killed run never leaves a stale lock behind.
* Files that must never be seen half-written are replaced atomically. The JSONL files are
  appended a whole line at a time, but a process killed by the kernel mid-write can leave a
  torn last line: every reader keeps the lines that parse as JSON objects and skips the rest
  (``read_jsonl``), so all of them see the same records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import yaml

from fedjax_rcl.validation import ConfigError

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CLIENTS_FILE = "clients.jsonl"
COMMANDS_FILE = "commands.txt"
ENVIRONMENT_FILE = "environment.jsonl"
PLOT_FILE = "accuracy.png"
RESOURCES_FILE = "resources.json"
CHECKPOINTS_DIR = "checkpoints"
CLIENT_TABLE_DIR = "client_table"
LOCK_FILE = ".lock"
# What makes a directory hold a run, even one killed before its first round.
RUN_FILES = (CONFIG_FILE, METRICS_FILE, CHECKPOINTS_DIR)

__all__ = ["RUN_FILES", "RunDir", "atomic_write_lines", "atomic_write_text", "checkpoint_steps",
           "create_new", "grid_members", "holds_run", "jsonl_lines", "locked", "member_name",
           "read_jsonl", "resolve_new"]


def _records(path: Path, upto: int | None) -> Iterator[tuple[str, dict]]:
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed process (or a blank one)
        if not isinstance(record, dict):
            continue
        if upto is None or record.get("round", upto + 1) <= upto:
            yield line, record


def jsonl_lines(path: Path, upto: int | None = None) -> list[str]:
    """The complete lines of a JSONL file of a run (``metrics.jsonl``, ``clients.jsonl``), as
    written: each parses as a JSON object; any other line (a torn last line of a process killed
    while writing it) is skipped, and a missing file has none. With ``upto``, only the lines of
    rounds ``<= upto`` (a line without a round goes too): what a run resumed at that round
    keeps."""
    return [line for line, _ in _records(Path(path), upto)]


def read_jsonl(path: Path, upto: int | None = None) -> list[dict]:
    """The records of ``jsonl_lines(path, upto)``."""
    return [record for _, record in _records(Path(path), upto)]


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of the whole checkpoints in ``directory``, oldest first (none if it is
    absent), from the directory names alone: Orbax names a committed checkpoint by its step and
    writes one into a temporary directory (``<step>.orbax-checkpoint-tmp-<n>``) until then, so
    a save in progress or cut short is not one of them."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir()
                  if p.name.isascii() and p.name.isdigit() and p.is_dir())


def member_name(seed: int | None, key: str | None = None, value: float | None = None) -> str:
    """A grid member's directory name: ``seed-1``, ``fedrcl.beta-0.5``,
    ``fedrcl.beta-0.5-seed-1``."""
    parts = ([] if key is None else [f"{key}-{float(value):.12g}"]) + (
        [] if seed is None else [f"seed-{seed}"])
    return "-".join(parts)


def grid_members(seeds: list[int], key: str | None, values: list[float]
                 ) -> list[tuple[str, int | None, float | None]]:
    """``(name, seed or None, value or None)`` of each member of a grid, value by value,
    seed by seed."""
    return [(member_name(s, key, v), s, v) for v in (values if key is not None else [None])
            for s in (seeds or [None])]


@dataclasses.dataclass(frozen=True)
class RunDir:
    """A run directory: where each of its files is, and what can be read from them alone.

    Attributes:
      path: the directory (a ``str`` is taken as a path).
    """

    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def config(self) -> Path:
        """The resolved config (``config.yaml``)."""
        return self.path / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        """One JSON line per evaluation (``metrics.jsonl``)."""
        return self.path / METRICS_FILE

    @property
    def clients(self) -> Path:
        """One JSON line per round of per-client metrics (``clients.jsonl``)."""
        return self.path / CLIENTS_FILE

    @property
    def commands(self) -> Path:
        """Each process's command line (``commands.txt``)."""
        return self.path / COMMANDS_FILE

    @property
    def environment(self) -> Path:
        """Each process's machine and versions (``environment.jsonl``)."""
        return self.path / ENVIRONMENT_FILE

    @property
    def plot(self) -> Path:
        """The accuracy and loss curves (``accuracy.png``)."""
        return self.path / PLOT_FILE

    @property
    def resources(self) -> Path:
        """An MFCL run's resource counts (``resources.json``)."""
        return self.path / RESOURCES_FILE

    @property
    def client_table(self) -> Path:
        """A disk-held client state table and its snapshots (``client_table``; never
        committed, like the checkpoints)."""
        return self.path / CLIENT_TABLE_DIR

    @property
    def lock(self) -> Path:
        """The file ``locked`` holds (``.lock``)."""
        return self.path / LOCK_FILE

    def checkpoint_dir(self, stage: str | None = None) -> Path:
        """Where the checkpoints of ``stage`` live: ``checkpoints`` for a federated run (None),
        ``checkpoints/phase1`` and ``checkpoints/phase2`` for MFCL's phases."""
        top = self.path / CHECKPOINTS_DIR
        return top if stage is None else top / stage

    def steps(self, stage: str | None = None) -> list[int]:
        """The steps of the whole checkpoints of ``stage``, oldest first."""
        return checkpoint_steps(self.checkpoint_dir(stage))

    def holds_run(self) -> bool:
        """Whether the directory holds any part of a run (even one killed before its first
        round)."""
        return any((self.path / name).exists() for name in RUN_FILES)

    def metric_lines(self, upto: int | None = None) -> list[str]:
        """``metrics.jsonl``'s complete lines (of rounds ``<= upto``: ``jsonl_lines``)."""
        return jsonl_lines(self.metrics, upto)

    def read_metrics(self, upto: int | None = None) -> list[dict]:
        """``metrics.jsonl``'s complete lines as records, in order (``jsonl_lines``)."""
        return read_jsonl(self.metrics, upto)

    def client_lines(self, upto: int | None = None) -> list[str]:
        """``clients.jsonl``'s complete lines (of rounds ``<= upto``: ``jsonl_lines``)."""
        return jsonl_lines(self.clients, upto)

    def read_clients(self) -> list[dict]:
        """``clients.jsonl``'s complete lines as records, in order."""
        return read_jsonl(self.clients)

    def last_round(self) -> int:
        """The last round ``metrics.jsonl`` records (0: none yet; an MFCL run's last phase-1
        evaluation)."""
        return next((r["round"] for r in reversed(self.read_metrics()) if "round" in r), 0)

    def members(self) -> list[RunDir]:
        """A grid's member directories (its ``config.yaml`` names ``seeds`` or a ``sweep``), in
        the grid's order; none for a single run or a directory without a readable config."""
        try:
            config = yaml.safe_load(self.config.read_text())
        except (OSError, yaml.YAMLError):
            return []
        if not isinstance(config, dict):
            return []
        seeds, sweep = config.get("seeds") or [], config.get("sweep") or {}
        key = sweep.get("key") if isinstance(sweep, dict) else None
        if not seeds and key is None:
            return []
        return [RunDir(self.path / name)
                for name, _, _ in grid_members(list(seeds), key, list(sweep.get("values") or []))]

    def is_mfcl(self) -> bool:
        """Whether this is an MFCL run (its checkpoints are per phase)."""
        return self.checkpoint_dir("phase1").is_dir()

    def round_reached(self, *, partial: bool = False) -> int | None:
        """The round a finished stretch of training reached, read from the directory alone.

        A federated run: its newest complete checkpoint. A grid: the oldest such among its
        members (the round ``resume`` continues all of them from). An MFCL run: its newest
        phase-1 checkpoint once the probe's line is written; before that a resume still has
        phases to run, and the round is not known unless ``partial`` (then it is that
        checkpoint's round all the same). None when it is not known (no checkpoint yet).
        """
        members = self.members()
        if members:
            reached = [m.round_reached(partial=partial) for m in members]
            return None if None in reached else min(reached)
        if self.is_mfcl():
            if not partial and not any(r.get("phase") == "probe" for r in self.read_metrics()):
                return None
            steps = self.steps("phase1")
        else:
            steps = self.steps()
        return steps[-1] if steps else None


class RunNaming(Protocol):
    """What names a run directory: a run config's ``run_dir``, ``dataset`` and ``algorithm``."""

    run_dir: str | None
    dataset: str
    algorithm: str


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds any part of a run (``RunDir.holds_run``)."""
    return RunDir(run_dir).holds_run()


def _refuse_existing(run_dir: Path) -> None:
    raise ConfigError([f"run_dir={str(run_dir)!r}: already holds a run; continue it with "
                       f"'fedjax-rcl resume {run_dir}' (from Python: "
                       f"fedjax_rcl.resume({str(run_dir)!r})), or choose another run_dir (left "
                       "out, every run gets a new one under runs/)"])


def resolve_new(cfg: RunNaming) -> Path | None:
    """The directory a new run will use: ``cfg.run_dir``, refused if it holds a run; None for
    a default name (made unique by ``create_new``). Checked before any work is done."""
    if not cfg.run_dir:
        return None
    run_dir = Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError([f"run_dir={str(run_dir)!r}: exists and is not a directory"])
    if holds_run(run_dir):
        _refuse_existing(run_dir)
    return run_dir


def _default_name(cfg: RunNaming) -> str:
    dataset = cfg.dataset.split(":", 1)[0]
    # The random suffix keeps two runs started in the same second apart.
    return f"{dataset}-{cfg.algorithm}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def create_new(cfg: RunNaming, run_dir: Path | None) -> Path:
    """Creates the run directory (a unique default one when ``run_dir`` is None)."""
    try:
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            return run_dir
        Path("runs").mkdir(exist_ok=True)
        while True:  # mkdir without exist_ok is atomic: exactly one process gets a name
            run_dir = Path("runs") / _default_name(cfg)
            with contextlib.suppress(FileExistsError):
                run_dir.mkdir()
                return run_dir
    except OSError as e:
        raise ConfigError([f"run_dir={str(run_dir)!r}: cannot create ({e.strerror})"]) from None


@contextlib.contextmanager
def locked(run_dir: Path, *, enabled: bool = True, new_run: bool = False) -> Iterator[None]:
    """Holds ``run_dir``'s exclusive lock for the ``with`` block.

    Args:
      run_dir: an existing run directory.
      enabled: False on the non-primary processes of a multi-process run (they share the
        directory with process 0, which holds the lock for all of them).
      new_run: the caller is starting a run here: under the lock, re-check that no other
        process has started one since ``resolve_new`` looked.

    Raises:
      ConfigError: another process holds the lock (the message names its pid), or, with
        ``new_run``, the directory now holds a run.
    """
    if not enabled:
        yield
        return
    path = RunDir(run_dir).lock
    try:
        f = open(path, "a+")  # closed in the finally below: the lock lives as long as it
    except OSError as e:
        raise ConfigError([f"run_dir={str(run_dir)!r}: cannot lock ({e.strerror})"]) from None
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise ConfigError([f"run_dir={str(run_dir)!r}: in use by process {holder} (a "
                               "fedjax-rcl train or resume); wait for it to end or stop it "
                               "first"]) from None
        if new_run and holds_run(run_dir):
            _refuse_existing(run_dir)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield
    finally:
        f.close()  # releases the lock


def atomic_write_text(path: Path, text: str) -> None:
    """Writes a file so that a reader (or a resumed run) never sees half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_lines(path: Path, lines: Iterable[str]) -> None:
    """Replaces a JSONL file of a run with ``lines`` (each without its newline), atomically."""
    atomic_write_text(path, "".join(f"{x}\n" for x in lines))

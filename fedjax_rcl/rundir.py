"""The run directory: its name, its files, and the lock that keeps a second process out.

A run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one line per
evaluation, appended as it comes), ``checkpoints/`` (Orbax) and plots. Rules that keep a run's
results safe:

* ``train`` never writes into a directory that holds any part of a run (it says to ``resume``);
  default names are unique even for runs started in the same second.
* ``train`` and ``resume`` hold an exclusive lock (``RUN_DIR/.lock``, ``flock``) for as long as
  they run; a second process is refused with the holder's pid. The kernel drops the lock when
  its holder dies, so a killed run never leaves a stale lock behind.
* Files that must never be seen half-written are replaced atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from fedjax_rcl.validation import ConfigError

RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints")
LOCK_FILE = ".lock"

__all__ = ["RUN_FILES", "atomic_write_text", "create_new", "holds_run", "locked",
           "read_metrics_upto", "resolve_new"]


class RunNaming(Protocol):
    """What names a run directory: a run config's ``run_dir``, ``dataset`` and ``algorithm``."""

    run_dir: str | None
    dataset: str
    algorithm: str


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds any part of a run (even one killed before its first round)."""
    return any((run_dir / name).exists() for name in RUN_FILES)


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
    path = run_dir / LOCK_FILE
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


def read_metrics_upto(path: Path, last_round: int) -> list[str]:
    """The lines of ``metrics.jsonl`` for rounds ``<= last_round``; a torn last line (a run
    killed while writing it) is dropped."""
    if not path.exists():
        return []
    keep = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("round", last_round + 1) <= last_round:
            keep.append(line)
    return keep

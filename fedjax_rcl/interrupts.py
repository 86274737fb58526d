"""Clean interrupts: SIGINT or SIGTERM at any moment ends a command with status 130 or 143, one
line naming the last complete checkpoint and the exact resume command, and no traceback.

Why not Python's default ``KeyboardInterrupt``: it is raised only when the main thread returns
to the interpreter, so during a long XLA compile or a fused call it arrives late or is
swallowed, and unwinding the interpreter while XLA's threads still run has ended in
segmentation faults (exit 139). Here Python's C-level signal handler writes the signal number to
a wakeup pipe at once, even while the main thread is inside XLA; a watcher thread reads it,
waits for any critical section in progress (a checkpoint being made durable, a metrics line
being written), prints the status line and ends the process with ``os._exit``: nothing unwinds
through XLA, and what is on disk is exactly what the status line says.

Usage (the command line does this)::

    interrupts.install()
    interrupts.set_status("run_dir runs/x: last complete checkpoint: round 10; continue with: "
                          "fedjax-rcl resume runs/x")
    with interrupts.critical():
        ckpt.save(...); ckpt.wait()
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["critical", "install", "resume_status", "set_status", "work_done"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_lock = threading.RLock()  # held by the main thread around critical sections
_status = ["interrupted before the run started; nothing was written"]
_installed = [False]


def set_status(message: str) -> None:
    """What the line printed on an interrupt says about the state on disk."""
    _status[0] = message


def resume_status(run_dir, where: int | str | None) -> None:
    """Sets the status of a run directory whose newest complete checkpoint is ``where``: a
    round number, a label such as ``"phase 2 epoch 3"``, or None (none yet; resume then
    starts the run from the beginning)."""
    if isinstance(where, int):
        where = f"round {where}"
    saved = ("no complete checkpoint yet (resume starts from round 0)" if where is None
             else f"last complete checkpoint: {where}")
    set_status(f"run_dir {run_dir}: {saved}; continue with: fedjax-rcl resume {run_dir}")


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """A block an interrupt waits for (writing a checkpoint or a metrics line)."""
    with _lock:
        yield


def _watch(fd: int) -> None:
    while True:
        data = os.read(fd, 1)
        if data and data[0] in {int(s) for s in SIGNALS}:
            break
    signum = data[0]
    with _lock:  # let a checkpoint or a metrics line in progress finish
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        name = signal.Signals(signum).name
        os.write(2, f"\nfedjax-rcl: {name}: stopped; {_status[0]}\n".encode())
        os._exit(128 + signum)


def install() -> None:
    """Routes SIGINT and SIGTERM to the watcher (main thread only; idempotent)."""
    if _installed[0] or threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for s in SIGNALS:
        # A Python-level handler must exist for the C handler to write the wakeup byte; the
        # watcher thread does the work, so this one only keeps KeyboardInterrupt away.
        signal.signal(s, lambda signum, frame: None)
    threading.Thread(target=_watch, args=(read_fd,), name="fedjax-rcl-interrupts",
                     daemon=True).start()
    _installed[0] = True


def work_done() -> None:
    """The command's work is over and on disk: SIGINT and SIGTERM are ignored from here on,
    while the interpreter shuts down, so that the exit status is the command's own.

    Why: CPython's finalisation first stops daemon threads (the watcher can no longer run),
    then restores the default action of every signal that has a Python handler
    (``_PySignal_Fini``) but leaves ``SIG_IGN`` alone; a signal during the rest of the
    shutdown (module teardown, XLA's runtime among it) would kill a process whose run had
    finished, with no status line and an exit status that says it was killed. CI saw it once:
    a SIGTERM sent at a random moment of a 5-round `train` arrived after the run had finished
    (exit -15, the run directory complete)."""
    if not _installed[0] or threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)

"""The command line's standard output and error when their reader goes away.

``fedjax-rcl train ... | head -3`` closed the pipe after three lines; the next line the run
printed raised ``BrokenPipeError`` (Python ignores SIGPIPE, so a write to a pipe without a
reader is an exception, not a quiet death): a traceback, and the run ended before it trained.
A command's records are its files (a run directory's metrics and checkpoints, a report's
tables), not the lines it prints, so here a stream whose reader has gone is discarded (its file
descriptor pointed at ``/dev/null``, so that later writes, Python's buffered ones and the C
level's alike, go nowhere) and the command goes on; one line on the other stream, if that one
is still open, says so.

Usage (the command line does this)::

    console.keep_going_without_readers()
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

__all__ = ["keep_going_without_readers"]

# A pipe without a reader (EPIPE), and a terminal that has gone (EIO: the ssh session dropped;
# the run saves and stops on the SIGHUP that comes with it, ``fedjax_rcl.interrupts``).
_READER_GONE = (errno.EPIPE, errno.EIO)


class _Tolerant:
    """A text stream that, once a write or flush meets a closed pipe or a terminal that has
    gone, discards what follows."""

    def __init__(self, stream, name: str, notify) -> None:
        self._stream = stream
        self._name = name
        self._notify = notify
        self.gone = False

    def _lost(self) -> None:
        self.gone = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        self._notify(self._name)

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except OSError as e:
                if e.errno not in _READER_GONE:
                    raise
                self._lost()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except OSError as e:
                if e.errno not in _READER_GONE:
                    raise
                self._lost()
        else:  # what the buffer held when the pipe closed goes to /dev/null
            with contextlib.suppress(OSError, ValueError):
                self._stream.flush()

    def __getattr__(self, name: str):  # fileno, isatty, encoding, buffer, ...
        return getattr(self._stream, name)


def tolerant(stdout, stderr) -> tuple[_Tolerant, _Tolerant]:
    """``stdout`` and ``stderr`` wrapped: a closed one is discarded, with one line on the other
    (if it is still open) naming it."""
    streams: dict[str, _Tolerant] = {}

    def notify(name: str) -> None:
        other = streams["stderr" if name == "stdout" else "stdout"]
        if not other.gone:
            what = {"stdout": "output", "stderr": "error"}[name]
            other.write(f"fedjax-rcl: standard {what} closed by its reader; the command goes "
                        "on without it (its results are in its files)\n")
            other.flush()

    streams["stdout"] = _Tolerant(stdout, "stdout", notify)
    streams["stderr"] = _Tolerant(stderr, "stderr", notify)
    return streams["stdout"], streams["stderr"]


def keep_going_without_readers() -> None:
    """``sys.stdout`` and ``sys.stderr`` as ``tolerant`` streams (idempotent)."""
    if not isinstance(sys.stdout, _Tolerant) and sys.stdout is not None \
            and sys.stderr is not None:
        sys.stdout, sys.stderr = tolerant(sys.stdout, sys.stderr)

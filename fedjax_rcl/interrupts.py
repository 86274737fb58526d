"""Clean interrupts: SIGINT or SIGTERM at any moment ends a command with status 130 or 143, one
line naming the last complete checkpoint and the exact resume command, and no traceback. So
does SIGHUP (status 129: the terminal closed, an ssh session dropped), unless the process
started with it ignored (``nohup``), which stays so: its default action killed the process
at once, losing the rounds done since the last checkpoint.

Why not Python's default ``KeyboardInterrupt``: it is raised only when the main thread returns
to the interpreter, so during a long XLA compile or a fused call it arrives late or is
swallowed, and unwinding the interpreter while XLA's threads still run has ended in
segmentation faults (exit 139). Here Python's C-level signal handler writes the signal number to
a wakeup pipe at once, even while the main thread is inside XLA; a watcher thread reads it,
waits for any critical section in progress (a checkpoint being made durable, a metrics line
being written), prints the status line and ends the process with ``os._exit``: nothing unwinds
through XLA, and what is on disk is exactly what the status line says.

Inside the run loop's blocks (``saving_on_request``) the host holds completed rounds that may
not be checkpointed yet, so a first signal does not end the process there: it asks the loop
to stop at the end of the block in flight (the compiled rounds between two evaluations are
one call; the state they start from was donated to it, so the last round whose state the host
can hold is the block's last), where the loop saves that round and then stops with the same
status and line (``requested``, ``stop``). A second signal ends the process at once, as
anywhere outside the blocks; but the same signal again within ``REPEAT_WINDOW_S`` of the first
is the same request delivered twice, not a second one: GNU ``timeout`` sends its signal to the
process and then to the whole process group, so a run under ``timeout -s INT`` receives two
SIGINTs microseconds apart, and treating the copy as a second signal stopped it without
saving. (The loop defers only in a single-process run: processes of a
multi-process run would each stop at the block their own signal reached, leaving the others
waiting in the next block's collectives.)

For tests, ``FEDJAX_RCL_TEST_SIGNAL`` makes the process signal itself at a named moment, so
that "killed during a save" is certain rather than hoped for: ``phase=saving,round=3,
signal=KILL`` (``test_point``; phases ``compiling``, ``training``, ``evaluating``,
``saving``, ``between``; ``times=2`` sends it twice as a person would, the second after the
watcher acted on the first and more than ``REPEAT_WINDOW_S`` later; ``burst=2`` sends it twice
back to back, as ``timeout`` does; ``to=parent`` sends it to the parent process instead, as a
signal to a suite that runs this run as its child, ``to=group`` to the whole process group, as
Ctrl-C does). Unset, ``test_point`` does nothing.

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
import time
from collections.abc import Iterator

__all__ = ["critical", "forwarding_to", "install", "requested", "resume_status",
           "saving_on_request", "set_status", "stop", "test_point", "work_done"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)  # always handled once installed
HANGUP = signal.SIGHUP  # handled unless ignored when the process started (nohup)
_handled: list[int] = []  # what ``install`` routes to the watcher
_lock = threading.RLock()  # held by the main thread around critical sections
_status = ["interrupted before the run started; nothing was written"]
_installed = [False]
_flags = threading.Lock()  # guards _deferring, _requested(_at) and _child between threads
_deferring = [False]  # the run loop will save the round in flight on a request
_requested: list[int | None] = [None]  # the first signal, while deferring
_requested_at = [0.0]  # when the watcher read it (time.monotonic)
# The same signal again sooner than this after the first is a copy of it (GNU timeout signals
# the process, then its process group), not a person's second Ctrl-C.
REPEAT_WINDOW_S = 0.5
_child: list[int | None] = [None]  # a child command's pid while this process waits for it
_received = threading.Event()  # the watcher has acted on a signal (for ``test_point``)
TEST_SIGNAL_ENV = "FEDJAX_RCL_TEST_SIGNAL"
PHASES = ("compiling", "training", "evaluating", "saving", "between")


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


def _exit_now(signum: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    name = signal.Signals(signum).name
    _say(f"\nfedjax-rcl: {name}: stopped; {_status[0]}\n")
    os._exit(128 + signum)


def _say(text: str) -> None:
    """A line on standard error, straight to its file descriptor (the watcher may not wait
    for Python's stream); lost, not raised, when no one reads it any more (a closed pipe must
    not keep the process from stopping)."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


def _watch(fd: int) -> None:
    numbers = {int(sig) for sig in _handled}
    while True:
        data = os.read(fd, 64)
        now = time.monotonic()
        # Bytes read together arrived together: one request per signal.
        for signum in dict.fromkeys(b for b in data if b in numbers):
            _on_signal(signum, now)


def _on_signal(signum: int, now: float) -> None:
    """What the watcher does with a signal read at ``now`` (``time.monotonic``)."""
    with _flags:
        first = _requested[0]
        if first == signum and now - _requested_at[0] < REPEAT_WINDOW_S:
            return  # the first request delivered twice
        child = _child[0]
        second = first is not None
        defer = (_deferring[0] or child is not None) and not second
        if defer:
            _requested[0], _requested_at[0] = signum, now
    if child is not None:  # passed on; this process stops once the child has
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)
        _received.set()
        return
    if second:  # the second signal: at once, whatever is in progress
        _exit_now(signum)
    if defer:
        name = signal.Signals(signum).name
        _say(f"\nfedjax-rcl: {name}: saving the round in progress, then stopping "
             "(a second SIGINT or SIGTERM stops at once)\n")
        _received.set()
        return
    _received.set()
    with _lock:  # let a checkpoint or a metrics line in progress finish
        _exit_now(signum)


@contextlib.contextmanager
def saving_on_request() -> Iterator[None]:
    """The run loop's blocks: a first signal inside sets ``requested`` instead of ending the
    process; the loop saves the round it reaches and calls ``stop``. Leaving the block with
    a request pending (the stage's end, an error) stops the same way."""
    with _flags:
        _deferring[0] = True
    try:
        yield
    finally:
        with _flags:
            _deferring[0] = False
            pending = _requested[0]
        if pending is not None:
            stop()


@contextlib.contextmanager
def forwarding_to(pid: int) -> Iterator[None]:
    """While this process waits for a child command (``suite run``'s runs): a signal is passed
    on to the child, which saves the round it reaches and stops as any run does (the copy it
    may also have had from the process group is one request to it, ``REPEAT_WINDOW_S``; a
    second signal stops it at once), and this process does not stop by itself: once the
    child has ended, the caller calls ``stop`` if ``requested``. Without it, a ``suite run``
    stopped by Ctrl-C or ``timeout`` printed "nothing was written" and ended before its run
    had saved; and a signal sent to the suite's process alone never reached the run."""
    with _flags:
        _child[0] = pid
    try:
        yield
    finally:
        with _flags:
            _child[0] = None


def requested() -> int | None:
    """The signal that asked the run loop to save and stop, or None."""
    return _requested[0]


def stop(signum: int | None = None) -> None:
    """Ends the process as the requested signal (or ``signum``, a signal another process was
    stopped by) asks (``128 + signal``), with the status line; the caller has saved what it
    holds."""
    with _lock:
        _exit_now(_requested[0] or signum or signal.SIGINT)


# Where a test signal goes: this process, its parent, or its process group.
_TARGETS = {"self": lambda s: os.kill(os.getpid(), s),
            "parent": lambda s: os.kill(os.getppid(), s),
            "group": lambda s: os.killpg(os.getpgid(0), s)}


def _test_plan() -> dict | None:
    text = os.environ.get(TEST_SIGNAL_ENV)
    if not text:
        return None
    plan = dict(item.split("=", 1) for item in text.split(",") if item)
    if (plan.get("phase") not in PHASES or "signal" not in plan
            or plan.get("to", "self") not in _TARGETS):
        raise ValueError(f"{TEST_SIGNAL_ENV}={text!r}: phase= one of {', '.join(PHASES)}, "
                         "signal= INT, TERM, HUP or KILL, optional round=, times=, burst= and "
                         f"to= one of {', '.join(_TARGETS)}")
    return plan


_plan: list = []


def _due(phase: str, first: int | None, last: int | None) -> dict | None:
    """The test plan if it names this moment and has not fired yet, else None."""
    if not _plan:
        _plan.append(_test_plan())
    plan = _plan[0]
    if plan is None or plan.get("fired") or plan["phase"] != phase:
        return None
    if "round" in plan and first is not None:
        wanted = int(plan["round"])
        if not first <= wanted <= (first if last is None else last):
            return None
    return plan


def test_kill_due(phase: str, first: int | None = None, last: int | None = None) -> bool:
    """Whether ``test_point`` is about to SIGKILL the process at this moment (a test asked
    for it): a save can then leave the on-disk state of a save killed in flight for certain,
    instead of racing its background commit."""
    plan = _due(phase, first, last)
    return plan is not None and plan["signal"] == "KILL"


def test_point(phase: str, first: int | None = None, last: int | None = None) -> None:
    """A named moment of the run (rounds ``first..last``): with ``FEDJAX_RCL_TEST_SIGNAL``
    naming it, the process sends the signal there (once per process; to itself unless the plan
    says ``to=``) and goes on once its watcher has acted on it (a signal to the parent reaches
    it when the parent passes it on)."""
    plan = _due(phase, first, last)
    if plan is None:
        return
    plan["fired"] = True
    signum = getattr(signal, "SIG" + plan["signal"])
    watched = signum in _handled
    for i in range(int(plan.get("times", 1))):
        if i and watched:  # a person's second signal: later than a repeat of the first
            time.sleep(2 * REPEAT_WINDOW_S)
        _received.clear()
        for _ in range(int(plan.get("burst", 1))):
            _TARGETS[plan.get("to", "self")](signum)
        if watched:
            _received.wait(timeout=120)


def install() -> None:
    """Routes SIGINT, SIGTERM and (unless it is ignored) SIGHUP to the watcher (main thread
    only; idempotent)."""
    if _installed[0] or threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    _handled[:] = [*SIGNALS, *([HANGUP] if signal.getsignal(HANGUP) == signal.SIG_DFL else [])]
    for s in _handled:
        # A Python-level handler must exist for the C handler to write the wakeup byte; the
        # watcher thread does the work, so this one only keeps KeyboardInterrupt away.
        signal.signal(s, lambda signum, frame: None)
    threading.Thread(target=_watch, args=(read_fd,), name="fedjax-rcl-interrupts",
                     daemon=True).start()
    _installed[0] = True


def work_done() -> None:
    """The command's work is over and on disk: the handled signals are ignored from here on,
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
    for s in _handled:
        signal.signal(s, signal.SIG_IGN)

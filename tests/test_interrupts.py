"""Signals while the interpreter shuts down, after a command's work is on disk."""

import signal
import subprocess
import sys

import pytest

# A module global's __del__ runs during module teardown, after CPython has restored the default
# action of signals with a Python handler (_PySignal_Fini) and the watcher thread has stopped:
# the window in which a Ctrl-C or SIGTERM once killed a `train` whose run had finished.
SCRIPT = """
import os, signal, sys
from fedjax_rcl import interrupts
interrupts.install()
class SignalAtTeardown:
    def __del__(self):
        os.kill(os.getpid(), signal.{sig})
        print("shut down normally", flush=True)
keep = SignalAtTeardown()
if sys.argv[1] == "work done":
    interrupts.work_done()
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_interpreter_shutdown_after_the_work_keeps_the_exit_status(sig):
    script = SCRIPT.format(sig=sig.name)
    # Without work_done the default action kills the process: the window is real.
    killed = subprocess.run([sys.executable, "-c", script, "still working"],
                            capture_output=True, text=True, timeout=60)
    assert killed.returncode == -sig, (killed.returncode, killed.stderr)
    done = subprocess.run([sys.executable, "-c", script, "work done"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout == "shut down normally\n" and done.stderr == ""


def test_work_done_before_install_or_off_the_main_thread_changes_nothing():
    import threading

    from fedjax_rcl import interrupts

    before = {s: signal.getsignal(s) for s in interrupts.SIGNALS}
    t = threading.Thread(target=interrupts.work_done)
    t.start()
    t.join()
    if not interrupts._installed[0]:
        interrupts.work_done()
    assert {s: signal.getsignal(s) for s in interrupts.SIGNALS} == before

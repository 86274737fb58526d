"""Signals at named moments of a run, and while the interpreter shuts down after the work.

Every trial hits its moment through the run's test hook (``FEDJAX_RCL_TEST_SIGNAL``: the
process signals itself at the named phase and round), never by timing: a kill "during a save"
is one, and every trial asserts the exit status, the line, what is on disk, and that resuming
gives the uninterrupted run's metrics and state, nothing lost and nothing duplicated.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import chex
import pytest

from fedjax_rcl.checkpoint import saved_steps
from fedjax_rcl.cli import main
from fedjax_rcl.config import load_config
from fedjax_rcl.training import restore_run, train

# 6 rounds of FedAvg on 4 digits clients, checkpoints at rounds 0, 3 and 6: a signal at round
# 4 or 5 finds completed rounds that no checkpoint holds.
ARGS = ["dataset=digits", "algorithm=fedavg", "num_clients=4", "participation=0.5",
        "local_epochs=1", "partition=iid", "rounds=6", "checkpoint_every=3"]

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


def _metrics(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]  # no timings


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its metrics and final checkpoint."""
    run = tmp_path_factory.mktemp("ref") / "run"
    train(load_config(None, [*ARGS, f"run_dir={run}"]), progress=False, log=lambda s: None)
    return _metrics(run), restore_run(run)[1]


# Starts its arguments with SIGHUP at its default disposition, as a command typed at a terminal
# starts, whatever the tests were started under (``nohup pytest`` leaves it ignored, and an
# ignored disposition is inherited).
_HANGUP_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
                   "os.execvp(sys.argv[1], sys.argv[1:])")


def _signalled(run, plan, prefix=()):
    """``fedjax-rcl train`` that signals itself as ``plan`` says (the CLI process itself:
    its handlers are installed only there), run by ``prefix`` (``nohup``) if given."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "FEDJAX_RCL_TEST_SIGNAL": plan}
    return subprocess.run([sys.executable, "-c", _HANGUP_DEFAULT, *prefix, sys.executable, "-m",
                           "fedjax_rcl", "train", *ARGS, f"run_dir={run}", "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=600)


def _resumes_to_the_reference(run, reference):
    metrics, state = reference
    assert main(["resume", str(run), "--no-progress"]) == 0
    assert _metrics(run) == metrics  # nothing lost, nothing duplicated
    restored = restore_run(run)[1]
    assert restored.step == state.step
    chex.assert_trees_all_equal(restored.state, state.state)  # bitwise


def _recorded(run) -> list[int]:
    path = Path(run) / "metrics.jsonl"
    return [json.loads(x)["round"] for x in path.read_text().splitlines()] if path.exists() else []


# (moment, hook, newest checkpoint on disk after the signal): a signal inside a block waits for
# the block's round and saves it; outside (compiling) nothing newer than round 0 exists.
MOMENTS = [
    ("compiling", "phase=compiling", 0),
    ("training round 5", "phase=training,round=5", 5),
    ("evaluating round 5", "phase=evaluating,round=5", 5),
    ("saving round 3", "phase=saving,round=3", 3),
    ("between rounds 4 and 5", "phase=between,round=4", 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("moment, hook, saved", MOMENTS, ids=[m[0] for m in MOMENTS])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_sigint_and_sigterm_save_the_last_completed_round_and_resume_exactly(
        reference, tmp_path, moment, hook, saved, sig):
    run = tmp_path / "run"
    proc = _signalled(run, f"{hook},signal={sig.name[3:]}")
    assert proc.returncode == 128 + sig, (moment, proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Segmentation" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    where = f"last complete checkpoint: round {saved}"
    assert last == (f"fedjax-rcl: {sig.name}: stopped; run_dir {run}: {where}; continue "
                    f"with: fedjax-rcl resume {run}"), last
    assert saved_steps(run / "checkpoints")[-1] == saved
    assert _recorded(run) == list(range(1, saved + 1))  # every recorded round is saved
    _resumes_to_the_reference(run, reference)


@pytest.mark.slow
def test_a_second_signal_stops_at_once_without_saving(reference, tmp_path):
    run = tmp_path / "run"
    proc = _signalled(run, "phase=training,round=5,signal=INT,times=2")
    assert proc.returncode == 130, proc.stderr[-3000:]
    err = [line for line in proc.stderr.splitlines() if line]
    assert err[-2].startswith("fedjax-rcl: SIGINT: saving the round in progress, then stopping")
    assert err[-1].endswith(f"last complete checkpoint: round 3; continue with: fedjax-rcl "
                            f"resume {run}"), err[-1]
    assert saved_steps(run / "checkpoints")[-1] == 3
    _resumes_to_the_reference(run, reference)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_signal_sent_twice_at_once_is_one_request(reference, tmp_path, sig):
    """GNU ``timeout`` sends its signal to the process and then to its process group: a run
    under ``timeout -s INT`` received two SIGINTs microseconds apart and stopped at once,
    without saving the rounds it had trained. The copy is one request: the round is saved."""
    run = tmp_path / "run"
    proc = _signalled(run, f"phase=training,round=5,signal={sig.name[3:]},burst=2")
    assert proc.returncode == 128 + sig, proc.stderr[-3000:]
    err = [line for line in proc.stderr.splitlines() if line]
    assert err[-1] == (f"fedjax-rcl: {sig.name}: stopped; run_dir {run}: last complete "
                       f"checkpoint: round 5; continue with: fedjax-rcl resume {run}"), err[-1]
    assert saved_steps(run / "checkpoints")[-1] == 5
    _resumes_to_the_reference(run, reference)


@pytest.mark.slow
def test_a_hangup_saves_the_round_unless_the_run_was_started_under_nohup(reference, tmp_path):
    """SIGHUP (the terminal closed, an ssh session dropped) killed the run at once, losing the
    rounds since the last checkpoint; now it saves the round in flight as SIGTERM does (status
    129). A process started with SIGHUP ignored (``nohup``) keeps ignoring it."""
    run = tmp_path / "run"
    proc = _signalled(run, "phase=training,round=5,signal=HUP")
    assert proc.returncode == 129, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"fedjax-rcl: SIGHUP: stopped; run_dir {run}: last complete checkpoint: "
                    f"round 5; continue with: fedjax-rcl resume {run}"), last
    assert saved_steps(run / "checkpoints")[-1] == 5
    _resumes_to_the_reference(run, reference)
    under_nohup = tmp_path / "nohup"
    proc = _signalled(under_nohup, "phase=training,round=5,signal=HUP", prefix=["nohup"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _metrics(under_nohup) == reference[0]  # the whole run, as if never signalled


def test_the_watcher_takes_a_copy_of_the_first_signal_as_the_same_request(monkeypatch):
    """The decision alone, at given times: inside a block the first signal is a request; the
    same signal within ``REPEAT_WINDOW_S`` is its copy (ignored); another signal, or the same
    one later, stops at once."""
    from fedjax_rcl import interrupts

    class Exited(Exception):
        pass

    def exit_now(signum):  # as os._exit, it does not return
        raise Exited(signum)

    monkeypatch.setattr(interrupts, "_exit_now", exit_now)
    monkeypatch.setattr(interrupts, "_deferring", [True])
    monkeypatch.setattr(interrupts, "_requested", [None])
    monkeypatch.setattr(interrupts, "_requested_at", [0.0])
    window = interrupts.REPEAT_WINDOW_S
    interrupts._on_signal(signal.SIGINT, 100.0)
    assert interrupts.requested() == signal.SIGINT
    interrupts._on_signal(signal.SIGINT, 100.0 + 0.9 * window)  # the copy: no exit
    with pytest.raises(Exited) as e:  # another signal
        interrupts._on_signal(signal.SIGTERM, 100.0 + 0.1 * window)
    assert e.value.args == (signal.SIGTERM,)
    with pytest.raises(Exited) as e:  # a person's second Ctrl-C
        interrupts._on_signal(signal.SIGINT, 100.0 + 1.1 * window)
    assert e.value.args == (signal.SIGINT,)
    assert interrupts.requested() == signal.SIGINT  # the request stays the first one


@pytest.mark.slow
@pytest.mark.parametrize("hook, saved", [("phase=saving,round=3", 0),
                                         ("phase=saving,round=6", 3),
                                         ("phase=training,round=5", 3)],
                         ids=["saving round 3", "saving round 6", "training round 5"])
def test_sigkill_during_a_save_or_a_round_resumes_to_the_same_result(reference, tmp_path,
                                                                       hook, saved):
    run = tmp_path / "run"
    proc = _signalled(run, f"{hook},signal=KILL")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    if "saving" in hook:  # killed with the save in flight: Orbax's temporary directory
        assert any("tmp" in p.name for p in (run / "checkpoints").iterdir())
    assert saved_steps(run / "checkpoints")[-1] == saved
    _resumes_to_the_reference(run, reference)


def test_while_a_child_command_runs_signals_are_passed_on_not_acted_on(monkeypatch):
    """``suite run`` waiting for a run: each signal goes on to the child (a copy of the first,
    within ``REPEAT_WINDOW_S``, once), this process records the request and does not exit."""
    from fedjax_rcl import interrupts

    sent = []

    def exit_now(signum):
        raise AssertionError(f"exited on {signum}")

    monkeypatch.setattr(interrupts, "_exit_now", exit_now)
    monkeypatch.setattr(interrupts.os, "kill", lambda pid, signum: sent.append((pid, signum)))
    monkeypatch.setattr(interrupts, "_deferring", [False])
    monkeypatch.setattr(interrupts, "_requested", [None])
    monkeypatch.setattr(interrupts, "_requested_at", [0.0])
    window = interrupts.REPEAT_WINDOW_S
    with interrupts.forwarding_to(4242):
        interrupts._on_signal(signal.SIGINT, 100.0)
        interrupts._on_signal(signal.SIGINT, 100.0 + 0.5 * window)  # timeout's copy
        interrupts._on_signal(signal.SIGINT, 100.0 + 2 * window)  # a second Ctrl-C
    assert sent == [(4242, signal.SIGINT), (4242, signal.SIGINT)]
    assert interrupts.requested() == signal.SIGINT
    assert interrupts._child == [None]  # left when the child has ended

"""``resume`` of a run already past the rounds asked for changes nothing; ``eval`` says which
checkpoint it evaluated, falls back from a damaged newest one with one warning line (recorded
in its JSON), and with ``--strict`` refuses to."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fedjax_rcl
from fedjax_rcl.cli import main


@pytest.fixture
def finished(tiny_run):
    """The tests' shared tiny run (conftest): 4 rounds, checkpoints at 0, 2 and 4."""
    return tiny_run


def _snapshot(run: Path) -> dict:
    """Every file of a run directory: its bytes and modification time."""
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("rounds", [2, 4])
def test_resume_to_a_round_already_reached_does_nothing(finished, tmp_path, capsys, rounds):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = _snapshot(run)
    assert main(["resume", str(run), f"rounds={rounds}", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out == f"nothing to do: {run} is at round 4\n"  # no loading, no compiling
    assert _snapshot(run) == before  # config.yaml still says rounds: 4
    assert "rounds: 4" in (run / "config.yaml").read_text()
    # From Python: the run read back, untouched.
    again = fedjax_rcl.resume(run, f"rounds={rounds}")
    assert [r["round"] for r in again.metrics] == [1, 2, 3, 4] and again.config.rounds == 4
    assert _snapshot(run) == before


def test_eval_says_which_checkpoint_it_evaluated(finished, capsys):
    assert main(["eval", str(finished)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["round"] == 4 and out["checkpoint"] == str(finished / "checkpoints" / "4")
    assert "fell_back_from" not in out
    assert captured.err == f"fedjax-rcl: evaluated {finished} at round 4 (its newest checkpoint)\n"


def _damage_arrays(checkpoint: Path) -> None:
    """Truncates the array store of a checkpoint (its tensorstore files) to a third."""
    files = [p for p in (checkpoint / "state").rglob("*")
             if p.is_file() and p.parent.name == "d"]
    assert files
    for p in files:
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 3)


@pytest.mark.slow  # two command-line processes (CI's second step)
def test_eval_of_a_damaged_newest_checkpoint_is_one_warning_recorded_in_the_json(finished,
                                                                               tmp_path):
    """The command line itself (a subprocess: Orbax's failed reads report on their own threads
    after the restore has failed, into the process's standard error)."""
    run = tmp_path / "damaged"
    shutil.copytree(finished, run)
    _damage_arrays(run / "checkpoints" / "4")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "fedjax_rcl", "eval", str(run)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["round"] == 2 and out["fell_back_from"] == 4 and out["reason"]
    assert out["checkpoint"] == str(run / "checkpoints" / "2")
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"fedjax-rcl: warning: {run}: the newest checkpoint (round 4) "
                               "is damaged (")
    assert lines[0].endswith("evaluated round 2 instead")
    strict = subprocess.run([sys.executable, "-m", "fedjax_rcl", "eval", str(run), "--strict"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert strict.returncode == 2 and strict.stdout == ""
    lines = strict.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"fedjax-rcl: error: eval --strict: the newest checkpoint of {run} (round 4) is "
        "damaged ("), strict.stderr[-3000:]
    assert lines[0].endswith("the newest that restores is round 2")

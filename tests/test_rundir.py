"""Run directories are safe: unique default names, no overwriting a run, one process at a time."""

import os
import subprocess
import sys

import pytest

from fedjax_rcl import rundir
from fedjax_rcl.cli import main
from fedjax_rcl.config import Config, ConfigError, to_yaml


def test_default_names_never_collide(tmp_path, monkeypatch):
    """Many runs started in the same second each get their own directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt: "20260101-000000")
    made = {rundir.create_new(Config(), None) for _ in range(50)}
    assert len(made) == 50 and all(d.is_dir() and d.parent.name == "runs" for d in made)


@pytest.mark.parametrize("part", rundir.RUN_FILES)
def test_train_refuses_any_part_of_a_run_and_suggests_resume(tmp_path, capsys, part):
    """A run killed before its first evaluation has only config.yaml (and maybe checkpoints/):
    train must not overwrite it."""
    target = tmp_path / part
    if part == "checkpoints":
        target.mkdir()
    else:
        target.write_text("seed: 0\n")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert main(["train", f"run_dir={tmp_path}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"fedjax-rcl resume {tmp_path}" in err and len(err.splitlines()) == 1
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_empty_existing_directory_is_fine(tmp_path):
    assert rundir.resolve_new(Config(run_dir=str(tmp_path))) == tmp_path


def test_second_process_is_refused_with_the_holders_pid(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text(to_yaml(Config(run_dir=str(tmp_path))))
    with rundir.locked(tmp_path):
        assert main(["resume", str(tmp_path), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"in use by process {os.getpid()}" in err
        # Another process too (flock is per open file, so this also holds across processes).
        proc = subprocess.run([sys.executable, "-m", "fedjax_rcl", "resume", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and f"in use by process {os.getpid()}" in proc.stderr
        assert "Traceback" not in proc.stderr
    with rundir.locked(tmp_path):  # released at the end of the block
        pass


def test_lock_recheck_catches_a_run_started_meanwhile(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="already holds a run"):
        with rundir.locked(tmp_path, new_run=True):
            pass

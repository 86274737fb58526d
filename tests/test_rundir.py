"""Run directories are safe: unique default names, no overwriting a run, one process at a time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedjax_rcl import provenance, rundir
from fedjax_rcl.cli import main
from fedjax_rcl.config import Config, ConfigError, SweepConfig, to_yaml


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


# A run killed while writing a line leaves it cut mid-JSON.
TORN = '{"round": 4, "test_accuracy": 0.'


def _line(r: int) -> str:
    return json.dumps({"round": r, "test_accuracy": 0.1 * r, "test_accuracy_ema": 0.05 * r,
                       "test_loss": 1.0, "train_loss": 1.0, "total_s": float(r)})


def _torn_run(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(Config(run_dir=str(run_dir))))
    (run_dir / "metrics.jsonl").write_text("".join(_line(r) + "\n" for r in (1, 2, 3)) + TORN)
    (run_dir / "clients.jsonl").write_text('{"round": 1, "clients": [0]}\n{"round": 2, "cl')
    return run_dir


def test_every_reader_keeps_the_complete_lines_of_a_torn_metrics_file(tmp_path):
    """One policy for a torn last line: each reader of a run's JSONL files returns the
    complete lines only (the plot, ``report`` and the suite's count used to raise or differ)."""
    from fedjax_rcl import api, plots, report, suite, training

    run_dir = _torn_run(tmp_path / "run")
    whole = [json.loads(_line(r)) for r in (1, 2, 3)]
    run = rundir.RunDir(run_dir)
    assert run.read_metrics() == whole
    assert run.metric_lines() == [_line(r) for r in (1, 2, 3)]
    assert run.read_metrics(upto=2) == whole[:2] and run.last_round() == 3
    assert run.read_clients() == [{"round": 1, "clients": [0]}]
    assert api.load(run_dir).metrics == whole
    loaded = report.read_run(run_dir)
    assert loaded.rows == whole and loaded.clients == [{"round": 1, "clients": [0]}]
    assert plots.read_metrics(run.metrics) == whole
    assert suite.rounds_done(run_dir) == 3
    assert training.prior_seconds(run_dir, 10) == 3.0
    assert training.prior_accuracies(run_dir, 2) == [(1, 0.1), (2, 0.2)]
    # Any line that is not a JSON object is skipped the same way, and no file is no lines.
    (tmp_path / "odd.jsonl").write_text(f"{_line(1)}\n\n[1, 2]\nnull\n{_line(2)}\n")
    assert rundir.read_jsonl(tmp_path / "odd.jsonl") == whole[:2]
    assert rundir.read_jsonl(tmp_path / "absent.jsonl") == []


def test_a_torn_environment_line_does_not_hide_the_plugin_dirs(tmp_path):
    run = rundir.RunDir(tmp_path)
    run.environment.write_text('{"cwd": "/a", "plugin_dirs": {"p": "/b"}}\n{"cwd": "/c", "pl')
    assert provenance.recorded_plugin_dirs(tmp_path) == ("/b", "/a")


def test_the_run_directorys_files_have_one_name_each(tmp_path):
    run = rundir.RunDir(str(tmp_path))  # a str is a path
    assert run.path == tmp_path and os.fspath(run) == str(tmp_path)
    assert [p.name for p in (run.config, run.metrics, run.clients, run.commands,
                             run.environment, run.plot, run.resources, run.lock)] == [
        "config.yaml", "metrics.jsonl", "clients.jsonl", "commands.txt", "environment.jsonl",
        "accuracy.png", "resources.json", ".lock"]
    assert run.checkpoint_dir() == tmp_path / "checkpoints"
    assert run.checkpoint_dir("phase1") == tmp_path / "checkpoints" / "phase1"
    assert not run.holds_run()
    run.checkpoint_dir("phase2").mkdir(parents=True)
    assert run.holds_run() and rundir.holds_run(tmp_path)


def _checkpoints(directory: Path, *steps) -> None:
    for s in steps:
        (directory / str(s)).mkdir(parents=True)


def test_round_reached_of_a_federated_run(tmp_path):
    from fedjax_rcl import api

    run = rundir.RunDir(tmp_path)
    assert run.round_reached() is None and api.round_reached(tmp_path) is None
    _checkpoints(run.checkpoint_dir(), 0, 5, 10)
    (run.checkpoint_dir() / "15.orbax-checkpoint-tmp-1234").mkdir()  # a save cut short
    (run.checkpoint_dir() / "20").write_text("")  # not a checkpoint directory
    assert run.steps() == [0, 5, 10]
    assert run.round_reached() == 10 == api.round_reached(tmp_path)


def test_round_reached_of_an_mfcl_run_waits_for_its_probe(tmp_path):
    """An MFCL run's round is its phase-1 checkpoint's, known once the probe's line is written
    (before that a resume still has phase 2 or the probe to run); ``partial`` gives it all the
    same, which the suite needs to place the run."""
    from fedjax_rcl import api, suite

    run = rundir.RunDir(tmp_path)
    _checkpoints(run.checkpoint_dir("phase1"), 0, 5, 10)
    _checkpoints(run.checkpoint_dir("phase2"), 0, 3)
    lines = [{"phase": 1, "round": r, "train_bce": 0.5, "test_bce": 0.5} for r in (5, 10)]
    lines += [{"phase": 2, "epoch": e, "loss": 1.0} for e in (1, 2, 3)]
    run.metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert run.is_mfcl() and run.steps("phase1") == [0, 5, 10]
    assert run.round_reached() is None and api.round_reached(tmp_path) is None
    assert run.round_reached(partial=True) == 10
    assert suite.rounds_done(tmp_path) == 10 and suite._unfinished(tmp_path)
    with open(run.metrics, "a") as f:
        f.write(json.dumps({"phase": "probe", "linear_probe_accuracy": 0.4}) + "\n")
    assert run.round_reached() == 10 == api.round_reached(tmp_path)
    assert suite.rounds_done(tmp_path) == 10 and not suite._unfinished(tmp_path)
    assert run.last_round() == 10  # the probe's and phase 2's lines have no round


def _grid(tmp_path: Path, **keys) -> tuple[rundir.RunDir, list[rundir.RunDir]]:
    from fedjax_rcl import grid

    cfg = Config(run_dir=str(tmp_path), **keys)
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    run = rundir.RunDir(tmp_path)
    members = run.members()
    # The directory alone names the members the grid's program gives them.
    assert [m.path for m in members] == [Path(c.run_dir)
                                         for c in grid.member_configs(cfg, tmp_path)]
    return run, members


def test_round_reached_of_a_grid_is_its_members_oldest(tmp_path):
    from fedjax_rcl import api, suite

    run, members = _grid(tmp_path, seeds=[0, 1, 2])
    assert [m.path.name for m in members] == ["seed-0", "seed-1", "seed-2"]
    _checkpoints(members[0].checkpoint_dir(), 0, 5, 10)
    _checkpoints(members[1].checkpoint_dir(), 0, 5)
    assert run.round_reached() is None  # seed-2 has no checkpoint yet
    _checkpoints(members[2].checkpoint_dir(), 0, 5, 10)
    assert run.round_reached() == 5 == api.round_reached(tmp_path)
    # The suite counts a grid's rounds from its members (the grid's own metrics are empty).
    for m, last in zip(members, (10, 7, 10), strict=True):
        m.metrics.write_text("".join(_line(r) + "\n" for r in range(1, last + 1)))
    run.metrics.write_text("")
    assert suite.rounds_done(tmp_path) == 5
    assert rundir.RunDir(tmp_path / "seed-0").members() == []  # a member is a single run


def test_a_sweeps_members_are_named_by_value_and_seed(tmp_path):
    run, members = _grid(tmp_path, seeds=[1], sweep=SweepConfig(key="fedrcl.beta",
                                                               values=[0.5, 1.0]))
    assert [m.path.name for m in members] == ["fedrcl.beta-0.5-seed-1", "fedrcl.beta-1-seed-1"]
    for m in members:
        _checkpoints(m.checkpoint_dir(), 0, 4)
    assert run.round_reached() == 4


def test_the_suite_finishes_an_mfcl_run_whose_probe_is_missing(tmp_path, monkeypatch):
    """An MFCL run at the suite's rounds whose phase 2 was cut short is resumed to those
    rounds (it has its phases to finish); once its probe is written the suite is done."""
    from fedjax_rcl import suite

    run = rundir.RunDir(tmp_path / "runs" / "m")
    _checkpoints(run.checkpoint_dir("phase1"), 0, 30)
    run.config.write_text("algorithm: mfcl\n")
    run.metrics.write_text(json.dumps({"phase": 1, "round": 30}) + "\n")
    issued = []

    def child(argv):
        issued.append(argv)
        with open(run.metrics, "a") as f:
            f.write(json.dumps({"phase": "probe"}) + "\n")
        return 0

    monkeypatch.setattr(suite, "_run_child", child)
    spec = {"base": "base.yaml", "runs_dir": str(tmp_path / "runs"), "rounds": 30,
            "runs": {"m": ["algorithm=mfcl"]}}
    suite.run(spec, chunk=10)
    assert len(issued) == 1 and issued[0][3:] == ["resume", str(run.path), "rounds=30",
                                                  "--no-progress"]

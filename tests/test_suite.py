"""``fedjax-rcl suite``: which run goes next, the commands it issues, its table, bad files."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from fedjax_rcl import suite as suite_tool
from fedjax_rcl.cli import main


def _write_run(run_dir: Path, acc: np.ndarray) -> None:
    run_dir.mkdir(parents=True)
    ema, lines = 0.1, []
    for t, a in enumerate(acc, start=1):
        ema = 0.9 * ema + 0.1 * a
        lines.append(json.dumps({"round": t, "test_accuracy": float(a),
                                 "test_accuracy_ema": ema}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _suite(tmp_path: Path) -> dict:
    return {"base": "base.yaml", "runs_dir": str(tmp_path / "runs"), "rounds": 30,
            "report_rounds": [10, 30], "runs": {"a": ["algorithm=fedavg"],
                                                "b": ["algorithm=fedrcl"]}}


def test_table_ema_window_mean_and_best(tmp_path):
    pytest.importorskip("matplotlib")
    suite = _suite(tmp_path)
    rng = np.random.default_rng(0)
    acc_a, acc_b = rng.uniform(0.1, 0.6, 35), rng.uniform(0.1, 0.6, 25)
    acc_a[32] = 0.99  # past the suite's 30 rounds: not its best
    _write_run(tmp_path / "runs" / "a", acc_a)
    _write_run(tmp_path / "runs" / "b", acc_b)  # stopped at 25: no @30, no window mean
    text = suite_tool.table(suite, tmp_path / "out")
    header, _, row_a, row_b = text.splitlines()
    assert "EMA @10 | EMA @30 | mean acc 21-30 | best acc to 30 |" in header
    ema = 0.1
    for t, a in enumerate(acc_a[:30], start=1):
        ema = 0.9 * ema + 0.1 * a
        if t == 10:
            ema10 = ema
    cells_a = [c.strip() for c in row_a.split("|")[1:-1]]
    assert cells_a[:3] == ["a", "algorithm=fedavg", "35"]
    assert cells_a[3:] == [f"{ema10:.4f}", f"{ema:.4f}", f"{acc_a[20:30].mean():.4f}",
                           f"{acc_a[:30].max():.4f}"]
    cells_b = [c.strip() for c in row_b.split("|")[1:-1]]
    assert cells_b[2] == "25" and cells_b[4:6] == ["—", "—"]
    assert (tmp_path / "out" / "table.md").read_text() == text
    assert (tmp_path / "out" / "ema_accuracy.png").stat().st_size > 0


def test_table_of_a_suite_with_a_run_not_yet_started(tmp_path):
    """A suite tabulated before all its runs have started (a table of runs made one lease at a
    time) gives the missing run a row of dashes; it raised a traceback."""
    pytest.importorskip("matplotlib")
    suite = _suite(tmp_path)
    _write_run(tmp_path / "runs" / "a", np.full(30, 0.5))
    text = suite_tool.table(suite, tmp_path / "out")
    cells_b = [c.strip() for c in text.splitlines()[3].split("|")[1:-1]]
    assert cells_b == ["b", "algorithm=fedrcl", "0", "—", "—", "—", "—"]
    assert "†" not in text  # a run with no evaluation is not one at another cadence


def test_run_advances_the_run_furthest_behind(tmp_path, monkeypatch):
    suite = _suite(tmp_path)
    _write_run(tmp_path / "runs" / "a", np.full(20, 0.5))
    (tmp_path / "runs" / "a" / "config.yaml").write_text("{}")
    calls = []

    def fake_run(argv):
        # Each run is a process of the same Python: python -m fedjax_rcl <command> ...
        assert argv[:3] == [sys.executable, "-m", "fedjax_rcl"]
        cmd = ["fedjax-rcl", *argv[3:]]
        calls.append(cmd)
        target = int(next(c for c in cmd if c.startswith("rounds=")).split("=")[1])
        run_dir = Path(cmd[2]) if cmd[1] == "resume" else Path(
            next(c for c in cmd if c.startswith("run_dir=")).split("=", 1)[1])
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_run_append(run_dir, target)
        (run_dir / "config.yaml").write_text("{}")
        return 0

    monkeypatch.setattr(suite_tool, "_run_child", fake_run)
    suite_tool.run(suite, chunk=10, only=None)
    runs = [Path(c[2]).name if c[1] == "resume" else "b" for c in calls]
    steps = [(c[1], next(x for x in c if x.startswith("rounds="))) for c in calls]
    # b starts from nothing with train and catches up; on a tie the suite's order decides.
    assert list(zip(runs, steps, strict=True)) == [
        ("b", ("train", "rounds=10")), ("b", ("resume", "rounds=20")),
        ("a", ("resume", "rounds=30")), ("b", ("resume", "rounds=30"))]
    assert calls[0][2] == "base.yaml" and "algorithm=fedrcl" in calls[0]
    # The commands record themselves (fedjax_rcl.provenance); the suite writes no run file.
    assert not (tmp_path / "runs" / "b" / "commands.txt").exists()


@pytest.mark.parametrize("status, stopped_by", [(130, "SIGINT"), (143, "SIGTERM"),
                                                 (129, "SIGHUP"), (1, None)])
def test_a_run_stopped_by_a_signal_of_its_own_stops_the_suite_as_a_signal(
        tmp_path, monkeypatch, status, stopped_by):
    """A run signalled alone (its pid, not the suite's) saves its round and exits 128 + the
    signal: the suite stops as if signalled itself (that status, its line), not as a failed
    run ("exit status 143; stopping the suite", exit 1). Other failures stay failures."""
    import signal

    from fedjax_rcl import interrupts
    from fedjax_rcl.loop import TrainingError

    class Stopped(Exception):
        pass

    def stop(signum=None):
        raise Stopped(signum)

    monkeypatch.setattr(interrupts, "stop", stop)
    monkeypatch.setattr(suite_tool, "_run_child", lambda argv: status)
    if stopped_by is None:
        with pytest.raises(TrainingError, match="a: exit status 1; stopping the suite"):
            suite_tool.run(_suite(tmp_path), chunk=10, only=["a"])
        return
    with pytest.raises(Stopped) as e:
        suite_tool.run(_suite(tmp_path), chunk=10, only=["a"])
    assert e.value.args == (getattr(signal, stopped_by),)


def _write_run_append(run_dir: Path, target: int) -> None:
    path = run_dir / "metrics.jsonl"
    done = suite_tool.rounds_done(run_dir)
    with open(path, "a") as f:
        for t in range(done + 1, target + 1):
            f.write(json.dumps({"round": t, "test_accuracy": 0.5,
                                "test_accuracy_ema": 0.5}) + "\n")


def test_bad_suite_files_and_names_exit_2_with_one_line(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    assert main(["suite", "run", str(missing)]) == 2
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: a.yaml\nruns_dir: runs\nrounds: 3\n")
    assert main(["suite", "run", str(bad)]) == 2
    assert "missing keys runs" in capsys.readouterr().err
    bad.write_text("base: a.yaml\nruns_dir: runs\nrounds: 3\nruns:\n  x: algorithm=fedavg\n")
    assert main(["suite", "table", str(bad)]) == 2
    assert "run 'x' must be a list of key=value overrides" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text(f"base: a.yaml\nruns_dir: {tmp_path / 'runs'}\nrounds: 3\n"
                    "runs:\n  x: [algorithm=fedavg]\n")
    assert main(["suite", "run", str(good), "--only", "y"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--only y: not runs of this suite (its runs: x)" in err[0]
    assert main(["suite", "run", str(good), "--chunk", "0"]) == 2
    assert "--chunk 0: must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_spearman_against_a_hand_computed_value_and_scipy():
    # x ranks 1..5; y ranks 2, 1, 4, 3, 5: d^2 = 1 + 1 + 1 + 1 + 0 = 4, rho = 1 - 6*4/(5*24).
    assert suite_tool.spearman([1, 2, 3, 4, 5], [20, 10, 40, 30, 50]) == pytest.approx(0.8)
    assert suite_tool.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 5, 12).tolist(), rng.normal(size=12).tolist()  # ties in x
    assert suite_tool.spearman(x, y) == pytest.approx(scipy_stats.spearmanr(x, y).statistic)


def test_table_puts_the_papers_values_beside_ours(tmp_path):
    pytest.importorskip("matplotlib")
    suite = _suite(tmp_path)
    suite["runs"]["c"] = ["algorithm=moon"]
    suite["paper"] = {"a": {"500R": 70.0}, "b": {"500R": 80.0}, "c": {"500R": 75.0}}
    suite["paper_source"] = "a test"
    for name, level in (("a", 0.2), ("b", 0.4), ("c", 0.5)):
        _write_run(tmp_path / "runs" / name, np.full(30, level))
    text = suite_tool.table(suite, tmp_path / "out")
    assert text.splitlines()[0].endswith("| paper 500R |")
    assert "| a | algorithm=fedavg | 30 |" in text and text.splitlines()[2].endswith("| 70.0 |")
    # Ours: a < b < c; the paper's: a < c < b.
    assert ("Spearman rank correlation of EMA @30 with the paper's 500R, over 3 runs: +0.50"
            in text)
    assert "Paper values: a test." in text


def test_rounds_done_counts_from_the_newest_whole_checkpoint(tmp_path):
    # A sitting cut between checkpoints leaves metrics ahead of the last checkpoint: resume
    # redoes rounds 26-27, so the run stands at 25 (the next chunk goes to 50, not 52).
    run_dir = tmp_path / "run"
    _write_run(run_dir, np.full(27, 0.5))
    assert suite_tool.rounds_done(run_dir) == 27  # no checkpoints: the metrics decide
    (run_dir / "checkpoints" / "0").mkdir(parents=True)
    (run_dir / "checkpoints" / "25").mkdir()
    (run_dir / "checkpoints" / "30.orbax-checkpoint-tmp-1234").mkdir()  # a save cut short
    assert suite_tool.rounds_done(run_dir) == 25
    (run_dir / "checkpoints" / "27").mkdir()
    assert suite_tool.rounds_done(run_dir) == 27
    # A checkpoint past the metrics (a torn metrics line) does not count rounds not recorded.
    (run_dir / "checkpoints" / "28").mkdir()
    assert suite_tool.rounds_done(run_dir) == 27
    assert suite_tool.rounds_done(tmp_path / "absent") == 0


@pytest.mark.slow
@pytest.mark.parametrize("to", ["the suite's process", "its process group"])
def test_a_signal_to_a_suite_saves_the_run_in_progress_and_stops_the_suite(tmp_path, to):
    """``suite run`` under Ctrl-C or ``timeout`` (the process group) said "nothing was
    written" and ended before its run had saved; a signal to the suite's process alone never
    reached the run. Now the signal reaches the run, which saves the round it reaches, and the
    suite stops after it with a line saying how to continue; ``suite run`` again continues
    every run, each recorded round once. The run itself sends the signal, to its parent (the
    suite) or to the process group, after its round 3 of the 200 it was asked for
    (``FEDJAX_RCL_TEST_SIGNAL``), so nothing is timed or polled."""
    import os
    import subprocess

    import yaml

    from fedjax_rcl.checkpoint import saved_steps

    (tmp_path / "base.yaml").write_text("dataset: digits\nnum_clients: 8\nparticipation: 0.5\n"
                                        "local_epochs: 1\nrounds: 200\ncheckpoint_every: 50\n")
    spec = {"base": str(tmp_path / "base.yaml"), "runs_dir": str(tmp_path / "runs"),
            "rounds": 200, "report_rounds": [10], "runs": {"a": ["algorithm=fedavg"],
                                                            "b": ["algorithm=fedavg"]}}
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(spec))
    target = {"the suite's process": "parent", "its process group": "group"}[to]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "FEDJAX_RCL_TEST_SIGNAL": f"phase=between,round=3,signal=INT,to={target}"}
    cmd = [sys.executable, "-m", "fedjax_rcl", "suite", "run", str(path), "--chunk", "200"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    run = tmp_path / "runs" / "a"

    def recorded() -> list[int]:  # the rounds in metrics.jsonl, whole lines only
        path = run / "metrics.jsonl"
        text = path.read_text() if path.exists() else ""
        return [json.loads(x)["round"] for x in text.split("\n")[:-1]]

    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line]
    saved = saved_steps(run / "checkpoints")[-1]
    assert saved == 3
    assert lines[-2] == (f"fedjax-rcl: SIGINT: stopped; run_dir {run}: last complete "
                         f"checkpoint: round {saved}; continue with: fedjax-rcl resume {run}")
    assert lines[-1] == (f"fedjax-rcl: SIGINT: stopped; suite {path}: each run keeps its last "
                         "complete checkpoint (a stopped run's line above names it); continue "
                         f"with: fedjax-rcl suite run {path} --chunk 200")
    assert recorded() == list(range(1, saved + 1))  # every recorded round is saved
    assert not (tmp_path / "runs" / "b").exists()  # the suite stopped
    # Continued (to 2 rounds past the stop, to keep the test short): each round once.
    path.write_text(yaml.safe_dump({**spec, "rounds": saved + 2}))
    del env["FEDJAX_RCL_TEST_SIGNAL"]
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    for name in ("a", "b"):
        rounds = [json.loads(x)["round"] for x in
                  (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        assert rounds == list(range(1, saved + 3))


@pytest.mark.parametrize("extra,message", [
    ({"rounds": 0}, "rounds=0: must be a whole number >= 1"),
    ({"rounds": "ten"}, "rounds='ten': must be a whole number >= 1"),
    ({"report_rounds": [10, 40]}, "report_rounds=[10, 40]: must be a list of rounds between 1 "
                                  "and rounds=30"),
    ({"report_rounds": []}, "report_rounds=[]"),
    ({"paper": {"c": {"500R": 70.0}}}, "paper: 'c' is not one of the runs (a, b)"),
    ({"paper": {"a": {"500R": "high"}}}, "paper: 'a' must map columns to numbers"),
    ({"paper": [1, 2]}, "paper: must map run names to {column: value}"),
    ({"group_by": 3}, "group_by=3: must be a config key"),
], ids=["rounds-0", "rounds-text", "report-past-rounds", "report-empty", "paper-unknown-run",
        "paper-not-numbers", "paper-not-mapping", "group-by"])
def test_a_suite_file_with_a_bad_table_key_is_refused_naming_it(tmp_path, capsys, extra,
                                                                 message):
    """Silent nonsense before: a report round past the suite's rounds gave a column of
    dashes, a paper value under a misspelt run name was never shown, ``rounds: ten`` a
    traceback."""
    import yaml

    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({**_suite(tmp_path), **extra}))
    assert main(["suite", "table", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_overrides_apply_to_every_run_are_recorded_and_unknown_keys_refused(tmp_path, capsys,
                                                                           monkeypatch):
    """``suite run SUITE key=value``: a run trains with the override, which wins over the
    run's own setting of it (its config.yaml records it), a resume is given it again; an
    unknown key or bad value stops the suite in one line before any run starts. (One run:
    each run of a suite is the same command with its own overrides.)"""
    from fedjax_rcl.cli import main

    monkeypatch.chdir(tmp_path)
    Path("base.yaml").write_text("dataset: digits\nnum_clients: 10\nparticipation: 0.2\n"
                                 "local_epochs: 1\nbatch_size: 32\nalgorithm: fedavg\n")
    Path("suite.yaml").write_text("base: base.yaml\nruns_dir: runs\nrounds: 1\nruns:\n"
                                  "  b: [seed=1, lr=0.2]\n")
    assert main(["suite", "run", "suite.yaml", "lr=0.05", "momentum=0.5"]) == 0, \
        capsys.readouterr().err
    saved = Path("runs", "b", "config.yaml").read_text()
    assert "lr: 0.05" in saved and "momentum: 0.5" in saved  # the override wins
    assert "seed: 1" in saved
    capsys.readouterr()
    assert main(["suite", "run", "suite.yaml", "lr_typo=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lr_typo" in err[0]
    assert main(["suite", "run", "suite.yaml", "lr=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lr" in err[0]
    # A resume gets the overrides again; one that would change results is refused by it.
    spec = suite_tool.with_overrides(suite_tool.load_suite("suite.yaml"), ["lr=0.05"])
    assert suite_tool._command({**spec, "rounds": 2}, "b", 2)[:4] == [
        "fedjax-rcl", "resume", str(Path("runs", "b")), "lr=0.05"]


def test_table_of_a_grid_and_an_mfcl_run(tmp_path):
    """A grid's own metrics are empty: its members are a row each; an MFCL run has no test
    accuracy per round: its row gives its phase-1 rounds, a note its probe accuracy (both
    failed, the MFCL run with a KeyError)."""
    pytest.importorskip("matplotlib")
    suite = {"base": "base.yaml", "runs_dir": str(tmp_path / "runs"), "rounds": 10,
             "report_rounds": [10], "runs": {"g": ["seeds=[1,2]"], "m": ["algorithm=mfcl"],
                                              "n": ["algorithm=mfcl"]}}
    grid = tmp_path / "runs" / "g"
    _write_run(grid / "seed-1", np.full(10, 0.5))
    _write_run(grid / "seed-2", np.full(8, 0.25))
    (grid / "config.yaml").write_text("seeds: [1, 2]\n")
    (grid / "metrics.jsonl").write_text("")
    for name, probe in (("m", [{"phase": "probe", "linear_probe_accuracy": 0.625}]),
                        ("n", [])):
        run = tmp_path / "runs" / name
        (run / "checkpoints" / "phase1").mkdir(parents=True)
        lines = [{"phase": 1, "round": 3, "train_bce": 0.5, "test_bce": 0.5},
                 {"phase": 2, "epoch": 1, "server_loss": 1.0}, *probe]
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = suite_tool.table(suite, tmp_path / "out")
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.split("|")[1:-1]]
                                          for line in text.splitlines()[2:] if "|" in line)}
    assert rows["g/seed-1"][2:] == ["10", f"{rows['g/seed-1'][3]}", "0.5000", "0.5000"]
    assert rows["g/seed-2"][2:] == ["8", "—", "—", "0.2500"]
    assert rows["m"][2:] == ["3", "—", "—", "—"] and rows["n"][2:] == ["3", "—", "—", "—"]
    assert ("MFCL runs are evaluated by the linear probe, not test accuracy per round: m: "
            "linear probe accuracy 0.6250; n: probe not written yet.") in text

"""The Python entry points: the documented example runs, callbacks stop a run cleanly and a
stopped run resumes to the uninterrupted result, bad input raises the command line's message."""

import json
import re
from pathlib import Path

import pytest
from conftest import TINY_RUN

import fedjax_rcl

DOC = Path(__file__).resolve().parents[1] / "docs" / "python.md"
TINY = list(TINY_RUN)  # the shared tiny run's settings (conftest)


def _rows(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


@pytest.mark.slow
def test_the_documented_example_runs_and_runs_again(tmp_path, monkeypatch, capsys):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    for attempt in (1, 2):  # a second run of the same code starts a second run
        exec(compile(code, str(DOC), "exec"), {"__name__": "__main__"})  # as `python -c` runs it
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("5 evaluations; test accuracy"), attempt
        assert out[1].startswith("stopped early: True at round"), attempt
        assert "'round':" in out[2] and out[3] == "refused: rounds=0: must be >= 1", attempt
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    for run in runs:  # each records the calls that trained it
        assert (run / "commands.txt").read_text().splitlines() == [
            "python: fedjax_rcl.train(None, 'algorithm=fedavg', 'rounds=5')",
            f"python: fedjax_rcl.resume('{run.relative_to(tmp_path)}', 'rounds=40')"]


@pytest.mark.slow  # an end-to-end run and its resume (CI's second step)
def test_a_callback_stops_the_run_cleanly_and_resume_gives_the_uninterrupted_result(tmp_path,
                                                                                  tiny_run):
    whole = fedjax_rcl.load(tiny_run)  # TINY's 4 rounds (its checkpoints every 2)
    assert [r["round"] for r in whole.metrics] == [1, 2, 3, 4] and not whole.stopped_early
    seen = []

    def stop_at_2(record):
        seen.append(record["round"])
        return record["round"] == 2

    part = fedjax_rcl.train(None, *TINY, "rounds=4", f"run_dir={tmp_path / 'part'}",
                            callbacks=[stop_at_2])
    assert part.stopped_early and seen == [1, 2] and part.last["round"] == 2
    assert fedjax_rcl.evaluate(part.run_dir)["round"] == 2  # checkpointed where it stopped
    again = fedjax_rcl.resume(part.run_dir)
    assert not again.stopped_early and [r["round"] for r in again.metrics] == [1, 2, 3, 4]
    assert _rows(again.run_dir) == _rows(whole.run_dir)
    loaded = fedjax_rcl.load(part.run_dir)
    assert loaded.config.rounds == 4 and loaded.metrics == again.metrics
    # Runs started from Python record the calls in commands.txt, as the command line does.
    assert (part.run_dir / "commands.txt").read_text().splitlines() == [
        f"python: fedjax_rcl.train(None, {', '.join(map(repr, TINY))}, 'rounds=4', "
        f"'run_dir={tmp_path / 'part'}')",
        f"python: fedjax_rcl.resume({str(part.run_dir)!r})"]


@pytest.mark.slow
def test_configs_from_a_dict_a_yaml_path_and_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("algorithm: fedavg\nrounds: 1\nnum_clients: 4\nlocal_epochs: 1\n")
    run = fedjax_rcl.train(str(path), "partition=iid", f"run_dir={tmp_path / 'a'}")
    assert run.config.rounds == 1 and run.config.partition == "iid" and len(run.metrics) == 1
    run = fedjax_rcl.train({"algorithm": "fedavg", "rounds": 1, "num_clients": 4,
                            "local_epochs": 1, "server": {"lr": 0.5}},
                           f"run_dir={tmp_path / 'b'}")
    assert run.config.server.lr == 0.5


def test_bad_input_raises_the_command_lines_message(tmp_path):
    with pytest.raises(fedjax_rcl.ConfigError) as err:
        fedjax_rcl.train({"rounds": 0, "algorithm": "fedrc"}, f"run_dir={tmp_path / 'x'}")
    assert err.value.problems[0] == "algorithm='fedrc': allowed: " + ", ".join(
        fedjax_rcl.registry.ALGORITHMS) + " (did you mean 'fedrcl'?)"
    assert "rounds=0: must be >= 1" in err.value.problems
    assert not (tmp_path / "x").exists()
    with pytest.raises(fedjax_rcl.ConfigError, match="no config.yaml; not a fedjax-rcl run"):
        fedjax_rcl.resume(tmp_path)
    with pytest.raises(TypeError, match="a dict, a YAML path"):
        fedjax_rcl.train(42)


@pytest.mark.slow
def test_evaluate_takes_a_single_run_and_a_grid_and_refuses_an_mfcl_run_in_one_line(
        tmp_path, capsys, tiny_run):
    """``evaluate`` looks a run's kind up once (``programs.kind_of``): a single run and a grid
    (each member's checkpoint, their mean) are evaluated; MFCL, whose evaluation is the probe
    its own run writes, is refused in one line rather than read from checkpoints it does not
    have, from Python and from ``fedjax-rcl eval``."""
    from fedjax_rcl.cli import main
    from fedjax_rcl.config import load_config, to_yaml
    from fedjax_rcl.mfcl.run import MFCL_DEFAULTS

    single = fedjax_rcl.load(tiny_run)
    ev = fedjax_rcl.evaluate(single.run_dir)
    assert ev["round"] == 4 and ev["test_accuracy"] == pytest.approx(
        single.last["test_accuracy"], abs=1e-6)
    grid = fedjax_rcl.train(None, *TINY, "rounds=1", "seeds=[0,1]",
                            f"run_dir={tmp_path / 'grid'}")
    ev = fedjax_rcl.evaluate(grid.run_dir)
    assert [r["round"] for r in ev["runs"]] == [1, 1]
    assert [r["test_accuracy"] for r in ev["runs"]] == pytest.approx(
        [m.last["test_accuracy"] for m in grid.members], abs=1e-6)
    mfcl = tmp_path / "mfcl"
    mfcl.mkdir()
    (mfcl / "config.yaml").write_text(to_yaml(load_config(
        None, ["dataset=digits", f"run_dir={mfcl}"], defaults=MFCL_DEFAULTS)))
    with pytest.raises(fedjax_rcl.ConfigError) as err:
        fedjax_rcl.evaluate(mfcl)
    assert err.value.problems == [
        f"run_dir={str(mfcl)!r}: an MFCL run; its evaluation is the linear probe, which "
        "'fedjax-rcl mfcl' and 'fedjax-rcl resume' write to metrics.jsonl (the line with "
        "\"phase\": \"probe\"); eval evaluates the checkpoints of 'fedjax-rcl train' runs"]
    capsys.readouterr()
    assert main(["eval", str(mfcl)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1
    assert "an MFCL run; its evaluation is the linear probe" in out.err

"""Runs never lose work: exact resume, damaged checkpoints (signals and kills at named moments:
test_interrupts.py). ``resume`` of a run already past the rounds asked for changes nothing;
``eval`` says which checkpoint it evaluated, falls back from a damaged newest one with one
warning line (recorded in its JSON), and with ``--strict`` refuses to."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from conftest import TINY_RUN

import fedjax_rcl
from fedjax_rcl.cli import main
from fedjax_rcl.config import ConfigError, load_config
from fedjax_rcl.nn import narrow_conv, onednn
from fedjax_rcl.training import evaluate_run, restore_run, resume_single, train

# Small and fast: 10 digits clients, 2 per round, one local epoch.
TINY = ["dataset=digits", "num_clients=10", "participation=0.2", "local_epochs=1",
        "batch_size=32", "partition=dirichlet", "alpha=0.5", "algorithm=fedrcl"]


def _metrics(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        for timing in ("elapsed_s", "round_s", "total_s"):  # wall times may differ
            r.pop(timing)
    return rows


def _final_state(run_dir):
    return restore_run(run_dir)[1]


def _assert_same_state(a, b):
    assert a.step == b.step
    chex.assert_trees_all_equal(a.state, b.state)  # bitwise


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of 6 rounds, checkpoints every 2."""
    run = tmp_path_factory.mktemp("ref") / "run"
    train(load_config(None, [*TINY, "rounds=6", "checkpoint_every=2", f"run_dir={run}"]),
          progress=False, log=lambda s: None)
    return run


def test_stop_and_resume_is_identical(tiny_run, tmp_path):
    """The tests' shared tiny run (conftest: FedAvg, 4 rounds, checkpoints every 2) stopped
    after round 2 and resumed to round 4 in a second process call: the same metrics and,
    bitwise, the same final state as the run that went through. FedRCL's in the slow step."""
    run = tmp_path / "run"
    train(load_config(None, [*TINY_RUN, "rounds=2", "checkpoint_every=2", f"run_dir={run}"]),
          progress=False, log=lambda s: None)
    assert [r["round"] for r in _metrics(run)] == [1, 2]
    resume_single(run, ["rounds=4"], progress=False, log=lambda s: None)
    assert _metrics(run) == _metrics(tiny_run)
    # Timing: per-round wall time, and loop time that keeps adding up across the resume
    # (the first call ended with round 2's checkpoint; rounds 3-4 ran in the second).
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["round_s"] > 0 for r in rows)
    totals = [r["total_s"] for r in rows]
    assert totals == sorted(totals) and totals[2] > totals[1] == rows[1]["elapsed_s"]
    assert rows[2]["total_s"] == pytest.approx(rows[1]["total_s"] + rows[2]["elapsed_s"],
                                               abs=2e-3)
    _assert_same_state(_final_state(run), _final_state(tiny_run))
    assert "rounds: 4" in (run / "config.yaml").read_text()


def test_a_resumed_run_keeps_the_layout_it_began_with(tiny_run, tmp_path, monkeypatch):
    """The layout cost model refitted between two processes of a run (here: its CPU threshold
    moved so that the tiny run's clients, side by side when it began, would now train one at
    a time): resume keeps the layout its first process recorded, and the run ends bitwise
    as the one that went through. A run whose records hold no layout (older than the record)
    and a new run take the cost model's choice of the day."""
    from fedjax_rcl.engine import layout

    def layouts(run):
        return [r.get("layout", {}).get("clients_in_parallel")
                for r in map(json.loads, (run / "environment.jsonl").read_text().splitlines())]

    run, quiet = tmp_path / "run", (lambda s: None)
    monkeypatch.setitem(layout.SIDE_BY_SIDE_BELOW_GFLOP, "cpu", float("inf"))
    train(load_config(None, [*TINY_RUN, "rounds=2", "checkpoint_every=2", f"run_dir={run}"]),
          progress=False, log=quiet)
    monkeypatch.setitem(layout.SIDE_BY_SIDE_BELOW_GFLOP, "cpu", 0.0)  # the refit
    lines = []
    resume_single(run, ["rounds=4"], progress=False, log=lines.append)
    assert layouts(run) == [0, 0]
    assert any("clients side by side" in x for x in lines), lines
    assert _metrics(run) == _metrics(tiny_run)
    _assert_same_state(_final_state(run), _final_state(tiny_run))

    records = [json.loads(x) for x in (run / "environment.jsonl").read_text().splitlines()]
    # Each process also records what its pools ran (the CPU kernel where it builds).
    pools = "kernel" if onednn.available() else "xla"
    assert [r["layout"]["bias_relu_max_pool"] for r in records] == [pools, pools]
    # and whether its convolutions ran nn.narrow_conv's kernel (AVX2 or AVX-512 CPUs)
    narrow = "kernel" if narrow_conv.isa() in narrow_conv.FAST_ISAS else "off"
    assert [r["layout"]["narrow_conv"] for r in records] == [narrow, narrow]
    # and what its augmentation ran on (the CPU kernel where it builds: bitwise XLA's images)
    assert [r["layout"]["augment"] for r in records] == [pools, pools]
    for r in records:
        del r["layout"]
    (run / "environment.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    resume_single(run, ["rounds=5"], progress=False, log=quiet)
    assert layouts(run) == [None, None, 1]
    train(load_config(None, [*TINY_RUN, "rounds=1", f"run_dir={tmp_path / 'new'}"]),
          progress=False, log=quiet)
    assert layouts(tmp_path / "new") == [1]


@pytest.mark.slow
def test_stop_and_resume_of_fedrcl_is_identical(reference, tmp_path):
    run = tmp_path / "run"
    train(load_config(None, [*TINY, "rounds=3", "checkpoint_every=2", f"run_dir={run}"]),
          progress=False, log=lambda s: None)
    assert [r["round"] for r in _metrics(run)] == [1, 2, 3]
    resume_single(run, ["rounds=6"], progress=False, log=lambda s: None)
    assert _metrics(run) == _metrics(reference)
    _assert_same_state(_final_state(run), _final_state(reference))


def test_resume_refuses_result_changing_overrides(tiny_run, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(tiny_run, run)
    with pytest.raises(ConfigError, match="lr, seed"):
        resume_single(run, ["lr=0.5", "seed=3", "rounds=8"], progress=False, log=lambda s: None)
    assert main(["resume", str(run), "alpha=0.9"]) == 2
    err = capsys.readouterr().err
    assert "alpha" in err and "--force" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_damaged_latest_checkpoint_falls_back_with_a_warning(reference, tmp_path, caplog):
    run = tmp_path / "damaged"
    shutil.copytree(reference, run)
    latest = run / "checkpoints" / "6"
    victims = [p for p in latest.rglob("*") if p.is_file() and p.stat().st_size > 64]
    assert victims
    for p in victims:  # truncate the payload files of the newest checkpoint
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 3)
    with caplog.at_level(logging.WARNING):
        restored = _final_state(run)
    assert restored.step == 4
    assert any("damaged" in r.message for r in caplog.records)
    # Resuming from round 4 reproduces the uninterrupted result.
    resume_single(run, [], progress=False, log=lambda s: None)
    assert _metrics(run) == _metrics(reference)
    _assert_same_state(_final_state(run), _final_state(reference))


def test_eval_prints_the_latest_checkpoint(tiny_run, capsys):
    assert main(["eval", str(tiny_run)]) == 0
    out = json.loads(capsys.readouterr().out)
    last = _metrics(tiny_run)[-1]
    assert out["round"] == 4
    assert out["test_accuracy"] == pytest.approx(last["test_accuracy"], abs=1e-6)
    assert evaluate_run(tiny_run)["test_loss"] == pytest.approx(last["test_loss"], rel=1e-5)


@pytest.mark.slow
def test_non_finite_loss_stops_cleanly_naming_round_and_client(tmp_path, capsys):
    run = tmp_path / "nan"
    status = main(["train", *TINY, "rounds=4", "lr=1e30", "clip_norm=0", "checkpoint_every=1",
                   f"run_dir={run}", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1
    assert "non-finite" in err and "round" in err and "client" in err
    assert "Traceback" not in err
    # The last good checkpoint is intact and restores: lr=1e30 blows up in round 1, so the
    # newest complete checkpoint is round 0's, and no metrics line claims a later round.
    restored = _final_state(run)
    assert restored.step == 0
    metrics = run / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text().strip() == ""


@pytest.mark.slow
def test_host_memory_client_states_match_device_and_resume_exactly(tmp_path):
    """MOON's table in host memory: same results as on device; stop/resume stays exact."""
    base = [*TINY, "algorithm=moon", "rounds=4", "checkpoint_every=2"]
    dev, host, cut = tmp_path / "dev", tmp_path / "host", tmp_path / "cut"
    quiet = dict(progress=False, log=lambda s: None)
    train(load_config(None, [*base, f"run_dir={dev}"]), **quiet)
    train(load_config(None, [*base, "client_states=host", f"run_dir={host}"]), **quiet)
    for a, b in zip(_metrics(dev), _metrics(host), strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    dev_state, host_state = _final_state(dev), _final_state(host)
    table_dev = jax.tree.leaves(dev_state.state.client_states)
    table_host = jax.tree.leaves(host_state.state["host"])
    for x, y in zip(table_dev, table_host, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    train(load_config(None, [*base, "client_states=host", "rounds=2", f"run_dir={cut}"]),
          **quiet)
    resume_single(cut, ["rounds=4"], **quiet)
    assert _metrics(cut) == _metrics(host)
    _assert_same_state(_final_state(cut), host_state)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["future", "task"])
def test_failed_reads_left_behind_are_dropped_and_nothing_else(kind):
    """What a failed restore leaves on asyncio's logger — a "Future" or a "Task exception was
    never retrieved" holding tensorstore's read error, logged by asyncio itself when the
    object is collected — is dropped once a restore has run; the same report of any other
    error passes through."""
    import asyncio
    import gc

    from fedjax_rcl.checkpoint import _quiet_failed_reads

    read_error = ValueError('OUT_OF_RANGE: Error reading "x/.zarray" [tensorstore_spec=\'{}\']')
    other_error = ValueError("something else went wrong")

    async def async_deserialize(e):  # the name of Orbax's coroutine
        raise e

    async def another_coroutine(e):
        raise e

    def leave_unretrieved(error, coroutine):
        loop = asyncio.new_event_loop()
        try:
            if kind == "future":
                fut = loop.create_future()
                fut.set_exception(error)
            else:
                fut = loop.create_task(coroutine(error))
                loop.run_until_complete(asyncio.sleep(0))
            del fut
            gc.collect()
        finally:
            loop.close()

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.errors = []

        def emit(self, record):
            if "never retrieved" in record.getMessage():
                self.errors.append(str(record.exc_info[1]))

    def reports():
        log, keep = logging.getLogger("asyncio"), Keep()
        log.addHandler(keep)
        try:
            leave_unretrieved(read_error, async_deserialize)
            leave_unretrieved(other_error, another_coroutine)
        finally:
            log.removeHandler(keep)
        return keep.errors

    log = logging.getLogger("asyncio")
    installed = list(log.filters)  # another test's restore may have installed it already
    for f in installed:
        log.removeFilter(f)
    try:
        assert reports() == [str(read_error), str(other_error)]  # asyncio reports both
    finally:
        for f in installed:
            log.addFilter(f)
    _quiet_failed_reads()
    assert reports() == [str(other_error)]


def _snapshot(run: Path) -> dict:
    """Every file of a run directory: its bytes and modification time."""
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("rounds", [2, 4])
def test_resume_to_a_round_already_reached_does_nothing(tiny_run, tmp_path, capsys, rounds):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
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


def test_eval_says_which_checkpoint_it_evaluated(tiny_run, capsys):
    assert main(["eval", str(tiny_run)]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["round"] == 4 and out["checkpoint"] == str(tiny_run / "checkpoints" / "4")
    assert "fell_back_from" not in out
    assert captured.err == f"fedjax-rcl: evaluated {tiny_run} at round 4 (its newest checkpoint)\n"


def _damage_arrays(checkpoint: Path) -> None:
    """Truncates the array store of a checkpoint (its tensorstore files) to a third."""
    files = [p for p in (checkpoint / "state").rglob("*")
             if p.is_file() and p.parent.name == "d"]
    assert files
    for p in files:
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 3)


@pytest.mark.slow  # two command-line processes (CI's second step)
def test_eval_of_a_damaged_newest_checkpoint_is_one_warning_recorded_in_the_json(tiny_run,
                                                                               tmp_path):
    """The command line itself (a subprocess: Orbax's failed reads report on their own threads
    after the restore has failed, into the process's standard error)."""
    run = tmp_path / "damaged"
    shutil.copytree(tiny_run, run)
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

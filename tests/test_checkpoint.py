"""Runs never lose work: exact resume, damaged checkpoints (signals and kills at named moments:
test_interrupts.py)."""

import json
import logging
import shutil
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from fedjax_rcl.cli import main
from fedjax_rcl.config import ConfigError, load_config
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


def test_stop_and_resume_is_identical(reference, tmp_path):
    run = tmp_path / "run"
    train(load_config(None, [*TINY, "rounds=3", "checkpoint_every=2", f"run_dir={run}"]),
          progress=False, log=lambda s: None)
    assert [r["round"] for r in _metrics(run)] == [1, 2, 3]
    resume_single(run, ["rounds=6"], progress=False, log=lambda s: None)
    assert _metrics(run) == _metrics(reference)
    # Timing: per-round wall time, and loop time that keeps adding up across the resume
    # (the first process ended with round 3's checkpoint; rounds 4-6 ran in the second).
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["round_s"] > 0 for r in rows)
    totals = [r["total_s"] for r in rows]
    assert totals == sorted(totals) and totals[3] > totals[2] == rows[2]["elapsed_s"]
    assert rows[3]["total_s"] == pytest.approx(rows[2]["total_s"] + rows[3]["elapsed_s"],
                                               abs=2e-3)
    _assert_same_state(_final_state(run), _final_state(reference))
    assert "rounds: 6" in (run / "config.yaml").read_text()


def test_resume_refuses_result_changing_overrides(reference, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(reference, run)
    with pytest.raises(ConfigError, match="lr, seed"):
        resume_single(run, ["lr=0.5", "seed=3", "rounds=8"], progress=False, log=lambda s: None)
    assert main(["resume", str(run), "alpha=0.9"]) == 2
    err = capsys.readouterr().err
    assert "alpha" in err and "--force" in err and len(err.strip().splitlines()) == 1


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


def test_eval_prints_the_latest_checkpoint(reference, capsys):
    assert main(["eval", str(reference)]) == 0
    out = json.loads(capsys.readouterr().out)
    last = _metrics(reference)[-1]
    assert out["round"] == 6
    assert out["test_accuracy"] == pytest.approx(last["test_accuracy"], abs=1e-6)
    assert evaluate_run(reference)["test_loss"] == pytest.approx(last["test_loss"], rel=1e-5)


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

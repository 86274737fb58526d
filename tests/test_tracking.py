"""TensorBoard and W&B mirror metrics.jsonl: every round once, with its values, also across
an interruption that rewinds the run to an earlier checkpoint."""

import importlib.machinery
import json
import shutil
import struct
import sys
import types

import pytest

from fedjax_rcl.cli import main

ARGS = ["dataset=digits", "num_clients=10", "participation=0.5", "local_epochs=1",
        "partition=iid", "algorithm=fedavg", "checkpoint_every=2", "--no-progress"]


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _tensorboard_scalars(logdir) -> dict[str, dict[int, list[float]]]:
    """Reads the event files as TensorBoard does: records in file order, and a
    ``SessionLog.START`` at step s discards what earlier files logged at steps >= s. Each
    step's values in the order they were logged (one, unless a step was logged twice)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, list[float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):  # names start with the time
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == 1:  # START
                for values in scalars.values():
                    for step in [s for s in values if s >= event.step]:
                        del values[step]
            for v in event.summary.value:
                scalars.setdefault(v.tag, {}).setdefault(event.step, []).append(v.simple_value)
    return scalars


def _rewind_to_round_2(run):
    """An interruption after round 4's line but before its checkpoint landed."""
    shutil.rmtree(run / "checkpoints" / "4")


@pytest.mark.slow  # an end-to-end run and its resume (CI's second step)
def test_tensorboard_mirrors_metrics_across_a_rewinding_resume(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "rounds=4", f"run_dir={run}", "tracking.tensorboard=true",
                 *ARGS]) == 0
    _rewind_to_round_2(run)
    assert main(["resume", str(run), "rounds=5", "--no-progress"]) == 0
    rows = _metrics(run)
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5]
    scalars = _tensorboard_scalars(run / "tensorboard")
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2
    for key in ("test_accuracy", "test_accuracy_ema", "train_loss", "round_s"):
        assert scalars[key] == {r["round"]: [pytest.approx(r[key], rel=1e-6)] for r in rows}
    assert "round" not in scalars


class _FakeWandb:
    """Records what the trainer asks of ``wandb`` (the real one needs an account)."""

    def __init__(self):
        self.inits, self.logged, self.finished = [], [], 0
        self.module = types.ModuleType("wandb")
        self.module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.module.init = self._init

    def _init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, data, step):
                fake.logged.append((step, data))

            def finish(self):
                fake.finished += 1

        return Run()


@pytest.mark.slow  # an end-to-end run and its resume (CI's second step)
def test_wandb_continues_the_same_run_and_never_repeats_a_round(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake.module)
    run = tmp_path / "run"
    assert main(["train", "rounds=4", f"run_dir={run}", "tracking.wandb=true",
                 "tracking.wandb_mode=offline", "tracking.wandb_project=proj", *ARGS]) == 0
    _rewind_to_round_2(run)
    # Switched on or off at resume time: the keys change no result.
    assert main(["resume", str(run), "rounds=5", "tracking.wandb_project=proj",
                 "--no-progress"]) == 0
    first, second = fake.inits
    assert first["id"] == second["id"] and first["resume"] == "allow"
    assert first["project"] == "proj" and first["mode"] == "offline"
    assert first["dir"] == str(run) and first["config"]["algorithm"] == "fedavg"
    assert fake.finished == 2
    rows = _metrics(run)
    assert [step for step, _ in fake.logged] == [1, 2, 3, 4, 5]
    for (_, data), row in zip(fake.logged, rows, strict=True):
        assert data["test_accuracy"] == row["test_accuracy"] and "round" not in data


def test_tracking_problems_are_config_errors(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboardX", "wandb")
                        else real(name, *a))
    assert main(["train", "tracking.tensorboard=true", "tracking.wandb=true",
                 "tracking.wandb_mode=cloud", *ARGS]) == 2
    err = capsys.readouterr().err
    assert "tracking.tensorboard=True: needs tensorboardX" in err
    assert "pip install 'fedjax-rcl[tensorboard]'" in err
    assert "tracking.wandb=True: needs wandb" in err
    assert "tracking.wandb_mode='cloud': allowed: online, offline, disabled" in err
    assert "Traceback" not in err

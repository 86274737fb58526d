"""The command line: bad input exits 2 with one line naming the field; a tiny run learns."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from fedjax_rcl.cli import main
from fedjax_rcl.config import load_config
from fedjax_rcl.experiment import compile_options

BAD = [
    (["rounds=0"], "rounds"),
    (["rounds=abc"], "rounds"),
    (["rounds=2.5"], "rounds"),
    (["participation=1.5"], "participation"),
    (["participation=0"], "participation"),
    (["alpha=-1"], "alpha"),
    (["alpha=nan"], "alpha"),
    (["lr=0"], "lr"),
    (["lr_decay=1.5"], "lr_decay"),
    (["momentum=1"], "momentum"),
    (["weight_decay=-1"], "weight_decay"),
    (["clip_norm=-1"], "clip_norm"),
    (["seed=-1"], "seed"),
    (["num_clients=0"], "num_clients"),
    (["local_epochs=0"], "local_epochs"),
    (["batch_size=0"], "batch_size"),
    (["eval_every=0"], "eval_every"),
    (["model=vgg"], "model"),
    (["width=16"], "width"),  # the default model, the CNN, has a fixed width
    (["model=resnet10", "width=3"], "width"),
    (["algorithm=fedfoo"], "algorithm"),
    (["partition=random"], "partition"),
    (["aggregation=median"], "aggregation"),
    (["transforms=imagenet"], "transforms"),
    (["transforms=moon"], "transforms"),  # MOON's constants are for 3 channels; digits has 1
    (["feddyn.alpha=0", "algorithm=feddyn"], "feddyn.alpha"),
    (["conv_impl=fast"], "conv_impl"),
    (["server.optimizer=adam"], "server.optimizer"),
    (["server.lr=-1"], "server.lr"),
    (["dataset=nope"], "dataset"),
    (["dataset=imagefolder:/nonexistent/data.zip"], "dataset"),
    (["foo=1"], "foo"),
    (["server.nu=1"], "server.nu"),
    (["rounds"], "rounds"),
    (["num_clients=5000"], "num_clients"),  # more clients than digits has training samples
    (["dataset=imagefolder:"], "names no path"),  # was OmegaConf's "Cannot convert DictConfig"
    (["batch_size=1000"], "batch_size"),  # larger than every client's data (71 samples)
]


@pytest.mark.parametrize("args,field", BAD, ids=[a[0] for a, _ in BAD])
def test_bad_config_exits_2_with_one_line_naming_the_field(args, field, capsys, tmp_path):
    status = main(["train", *args, f"run_dir={tmp_path / 'run'}", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1, err
    assert field in err and "error" in err
    assert not (tmp_path / "run").exists(), "nothing may be written for a bad config"


def test_bad_yaml_files(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    assert main(["train", str(missing)]) == 2
    assert "not found" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("rounds: [1, 2\n")
    assert main(["train", str(broken)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    assert main(["train", str(listing)]) == 2
    assert "mapping" in capsys.readouterr().err


def test_several_problems_are_all_reported(capsys):
    assert main(["train", "rounds=0", "lr=-1", "model=vgg"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 3
    assert all(f in err for f in ("rounds", "lr", "model"))


def test_type_errors_and_value_errors_are_reported_together(capsys):
    """A type error (rounds=1.5) used to hide every other problem."""
    assert main(["train", "lr=nan", "rounds=1.5", "seed=-1", "width=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4, err
    for field in ("lr=nan", "rounds=1.5", "seed=-1", "width=3"):
        assert sum(field in line for line in err) == 1, (field, err)
    assert any("rounds=1.5: must be an integer" in line for line in err), err
    assert main(["train", "augment=maybe", "lr=x"]) == 2
    err = capsys.readouterr().err
    assert "augment=maybe: must be true or false" in err and "lr=x: must be a number" in err


def test_string_values_are_taken_verbatim(capsys):
    assert main(["train", "run_dir=a:b", "--print-config"]) == 0
    assert "run_dir: a:b" in capsys.readouterr().out
    assert main(["train", "run_dir=null", "--print-config"]) == 0
    assert "run_dir: null" in capsys.readouterr().out


def test_partition_plot_into_a_missing_directory(tmp_path, capsys):
    plot = tmp_path / "missing" / "p.png"
    assert main(["partition", "--plot", str(plot)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err and str(plot) in err


def test_yaml_then_overrides(tmp_path, capsys):
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("rounds: 7\nlr: 0.05\nserver:\n  lr: 0.5\n")
    assert main(["train", str(cfg), "lr=0.2", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "rounds: 7" in out and "lr: 0.2" in out and "  lr: 0.5" in out


def test_existing_run_is_refused(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert main(["train", f"run_dir={tmp_path}"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_subprocess_exit_status_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "fedjax_rcl", "train", "participation=2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "fedjax-rcl: error: participation=2.0: must be in (0, 1]"
    ]


@pytest.mark.slow
def test_tiny_run_beats_chance(tmp_path, capsys):
    """Digits (10 classes, chance 0.1), a few rounds: clearly better than chance."""
    run = tmp_path / "run"
    status = main(["train", "dataset=digits", "algorithm=fedavg", "rounds=12", "num_clients=10",
                   "participation=0.5", "local_epochs=2", "partition=iid", "eval_every=4",
                   f"run_dir={run}", "--no-progress"])
    assert status == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [4, 8, 12]
    for key in ("test_accuracy", "test_accuracy_ema", "train_loss", "test_loss"):
        assert all(key in r for r in rows)
    assert rows[-1]["test_accuracy"] > 0.5
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert (run / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rounds: 12" in (run / "config.yaml").read_text()
    out = capsys.readouterr().out
    assert "compiled in" in out
    # Not on a terminal: one plain line per evaluation, with its rate and ETA.
    lines = [x for x in out.splitlines() if x.startswith("round ")]
    assert [x.split()[1] for x in lines] == ["4/12", "8/12", "12/12"]
    assert all("rounds/s" in x and "ETA" in x for x in lines)
    assert lines[-1].endswith("ETA 0m00s")


@pytest.mark.slow
def test_compiled_in_covers_every_compile_the_first_round_needs(tmp_path, toy):
    """'compiled in N s' is the time until the first round can run: nothing compiles between
    that line and the first metrics line, also with the representation analysis (its
    programs) and a table in host memory (its client sampler), which used to compile there."""
    import jax

    import fedjax_rcl

    events = []

    class Compiles(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Finished XLA compilation of "):
                events.append(message.split(" of ", 1)[1].split(" in ", 1)[0])

    def log(line):
        if line.startswith("compiled in"):
            events.append("compiled in")

    handler, logger = Compiles(), logging.getLogger("jax._src.dispatch")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            fedjax_rcl.train(None, "algorithm=moon", "client_states=host", "analysis_every=1",
                             "analysis_images=40", "num_clients=4", "participation=0.5",
                             "partition=iid", "local_epochs=1", "batch_size=20", "rounds=1",
                             f"run_dir={tmp_path / 'run'}", dataset=toy, log=log,
                             callbacks=(lambda record: events.append("first line"),))
    finally:
        logger.removeHandler(handler)
    start = events.index("compiled in")
    assert events[start + 1:events.index("first line")] == []


@pytest.mark.slow
def test_runs_record_their_commands_and_environment(tmp_path):
    """commands.txt starts with the command that created the run and gains one line per
    process; environment.jsonl says what each process ran on."""
    run = tmp_path / "run"
    first = ["train", "algorithm=fedavg", "rounds=2", "num_clients=4", "local_epochs=1",
             f"run_dir={run}", "--no-progress"]
    assert main(first) == 0
    assert main(["resume", str(run), "rounds=3", "--no-progress"]) == 0
    assert (run / "commands.txt").read_text().splitlines() == [
        "fedjax-rcl " + " ".join(first), f"fedjax-rcl resume {run} rounds=3 --no-progress"]
    envs = [json.loads(x) for x in (run / "environment.jsonl").read_text().splitlines()]
    assert [e["first_round"] for e in envs] == [0, 2]
    assert envs[1]["command"].startswith("fedjax-rcl resume")
    for e in envs:
        assert e["backend"] == "cpu" and e["device_kinds"]
        assert {"python", "jax", "jaxlib", "flax", "optax", "numpy"} <= set(e["versions"])
        assert e["cpu"]["cores"] >= 1 and "model_name" in e["cpu"]
        # The XLA settings the programs compiled with (the tests' flags, the model's options).
        assert e["xla_flags"] == os.environ.get("XLA_FLAGS", "")
        assert e["compiler_options"] == compile_options(load_config(None, []).model)
        assert e["threads_env"] == {k: v for k, v in os.environ.items()
                                    if k.startswith(("OMP_", "GOMP_", "KMP_", "DNNL_", "ONEDNN_"))}


def test_progress_line_rate_and_eta():
    from fedjax_rcl.training import progress_line

    record = {"round": 30, "train_loss": 1.5, "test_accuracy": 0.4, "test_accuracy_ema": 0.35}
    # 20 rounds in 40 s: 0.5 rounds/s, 70 rounds left -> 140 s.
    line = progress_line(record, 100, 20, 40.0)
    assert line == ("round 30/100  train loss 1.5000  test acc 0.4000 (EMA 0.3500)  "
                    "0.50 rounds/s  ETA 2m20s")
    assert progress_line(record, 10_000, 20, 40.0).endswith("ETA 5h32m")  # 9970 rounds at 0.5/s


def test_partition_prints_counts_as_integers_and_its_own_help_example(tmp_path, capsys):
    plot = tmp_path / "split.png"
    assert main(["partition", "num_clients=7", "alpha=0.1", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("num_clients", "num_classes", "size_min", "size_max"):
        assert type(out[key]) is int, (key, out[key])
    assert out["num_clients"] == 7 and plot.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        main(["partition", "--help"])
    help_text = capsys.readouterr().out
    assert "rounds=" not in help_text and "alpha=0.05" in help_text


def test_partition_writes_a_plot_only_when_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["partition", "num_clients=5", "partition=iid"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "plot" not in out and list(tmp_path.glob("*.png")) == []
    assert main(["partition", "num_clients=5", "partition=iid", "--plot", "split.png"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plot"] == "split.png"
    assert [p.name for p in tmp_path.glob("*.png")] == ["split.png"]
    assert (tmp_path / "split.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_of_a_missing_directory_says_so(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main(["resume", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fedjax-rcl: error: run_dir={str(missing)!r}: no such directory"]
    assert not missing.exists()
    # A directory that is there but holds no run keeps its own message.
    assert main(["resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a fedjax-rcl run" in err[0]


def _image_folder(root, blue):
    """2 classes x 3 train and 1 test 16x16 PNGs: red and green random, blue ``blue(rng)``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("test", 1)):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                image = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
                image[..., 2] = blue(rng)
                Image.fromarray(image).save(root / split / c / f"{i}.png")
    return root


def test_a_constant_channel_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """Normalising by a std of ~0 would make round 1's loss NaN: refused in one line."""
    from fedjax_rcl.data import load_dataset

    monkeypatch.setenv("FEDJAX_RCL_CACHE", str(tmp_path / "cache"))
    folder = _image_folder(tmp_path / "flat", lambda rng: 7)  # blue constant
    run = tmp_path / "run"
    assert main(["train", f"dataset=imagefolder:{folder}", "algorithm=fedavg", "rounds=1",
                 "num_clients=2", "participation=1", "partition=iid", "local_epochs=1",
                 "batch_size=3", f"run_dir={run}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"fedjax-rcl: error: dataset='imagefolder:{folder}': channel 2 "
                             "has std ")
    assert "constant" in err[0]
    assert not run.exists()  # refused while loading the data, before anything compiled
    # Images that vary in every channel load.
    varied = _image_folder(tmp_path / "varied",
                           lambda rng: rng.integers(0, 256, (16, 16), dtype=np.uint8))
    ds = load_dataset(f"imagefolder:{varied}")
    assert len(ds.std) == 3 and min(ds.std) > 0.1


def test_partition_plot_title_is_wrapped_inside_the_figure(tmp_path):
    import numpy as np

    from fedjax_rcl.data import plot_class_counts

    counts = np.arange(3 * 10).reshape(3, 10)
    title = "imagefolder:" + "/a-very-long-folder-name" * 12 + ": dirichlet (alpha=0.05)"
    fig = plot_class_counts(counts, tmp_path / "p.png", title=title)
    renderer = fig.canvas.get_renderer()
    box, inside = fig._suptitle.get_window_extent(renderer), fig.bbox
    assert inside.x0 <= box.x0 and box.x1 <= inside.x1, (box, inside)


def test_missing_datasets_say_so_in_one_line_without_warnings(tmp_path, capsys, monkeypatch,
                                                              caplog):
    """No doubled 'dataset=...' prefix, and no TFDS warnings before the error."""
    from fedjax_rcl.data import tfds_source

    monkeypatch.setattr(tfds_source, "_online", lambda: False)  # never wait for a network
    empty = tmp_path / "empty"
    empty.mkdir()
    for dataset in ("tiny_imagenet", "cifar10"):
        assert main(["train", f"dataset={dataset}", f"data_dir={empty}",
                     f"run_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith(f"fedjax-rcl: error: dataset='{dataset}': ")
        assert err[0].count("dataset=") == 1, err[0]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []

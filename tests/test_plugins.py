"""A user's algorithm, model and server optimizer, registered from their own modules exactly as
docs/plugins.md shows, train, resume (in a fresh process) and evaluate from the command line."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from fedjax_rcl import builtins, registry
from fedjax_rcl.cli import main

PLUGINS_DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def _example(heading: str) -> str:
    section = PLUGINS_DOC.read_text().split(f"## {heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _readme_example() -> str:
    return _example("Your own algorithm")


def _readme_model_example() -> str:
    return _example("Your own model")


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "my_algorithms.py").write_text(_readme_example())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


ARGS = ["dataset=digits", "num_clients=10", "participation=0.5", "local_epochs=1",
        "partition=iid", "--no-progress"]


@pytest.mark.slow
def test_custom_algorithm_trains_resumes_and_evaluates(user_dir, capsys, fresh_registry):
    run = user_dir / "run"
    status = main(["train", "plugins=[my_algorithms]", "algorithm=label_smoothing",
                   "label_smoothing.smoothing=0.2", "rounds=2", f"run_dir={run}", *ARGS])
    assert status == 0, capsys.readouterr().err
    assert "label_smoothing" in registry.ALGORITHMS
    saved = (run / "config.yaml").read_text()
    assert "- my_algorithms" in saved and "smoothing: 0.2" in saved
    # A fresh process knows nothing of the plugin until config.yaml names it.
    fresh_registry()
    assert "label_smoothing" not in registry.ALGORITHMS
    assert main(["resume", str(run), "rounds=4", "--no-progress"]) == 0, \
        capsys.readouterr().err
    assert "label_smoothing" in registry.ALGORITHMS
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert all(r["smoothed_ce"] > 0 for r in rows)
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["round"] == 4


@pytest.mark.slow
def test_readme_model_with_dropout_trains_resumes_and_evaluates(tmp_path, monkeypatch,
                                                                capsys, fresh_registry):
    """The documented model (an MLP with dropout, whose key the engine supplies) under the
    default algorithm (FedRCL on its one level), from the command line."""
    (tmp_path / "my_models.py").write_text(_readme_model_example())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    status = main(["train", "plugins=[my_models]", "model=mlp", "rounds=2", f"run_dir={run}",
                   *ARGS])
    assert status == 0, capsys.readouterr().err
    fresh_registry()  # resume as a fresh process would: the plugin is imported again
    assert "mlp" not in registry.MODELS
    assert main(["resume", str(run), "rounds=4", "--no-progress"]) == 0, \
        capsys.readouterr().err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["test_accuracy"] > 0.3  # digits, 10 classes: it learns
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["round"] == 4


@pytest.mark.slow
def test_docs_server_optimizer_trains_resumes_and_evaluates(tmp_path, monkeypatch, capsys,
                                                            fresh_registry):
    """The documented server optimizer (clipped FedAvg) from the command line: its section is
    checked, it trains, resumes in a fresh process and evaluates."""
    example = _example("Your own server optimizer")
    (tmp_path / "my_server.py").write_text(example)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    assert main(["train", "plugins=[my_server]", "server.optimizer=clipped",
                 "server.clipped.max_norm=0", f"run_dir={run}", *ARGS]) == 2
    assert "server.clipped.max_norm=0.0: must be > 0" in capsys.readouterr().err
    status = main(["train", "plugins=[my_server]", "server.optimizer=clipped",
                   "server.clipped.max_norm=0.5", "algorithm=fedavg", "rounds=2",
                   f"run_dir={run}", *ARGS])
    assert status == 0, capsys.readouterr().err
    assert "max_norm: 0.5" in (run / "config.yaml").read_text()
    fresh_registry()  # resume as a fresh process would: the plugin is imported again
    assert "clipped" not in registry.SERVER_OPTIMIZERS
    assert main(["resume", str(run), "rounds=3", "--no-progress"]) == 0, \
        capsys.readouterr().err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["round"] == 3


def test_custom_section_is_checked_and_bad_plugins_are_config_errors(user_dir, capsys):
    assert main(["train", "plugins=[my_algorithms]", "algorithm=label_smoothing",
                 "label_smoothing.smoothing=1.5", *ARGS]) == 2
    assert "label_smoothing.smoothing=1.5: must be in [0, 1)" in capsys.readouterr().err
    assert main(["train", "plugins=[no_such_module]", *ARGS]) == 2
    err = capsys.readouterr().err
    assert "plugins: cannot import 'no_such_module' (ModuleNotFoundError" in err
    assert "Traceback" not in err
    # Without the plugin, its algorithm and section are unknown (names what is allowed).
    assert main(["train", "algorithm=label_smoothing_x", *ARGS]) == 2
    assert "algorithm='label_smoothing_x': allowed: fedavg" in capsys.readouterr().err


def test_a_runs_record_omits_the_sections_of_plugins_it_does_not_name(user_dir, capsys,
                                                                      fresh_registry):
    """One process may have imported an earlier run's plugin: a later run's config.yaml must
    still read back in a fresh process that knows only the plugins this run names."""
    from fedjax_rcl.config import load_config, to_yaml

    assert builtins.load_plugins(["my_algorithms"]) == []
    assert registry.ALGORITHMS["label_smoothing"].origin == "my_algorithms"
    assert registry.ALGORITHMS["fedrcl"].origin is None
    without = to_yaml(load_config(None, ["dataset=digits"]))
    assert "label_smoothing" not in without and "fedrcl:" in without
    with_it = to_yaml(load_config(None, ["plugins=[my_algorithms]"]))
    assert "label_smoothing:" in with_it and "smoothing: 0.1" in with_it
    (user_dir / "c.yaml").write_text(without)
    fresh_registry()  # read back as a fresh process would, knowing no plugin
    assert main(["train", "c.yaml", "--print-config"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == without


def test_registering_a_taken_name_is_refused(fresh_registry):
    from fedjax_rcl.config import schema

    with pytest.raises(ValueError, match="already registered"):
        registry.register_algorithm("fedavg", lambda s, m: None)

    @dataclasses.dataclass
    class Section:
        x: int = 0

    # A section named as a core key: the config's schema, which knows the core keys, refuses it.
    registry.register_algorithm("x_alg", lambda s, m: None, config=Section, section="rounds")
    with pytest.raises(ValueError, match="algorithm 'x_alg': section 'rounds' is a core config "
                                         "key"):
        schema()
    fresh_registry()
    assert "x_alg" not in registry.ALGORITHMS and schema() is not None


def _readme_dataset_example() -> str:
    readme = PLUGINS_DOC.parents[1] / "README.md"
    section = readme.read_text().split("## Your own data\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_dataset_trains_resumes_and_evaluates(tmp_path, monkeypatch, capsys,
                                                     fresh_registry):
    """The README's generated dataset, named by a plugin, from the command line: a skewed
    split, training, a resume in a fresh process and an evaluation."""
    (tmp_path / "my_data.py").write_text(_readme_dataset_example())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    assert main(["partition", "plugins=my_data", "dataset=stripes", "num_clients=10",
                 "alpha=0.5", "--plot", str(tmp_path / "split.png")]) == 0
    assert json.loads(capsys.readouterr().out)["num_classes"] == 2
    status = main(["train", "plugins=my_data", "dataset=stripes", "algorithm=fedavg",
                   "num_clients=10", "participation=0.3", "rounds=3",
                   f"run_dir={run}", "--no-progress"])
    assert status == 0, capsys.readouterr().err
    fresh_registry()  # resume as a fresh process would: the plugin is imported again
    assert "stripes" not in registry.DATASETS
    assert main(["resume", str(run), "rounds=6", "--no-progress"]) == 0, \
        capsys.readouterr().err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["test_accuracy"] > 0.8  # stripes are easy
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["round"] == 6


def test_a_dataset_loaders_arrays_are_checked(tmp_path):
    import numpy as np

    from fedjax_rcl.data import DataError
    from fedjax_rcl.data.sources import from_arrays

    rng = np.random.default_rng(0)
    good = {"train_images": rng.integers(0, 256, (4, 8, 8, 3)).astype(np.uint8),
            "train_labels": [0, 1, 0, 1], "test_labels": [1, 0], "class_names": ["a", "b"],
            "test_images": rng.integers(0, 256, (2, 8, 8, 3)).astype(np.uint8)}
    ds = from_arrays("mine", good)
    assert ds.num_classes == 2 and ds.train_labels.dtype == np.int32 and ds.hflip
    mean = good["train_images"].reshape(-1, 3).mean(axis=0) / 255
    np.testing.assert_allclose(ds.mean, mean, rtol=1e-12)
    for change, message in [({"train_images": np.zeros((4, 8, 8, 3), np.float32)}, "uint8"),
                            ({"test_labels": [1, 2]}, "integers in 0..1"),
                            ({"train_labels": [0, 1, 7, 9]},
                             r"train_labels\[2\] = 7 is out of range \(2 of 4 train labels"),
                            ({"test_labels": [-1, 0]}, r"test_labels\[0\] = -1 is out of range"),
                            ({"train_labels": [0, 1]}, "2 train_labels for 4 train_images"),
                            ({"test_images": np.zeros((2, 9, 9, 3), np.uint8)}, "differ"),
                            ({"std": (1.0,)}, "one value per channel")]:
        with pytest.raises(DataError, match=message):
            from_arrays("mine", {**good, **change})
    with pytest.raises(DataError, match="lacks class_names"):
        from_arrays("mine", {k: v for k, v in good.items() if k != "class_names"})
    builtins.load()  # (run alone, nothing has registered the built-ins yet)
    with pytest.raises(ValueError, match="already registered"):  # the built-in's name
        registry.register_dataset("cifar10", lambda: good)


SMALL_DATA = '''
import numpy as np
from fedjax_rcl.registry import register_dataset

def load():
    rng = np.random.default_rng(0)
    return {"train_images": rng.integers(0, 256, (40, 8, 8, 1)).astype(np.uint8),
            "train_labels": np.arange(40) % 2, "class_names": ["a", "b"],
            "test_images": rng.integers(0, 256, (10, 8, 8, 1)).astype(np.uint8),
            "test_labels": np.arange(10) % 2}

register_dataset("tiny8", load)
'''


@pytest.mark.slow
def test_data_smaller_than_the_model_takes_is_one_line(tmp_path, monkeypatch, capsys):
    """MOON's CNN takes 16x16 at least: 8x8 images, from a plugin or an image folder, are
    refused with one line naming the model, its minimum and the data's size (exit 2), where
    they used to end in a JAX traceback."""
    import numpy as np
    from PIL import Image

    (tmp_path / "tiny_data.py").write_text(SMALL_DATA)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FEDJAX_RCL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "folder"
    for split in ("train", "test"):
        for c in ("a", "b"):
            (folder / split / c).mkdir(parents=True)
            for i in range(3):
                Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(
                    folder / split / c / f"{i}.png")
    common = ["num_clients=2", "participation=1", "rounds=1", "batch_size=2",
              "--no-progress"]
    for spec, extra in (("tiny8", ["plugins=tiny_data"]), (f"imagefolder:{folder}", [])):
        assert main(["train", f"dataset={spec}", "model=cnn", *extra, *common,
                     f"run_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"fedjax-rcl: error: model=cnn: takes images of at least 16x16; "
                       f"dataset={spec} has 8x8 images (choose a model for images this small, "
                       "or larger images)"], err
    # A model that takes them trains on the same data.
    assert main(["train", "dataset=tiny8", "plugins=tiny_data", "model=pfl_cnn", *common,
                 f"run_dir={tmp_path / 'ok'}"]) == 0, capsys.readouterr().err


@pytest.mark.slow
def test_stateful_example_trains_like_the_built_in_scaffold_and_resumes(tmp_path, monkeypatch,
                                                                        capsys,
                                                                        fresh_registry):
    """docs/plugins.md's stateful example, as written, is SCAFFOLD: its runs give the built-in
    ``algorithm=scaffold``'s metrics, and it resumes in a fresh process."""
    (tmp_path / "my_scaffold.py").write_text(_example("A stateful algorithm"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ["rounds=2", "momentum=0.9", "partition=dirichlet", "alpha=0.5", *ARGS]
    mine, builtin = tmp_path / "mine", tmp_path / "builtin"
    assert main(["train", "plugins=[my_scaffold]", "algorithm=my_scaffold",
                 f"run_dir={mine}", *common]) == 0, capsys.readouterr().err
    assert main(["train", "algorithm=scaffold", f"run_dir={builtin}", *common]) == 0
    rows = lambda run: [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # Two programs compiled apart: equal within float reassociation (an accuracy may move
    # by an image whose logits nearly tie).
    for a, b in zip(rows(mine), rows(builtin), strict=True):
        for k in ("train_loss", "ce", "test_loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=3 / 359)
    fresh_registry()
    assert main(["resume", str(mine), "rounds=3", "--no-progress"]) == 0, \
        capsys.readouterr().err
    assert [r["round"] for r in rows(mine)] == [1, 2, 3]

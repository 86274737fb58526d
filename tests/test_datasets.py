"""A built-in dataset is one module of ``fedjax_rcl.datasets``: it registers itself through
``registry.register_dataset``, as a plugin's dataset does, with its loader, its normalisation and
its line of the configuration reference, and nothing but the package's list of its modules
names it."""

import importlib
import sys

import numpy as np
import pytest
from PIL import Image

import fedjax_rcl
import fedjax_rcl.datasets
from fedjax_rcl import reference, registry
from fedjax_rcl.config import load_config
from fedjax_rcl.data import DataError, load_dataset

# The whole of a new built-in dataset: one module in fedjax_rcl/datasets/ (and its name in the
# package's list).
TOY_MODULE = '''
"""``dataset=toy_stripes``: two classes of generated 16x16 stripes (horizontal, vertical)."""

import numpy as np

from fedjax_rcl import registry
from fedjax_rcl.data.normalization import by_class_names

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
CLASSES = ("horizontal", "vertical")


def load(cache_dir=None):
    rng = np.random.default_rng(0)

    def split(n):
        labels = rng.integers(0, 2, n)
        stripes = (np.arange(16) // 2 % 2 * 200).astype(np.int32)
        rows = np.broadcast_to(stripes[:, None], (16, 16))
        images = np.where(labels[:, None, None] == 0, rows, rows.T)[..., None]
        noise = rng.integers(0, 50, (n, 16, 16, 3))
        return (images + noise).astype(np.uint8), labels

    (xtr, ytr), (xte, yte) = split(160), split(40)
    return {"train_images": xtr, "train_labels": ytr, "test_images": xte,
            "test_labels": yte, "class_names": CLASSES}


registry.register_dataset("toy_stripes", load, mean=MEAN, std=STD,
                          recognise=by_class_names(CLASSES, 16),
                          doc="two classes of generated 16x16 stripes")
'''


@pytest.fixture
def toy_builtin(tmp_path, monkeypatch):
    """``fedjax_rcl/datasets/`` with the toy module in it (a second folder of the package),
    imported as the package imports the modules it lists; the registry's datasets are restored
    after."""
    folder = tmp_path / "more_datasets"
    folder.mkdir()
    (folder / "toy_stripes.py").write_text(TOY_MODULE)
    monkeypatch.setattr(fedjax_rcl.datasets, "__path__",
                        [*fedjax_rcl.datasets.__path__, str(folder)])
    monkeypatch.setattr(registry, "DATASETS", dict(registry.DATASETS))
    importlib.import_module("fedjax_rcl.datasets.toy_stripes")  # its line in the list
    yield
    sys.modules.pop("fedjax_rcl.datasets.toy_stripes", None)


def test_every_built_in_dataset_is_one_module_that_registers_it():
    import pkgutil

    modules = [m.name for m in pkgutil.iter_modules(fedjax_rcl.datasets.__path__)]
    assert sorted(modules) == ["cifar10", "cifar100", "digits", "tiny_imagenet"]
    assert sorted(fedjax_rcl.datasets.__all__) == sorted(modules)  # the package lists them all
    for name in modules:
        entry = registry.DATASETS[name]
        assert entry.loader.__module__ == f"fedjax_rcl.datasets.{name}"
        assert entry.doc and entry.origin is None


@pytest.mark.slow
def test_a_new_built_in_dataset_is_one_module(toy_builtin, tmp_path, capsys):
    # Named by a config, checked, and listed in the reference with its line.
    cfg = load_config(None, ["dataset=toy_stripes"])
    assert cfg.dataset == "toy_stripes"
    assert "`toy_stripes`: two classes of generated 16x16 stripes." in \
        reference.text("dataset").replace("\n    ", " ")
    with pytest.raises(DataError, match="did you mean 'toy_stripes'"):
        load_dataset("toy_stripe")
    # Loaded with its own normalisation constants.
    ds = load_dataset("toy_stripes")
    assert (ds.mean, ds.std) == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert ds.class_names == ("horizontal", "vertical") and ds.image_shape == (16, 16, 3)
    # An image folder holding it is recognised and gets the same constants.
    root = tmp_path / "folder"
    for split in ("train", "test"):
        for c, images in (("horizontal", ds.train_images[ds.train_labels == 0][:2]),
                          ("vertical", ds.train_images[ds.train_labels == 1][:2])):
            (root / split / c).mkdir(parents=True)
            for i, im in enumerate(images):
                Image.fromarray(im).save(root / split / c / f"{i}.png")
    folder = load_dataset(f"imagefolder:{root}", cache_dir=tmp_path / "cache")
    assert (folder.mean, folder.std) == (ds.mean, ds.std)
    # And it trains by name.
    run = fedjax_rcl.train(None, "dataset=toy_stripes", "algorithm=fedavg", "num_clients=4",
                           "participation=0.5", "local_epochs=1", "partition=iid",
                           "batch_size=20", "rounds=2", f"run_dir={tmp_path / 'run'}")
    assert [r["round"] for r in run.metrics] == [1, 2]
    assert np.isfinite(run.metrics[-1]["test_loss"])

"""Tiny-ImageNet from the official archive layout (``tiny-imagenet-200``), as a folder and as a
zip, generated here in that exact layout: labels, the labelled validation split as test, the
the named constants, grayscale JPEGs, the errors a broken archive gets, and a run from the command
line."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
from PIL import Image

from fedjax_rcl.cli import main
from fedjax_rcl.data.sources import DataError, check_dataset_spec, load_dataset

WNIDS = ["n02124075", "n01443537", "n09193705"]  # wnids.txt order is not sorted order
N_TRAIN, N_VAL = 4, 2


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDJAX_RCL_CACHE", str(tmp_path / "cache"))


def _jpeg(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _archive(seed=0) -> tuple[dict[str, bytes], dict[str, tuple[int, float]]]:
    """Member -> bytes of a small tiny-imagenet-200, and per image (label, mean brightness)."""
    rng = np.random.default_rng(seed)
    files, truth = {}, {}
    sorted_ids = sorted(WNIDS)

    def image(name, wnid, gray=False):
        level = 40 + 80 * sorted_ids.index(wnid) + int(rng.integers(0, 20))
        pixels = np.full((64, 64) if gray else (64, 64, 3), level, np.uint8)
        files[name] = _jpeg(pixels)
        truth[name] = (sorted_ids.index(wnid), level)

    top = "tiny-imagenet-200/"
    files[top + "wnids.txt"] = ("\n".join(WNIDS) + "\n").encode()
    files[top + "words.txt"] = b"n02124075\tEgyptian cat\n"
    for w in WNIDS:
        files[f"{top}train/{w}/{w}_boxes.txt"] = b""
        for i in range(N_TRAIN):
            image(f"{top}train/{w}/images/{w}_{i}.JPEG", w, gray=(w == WNIDS[0] and i == 0))
    lines = []
    for i in range(N_VAL * len(WNIDS)):
        w = WNIDS[i % len(WNIDS)]
        image(f"{top}val/images/val_{i}.JPEG", w)
        lines.append(f"val_{i}.JPEG\t{w}\t0\t0\t63\t63")
    files[top + "val/val_annotations.txt"] = ("\n".join(lines) + "\n").encode()
    # The official unlabelled test split: present, never read.
    files[top + "test/images/test_0.JPEG"] = _jpeg(np.zeros((64, 64, 3), np.uint8))
    return files, truth


def _write(tmp_path, files, as_zip):
    tmp_path.mkdir(parents=True, exist_ok=True)
    if as_zip:
        path = tmp_path / "tiny-imagenet-200.zip"
        with zipfile.ZipFile(path, "w") as zf:
            for name, data in files.items():
                zf.writestr(name, data)
        return tmp_path
    for name, data in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return tmp_path


@pytest.mark.parametrize("as_zip", [False, True], ids=["folder", "zip"])
def test_loads_the_official_layout(tmp_path, as_zip):
    files, truth = _archive()
    data_dir = _write(tmp_path / "data", files, as_zip)
    check_dataset_spec("tiny_imagenet", data_dir=str(data_dir))
    ds = load_dataset("tiny_imagenet", data_dir=str(data_dir))
    assert ds.name == "tiny_imagenet"
    assert ds.class_names == tuple(sorted(WNIDS))
    assert ds.train_images.shape == (N_TRAIN * 3, 64, 64, 3)
    assert ds.test_images.shape == (N_VAL * 3, 64, 64, 3)
    assert ds.train_images.dtype == np.uint8
    # Labels: each image's brightness was drawn around its class's level (JPEG is lossy).
    for images, labels, split in ((ds.train_images, ds.train_labels, "train"),
                                  (ds.test_images, ds.test_labels, "val")):
        members = sorted(m for m in truth if f"/{split}/" in m)
        assert sorted(labels.tolist()) == sorted(truth[m][0] for m in members)
        for img, y in zip(images, labels, strict=True):
            assert abs(float(img.mean()) - (40 + 80 * int(y) + 10)) <= 12
    np.testing.assert_allclose(ds.mean, (0.4802, 0.4481, 0.3975))
    np.testing.assert_allclose(ds.std, (0.2770, 0.2691, 0.2821))
    # The folder itself, or the zip's path, work as data_dir too.
    named = data_dir / ("tiny-imagenet-200.zip" if as_zip else "tiny-imagenet-200")
    again = load_dataset("tiny_imagenet", data_dir=str(named))
    np.testing.assert_array_equal(again.train_labels, ds.train_labels)


@pytest.mark.parametrize("breakage,match", [
    ("no_wnids", "has no wnids.txt"),
    ("no_annotations", "has no tiny-imagenet-200/val/val_annotations.txt"),
    ("unknown_class", "line 1: .* does not name a file and a class of wnids.txt"),
    ("missing_image", "line 2: tiny-imagenet-200/val/images/val_1.JPEG is missing"),
    ("empty_class", "no training images in tiny-imagenet-200/train/n01443537/images/"),
])
def test_broken_archives_are_data_errors(tmp_path, breakage, match):
    files, _ = _archive()
    top = "tiny-imagenet-200/"
    if breakage == "no_wnids":
        del files[top + "wnids.txt"]
    elif breakage == "no_annotations":
        del files[top + "val/val_annotations.txt"]
    elif breakage == "unknown_class":
        files[top + "val/val_annotations.txt"] = b"val_0.JPEG\tn99999999\t0\t0\t1\t1\n"
    elif breakage == "missing_image":
        del files[top + "val/images/val_1.JPEG"]
    elif breakage == "empty_class":
        files = {k: v for k, v in files.items() if "train/n01443537/images" not in k}
    data_dir = _write(tmp_path / "data", files, as_zip=True)
    with pytest.raises(DataError, match=match):
        check_dataset_spec("tiny_imagenet", data_dir=str(data_dir))


def test_missing_archive_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    with pytest.raises(DataError, match=r"no tiny-imagenet-200 found \(looked at .*tfds/"
                                        r"downloads/manual.*cs231n"):
        check_dataset_spec("tiny_imagenet")


@pytest.mark.slow
def test_trains_from_the_command_line(tmp_path, capsys):
    files, _ = _archive()
    data_dir = _write(tmp_path / "data", files, as_zip=True)
    run = tmp_path / "run"
    status = main(["train", "dataset=tiny_imagenet", f"data_dir={data_dir}", "model=resnet10",
                   "width=4", "algorithm=fedavg", "num_clients=2", "participation=1.0",
                   "partition=iid", "local_epochs=1", "batch_size=4", "rounds=1",
                   f"run_dir={run}", "--no-progress"])
    assert status == 0, capsys.readouterr().err
    assert "tiny_imagenet: 12 train / 6 test, 3 classes" in capsys.readouterr().out
    assert main(["train", "dataset=tiny_imagenet", f"data_dir={tmp_path / 'nowhere'}",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no tiny-imagenet-200 found" in err and "Traceback" not in err

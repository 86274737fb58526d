"""Tests of the data sources: embedded digits, image folders (dir and zip), TFDS CIFAR.

Everything runs offline on tiny data made in ``tmp_path``; TFDS tests prepare a fake CIFAR
archive in the real binary format and fail if a download is attempted. The shared CIFAR-10 zip
test is skipped when the shared folder is absent.
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedjax_rcl.data import files as image_files
from fedjax_rcl.data import normalization, sources
from fedjax_rcl.data.sources import (
    DataError,
    channel_stats,
    check_dataset_spec,
    default_cache_dir,
    load_dataset,
)
from fedjax_rcl.datasets import cifar10, cifar100


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Never touch the user's cache, even through a default argument."""
    monkeypatch.setenv("FEDJAX_RCL_CACHE", str(tmp_path / "default-cache"))


def _png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _tree(seed=0, classes=("cat", "ant", "bee"), n_train=(3, 2, 4), n_test=(1, 2, 1),
          size=(6, 5)) -> dict[str, np.ndarray]:
    """Member path -> RGB image (``uint8 [H, W, 3]``) of a small random image folder."""
    rng = np.random.default_rng(seed)
    tree = {}
    for split, counts in (("train", n_train), ("test", n_test)):
        for c, n in zip(classes, counts, strict=True):
            for i in range(n):
                tree[f"{split}/{c}/{i}.png"] = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    return tree


def _write_dir(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def _write_zip(path: Path, files: dict[str, bytes], top: str = "") -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(top + name, data)
    return path


def _encoded(tree: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {name: _png(image) for name, image in tree.items()}


def _expected(tree: dict[str, np.ndarray], split: str):
    """Images and labels in the loader's order: sorted member paths, labels = sorted classes."""
    classes = sorted({name.split("/")[1] for name in tree})
    names = sorted(n for n in tree if n.startswith(split + "/"))
    return (np.stack([tree[n] for n in names]),
            np.array([classes.index(n.split("/")[1]) for n in names]))


def _layouts(tmp_path: Path, files: dict[str, bytes]) -> dict[str, Path]:
    return {
        "dir": _write_dir(tmp_path / "folder", files),
        "zip": _write_zip(tmp_path / "flat.zip", files),
        "zip-top": _write_zip(tmp_path / "top.zip", files, top="mydata/"),
    }


def _no_decode(*args, **kwargs):
    raise AssertionError("an image was decoded")


# ---------------------------------------------------------------------------------------------
# digits


def test_digits_properties():
    ds = load_dataset("digits")
    assert ds.name == "digits" and ds.hflip is False
    assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.int32
    assert ds.image_shape == (32, 32, 1) and ds.test_images.shape[1:] == (32, 32, 1)
    assert len(ds.train_images) + len(ds.test_images) == 1797
    assert ds.num_classes == 10 and ds.class_names == tuple("0123456789")
    # Stratified: round(20%) of each class is in test.
    total = np.bincount(ds.train_labels, minlength=10) + np.bincount(ds.test_labels, minlength=10)
    np.testing.assert_array_equal(np.bincount(ds.test_labels, minlength=10),
                                  np.round(0.2 * total).astype(int))
    assert ds.train_images.min() == 0 and ds.train_images.max() == 255
    x = ds.train_images / 255.0
    np.testing.assert_allclose(ds.mean, x.mean(axis=(0, 1, 2)), atol=1e-9)
    np.testing.assert_allclose(ds.std, x.std(axis=(0, 1, 2)), atol=1e-9)
    again = load_dataset("digits")  # deterministic split and images
    np.testing.assert_array_equal(again.test_images, ds.test_images)
    np.testing.assert_array_equal(again.train_labels, ds.train_labels)


def test_digits_are_upsampled_sklearn_digits():
    from sklearn.datasets import load_digits

    ds = load_dataset("digits")
    digits = load_digits()
    # Every test image is the bilinear 32x32 upsampling of one 0..16 digit scaled to 0..255.
    small = np.rint(digits.images * 255 / 16).astype(np.uint8)
    first = np.asarray(Image.fromarray(small[0]).resize((32, 32), Image.Resampling.BILINEAR))
    all_images = np.concatenate([ds.train_images, ds.test_images])[..., 0]
    assert any((im == first).all() for im in all_images)
    assert ds.train_images.flags.writeable is False  # shared dataset is read-only


# ---------------------------------------------------------------------------------------------
# image folders


@pytest.mark.parametrize("layout", ["dir", "zip", "zip-top"])
def test_imagefolder_loads_images_labels_and_stats(tmp_path, layout):
    tree = _tree()
    files = _encoded(tree)
    # Junk that must be ignored: OS metadata, non-images, hidden files, macOS resource forks.
    files.update({"train/cat/.DS_Store": b"junk", "train/Thumbs.db": b"junk",
                  "test/ant/notes.txt": b"junk", "train/bee/.hidden.png": b"junk"})
    root = _layouts(tmp_path, files)[layout]
    if layout == "zip-top":  # macOS adds __MACOSX/ beside the top folder; still one dataset.
        with zipfile.ZipFile(root, "a") as zf:
            zf.writestr("__MACOSX/mydata/train/cat/._0.png", b"junk")
    ds = load_dataset(f"imagefolder:{root}", cache_dir=tmp_path / "cache")

    assert ds.name == f"imagefolder:{root.resolve()}" and ds.hflip is True
    assert ds.class_names == ("ant", "bee", "cat") and ds.num_classes == 3
    assert ds.image_shape == (6, 5, 3)
    for split in ("train", "test"):
        images, labels = _expected(tree, split)
        np.testing.assert_array_equal(getattr(ds, f"{split}_images"), images)
        np.testing.assert_array_equal(getattr(ds, f"{split}_labels"), labels)
        assert getattr(ds, f"{split}_labels").dtype == np.int32
    np.testing.assert_array_equal(np.bincount(ds.train_labels), [2, 4, 3])
    x = ds.train_images / 255.0
    np.testing.assert_allclose(ds.mean, x.mean(axis=(0, 1, 2)), atol=1e-9)
    np.testing.assert_allclose(ds.std, x.std(axis=(0, 1, 2)), atol=1e-9)


def test_imagefolder_converts_modes_to_rgb(tmp_path):
    grey = np.arange(20, dtype=np.uint8).reshape(4, 5) * 12
    rgba = np.full((4, 5, 4), 200, np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 5, 3), 90, np.uint8)).save(buf, format="JPEG", quality=95)
    files = {"train/a/g.png": _png(grey), "train/b/r.png": _png(rgba),
             "test/a/j.JPG": buf.getvalue(), "test/b/g.png": _png(grey)}
    ds = load_dataset(f"imagefolder:{_write_dir(tmp_path / 'f', files)}",
                      cache_dir=tmp_path / "cache")
    assert ds.image_shape == (4, 5, 3)
    np.testing.assert_array_equal(ds.train_images[0], np.repeat(grey[..., None], 3, axis=2))
    np.testing.assert_array_equal(ds.train_images[1], 200)
    assert np.abs(ds.test_images[0].astype(int) - 90).max() <= 2  # JPEG is lossy


def test_imagefolder_second_load_decodes_nothing(tmp_path, monkeypatch):
    tree = _tree()
    roots = _layouts(tmp_path, _encoded(tree))
    cache = tmp_path / "cache"
    first = {k: load_dataset(f"imagefolder:{r}", cache_dir=cache) for k, r in roots.items()}
    assert len(list(cache.glob("imagefolder-*.npz"))) == 3
    monkeypatch.setattr(image_files, "decode_image", _no_decode)
    for key, root in roots.items():
        again = load_dataset(f"imagefolder:{root}", cache_dir=cache)
        np.testing.assert_array_equal(again.train_images, first[key].train_images)
        np.testing.assert_array_equal(again.test_labels, first[key].test_labels)
        assert again.class_names == first[key].class_names and again.mean == first[key].mean
    # The default cache dir comes from FEDJAX_RCL_CACHE.
    assert default_cache_dir() == tmp_path / "default-cache"


def test_imagefolder_cache_invalidated_by_changed_files(tmp_path, monkeypatch):
    tree = _tree()
    roots = _layouts(tmp_path, _encoded(tree))
    cache = tmp_path / "cache"
    for root in roots.values():
        load_dataset(f"imagefolder:{root}", cache_dir=cache)
    # Change one image inside the folder (size and mtime change) and rewrite a zip.
    (roots["dir"] / "train/cat/0.png").write_bytes(_png(np.zeros((6, 5, 3), np.uint8)))
    _write_zip(roots["zip"], _encoded(_tree(seed=1)))
    st = roots["zip"].stat()
    os.utime(roots["zip"], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    monkeypatch.setattr(image_files, "decode_image", _no_decode)
    for key in ("dir", "zip"):
        with pytest.raises(AssertionError, match="decoded"):
            load_dataset(f"imagefolder:{roots[key]}", cache_dir=cache)
    load_dataset(f"imagefolder:{roots['zip-top']}", cache_dir=cache)  # untouched: cached


def test_cache_write_is_atomic(tmp_path, monkeypatch):
    root = _write_dir(tmp_path / "f", _encoded(_tree()))
    cache = tmp_path / "cache"
    real_savez = np.savez

    def killed_savez(file, **arrays):
        file.write(b"PK\x03\x04 half a file")
        raise KeyboardInterrupt  # as if the process were killed mid-write

    monkeypatch.setattr(np, "savez", killed_savez)
    with pytest.raises(KeyboardInterrupt):
        load_dataset(f"imagefolder:{root}", cache_dir=cache)
    assert list(cache.iterdir()) == []  # neither a partial entry nor a temp file
    monkeypatch.setattr(np, "savez", real_savez)
    # Temp files left by killed writers: an old one is removed, a recent one (maybe a live
    # concurrent writer's) is kept.
    load_dataset(f"imagefolder:{root}", cache_dir=cache)
    (entry,) = cache.iterdir()
    entry.unlink()
    old, young = cache / f".{entry.name}.old.tmp", cache / f".{entry.name}.young.tmp"
    for tmp in (old, young):
        tmp.write_bytes(b"half")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    ds = load_dataset(f"imagefolder:{root}", cache_dir=cache)
    assert sorted(cache.iterdir()) == sorted([entry, young])
    young.unlink()
    assert entry.suffix == ".npz"
    # A damaged entry counts as a miss: it is rebuilt, not trusted.
    entry.write_bytes(entry.read_bytes()[:100])
    again = load_dataset(f"imagefolder:{root}", cache_dir=cache)
    np.testing.assert_array_equal(again.train_images, ds.train_images)
    # An unusable cache dir (here: a file) only costs a warning.
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    load_dataset(f"imagefolder:{root}", cache_dir=blocker / "sub")


def _error(spec_or_root, match: str, cache_dir=None):
    """Asserts that loading raises a one-line DataError matching ``match``; returns it."""
    spec = spec_or_root if isinstance(spec_or_root, str) else f"imagefolder:{spec_or_root}"
    with pytest.raises(DataError, match=match) as info:
        load_dataset(spec, cache_dir=cache_dir)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("spec, match", [
    ("cifar11", "unknown dataset 'cifar11'.*imagefolder:PATH"),
    ("Digits", "unknown dataset 'Digits'"),
    ("imagefolder:", "names no path"),
])
def test_bad_specs(spec, match):
    with pytest.raises(DataError, match=match):
        check_dataset_spec(spec)
    with pytest.raises(DataError, match=match):
        load_dataset(spec)


def test_spec_must_be_a_string():
    with pytest.raises(DataError, match="must be a string, got 3"):
        check_dataset_spec(3)


def test_imagefolder_path_errors(tmp_path):
    missing = tmp_path / "nope.zip"
    for check in (True, False):
        with pytest.raises(DataError, match=f"{missing} does not exist"):
            (check_dataset_spec if check else load_dataset)(f"imagefolder:{missing}")
    text = tmp_path / "data.zip"
    text.write_text("not a zip")
    with pytest.raises(DataError, match=f"{text} is neither a directory nor a zip"):
        check_dataset_spec(f"imagefolder:{text}")
    # A zip cut short (an interrupted copy) says so, not "neither a directory nor a zip".
    whole = _write_zip(tmp_path / "whole.zip", _encoded(
        {f"{split}/c{k}/{i}.png": np.full((8, 8, 3), i, np.uint8)
         for split in ("train", "test") for k in range(2) for i in range(3)}))
    cut = tmp_path / "cut.zip"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    for check in (True, False):
        with pytest.raises(DataError, match=f"{cut} is a damaged or truncated zip"):
            (check_dataset_spec if check else load_dataset)(f"imagefolder:{cut}")


def _layout_error(tmp_path, files: dict[str, bytes], match: str, monkeypatch) -> None:
    """Both layouts, via check (decoding nothing) and load, raise a DataError matching."""
    for kind, root in (("dir", _write_dir(tmp_path / "d", files)),
                       ("zip", _write_zip(tmp_path / "z.zip", files))):
        with monkeypatch.context() as m:
            m.setattr(image_files, "decode_image", _no_decode)
            with pytest.raises(DataError, match=match) as info:
                check_dataset_spec(f"imagefolder:{root}")
            assert str(root) in str(info.value), kind
        with pytest.raises(DataError, match=match):
            load_dataset(f"imagefolder:{root}", cache_dir=tmp_path / "cache")


def test_missing_splits(tmp_path, monkeypatch):
    files = _encoded(_tree())
    _layout_error(tmp_path / "a", {k: v for k, v in files.items() if k.startswith("train/")},
                  r"has no test/ folder", monkeypatch)
    _layout_error(tmp_path / "b", {"other/x/1.png": files["train/cat/0.png"]},
                  r"has no train/ folder .*'other'", monkeypatch)


def test_class_mismatch_and_empty_classes(tmp_path, monkeypatch):
    files = _encoded(_tree())
    no_bee = {k: v for k, v in files.items() if not k.startswith("test/bee/")}
    _layout_error(tmp_path / "a", no_bee, r"missing: \['bee'\], extra: \[\]", monkeypatch)
    extra = {**files, "test/dog/0.png": files["test/ant/0.png"]}
    _layout_error(tmp_path / "b", extra, r"extra: \['dog'\]", monkeypatch)
    only_junk = {k: v for k, v in files.items() if not k.startswith("train/ant/")}
    only_junk["train/ant/readme.txt"] = b"no images here"
    _layout_error(tmp_path / "c", only_junk, r"class folder train/ant/ .* has no images",
                  monkeypatch)
    stray = {**files, "train/loose.png": files["test/ant/0.png"]}
    _layout_error(tmp_path / "d", stray, r"'train/loose.png' .* not inside a class folder",
                  monkeypatch)
    _layout_error(tmp_path / "e", {"train/readme.txt": b"", "test/readme.txt": b""},
                  r"train/ in .* holds no class folders", monkeypatch)


def test_empty_class_directory(tmp_path, monkeypatch):
    root = _write_dir(tmp_path / "d", _encoded(_tree()))
    (root / "train" / "owl").mkdir()
    (root / "test" / "owl").mkdir()
    with pytest.raises(DataError, match=f"class folder train/owl/ in {root} has no images"):
        check_dataset_spec(f"imagefolder:{root}")
    zip_path = _write_zip(tmp_path / "z.zip", _encoded(_tree()))
    with zipfile.ZipFile(zip_path, "a") as zf:  # explicit empty folder entries
        zf.writestr("train/owl/", b"")
        zf.writestr("test/owl/", b"")
    with pytest.raises(DataError, match="class folder train/owl/ .* has no images"):
        check_dataset_spec(f"imagefolder:{zip_path}")


def test_mixed_sizes_name_first_offender(tmp_path):
    tree = _tree()
    tree["train/bee/1.png"] = np.zeros((6, 7, 3), np.uint8)  # W=7, others W=5
    tree["train/cat/2.png"] = np.zeros((8, 5, 3), np.uint8)  # later in sorted order
    for root in _layouts(tmp_path, _encoded(tree)).values():
        message = _error(root, r"train/bee/1\.png'.* is 7x6 but .*train/ant/0\.png'.* is 5x6",
                         cache_dir=tmp_path / "cache")
        assert str(root) in message


@pytest.mark.parametrize("payload", [b"this is not an image", "truncated"])
def test_corrupt_image_is_data_error(tmp_path, payload):
    files = _encoded(_tree())
    if payload == "truncated":
        payload = files["train/cat/1.png"][:60]
    files["train/cat/1.png"] = payload
    for root in _layouts(tmp_path, files).values():
        _error(root, r"cannot decode image '(mydata/)?train/cat/1\.png'",
               cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.npz"))


@pytest.mark.parametrize("member", ["../evil.png", "train/a/../../evil.png", "/abs/evil.png",
                                    "C:/evil.png", "train\\..\\evil.png"])
def test_zip_path_escape_refused(tmp_path, member):
    files = _encoded(_tree())
    path = _write_zip(tmp_path / "z.zip", files)
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr(zipfile.ZipInfo(member), _png(np.zeros((6, 5, 3), np.uint8)))
    with pytest.raises(DataError, match="path escape") as info:
        check_dataset_spec(f"imagefolder:{path}")
    assert repr(member) in str(info.value)
    with pytest.raises(DataError, match="path escape"):
        load_dataset(f"imagefolder:{path}", cache_dir=tmp_path / "cache")


def test_decompression_bomb_guards(tmp_path, monkeypatch):
    files = _encoded(_tree())
    roots = _layouts(tmp_path, files)
    biggest = max(len(v) for v in files.values())
    monkeypatch.setattr(image_files, "MAX_MEMBER_BYTES", biggest - 1)
    _error(roots["zip"], r"unpacks to \d+ bytes .*refusing to decompress",
           cache_dir=tmp_path / "c1")
    _error(roots["dir"], r"exceeds \d+ bytes", cache_dir=tmp_path / "c2")
    monkeypatch.setattr(image_files, "MAX_MEMBER_BYTES", 1 << 20)
    monkeypatch.setattr(image_files, "MAX_PIXELS", 29)  # images are 6x5 = 30 pixels
    _error(roots["zip-top"], r"'mydata/train/ant/0\.png'.* is 5x6 pixels \(limit 29\)",
           cache_dir=tmp_path / "c3")


def test_channel_stats_matches_numpy():
    images = np.random.default_rng(0).integers(0, 256, (2100, 3, 2, 4), dtype=np.uint8)
    mean, std = channel_stats(images)
    x = images / 255.0
    np.testing.assert_allclose(mean, x.mean(axis=(0, 1, 2)), atol=1e-12)
    np.testing.assert_allclose(std, x.std(axis=(0, 1, 2)), atol=1e-12)


# ---------------------------------------------------------------------------------------------
# TFDS (CIFAR) without TensorFlow, on a fake archive in the real binary format


def _fake_cifar_archive(path: Path, *, hundred: bool, per_file: int, seed: int = 0):
    """Writes a CIFAR binary ``.tar.gz``; returns {image bytes: label} of train and test."""
    rng = np.random.default_rng(seed)
    if hundred:
        prefix, train, test = "cifar-100-binary/", ["train.bin"], ["test.bin"]
        names = {"coarse_label_names.txt": [f"super{i}" for i in range(20)],
                 "fine_label_names.txt": [f"fine{i}" for i in range(100)]}
    else:
        prefix = "cifar-10-batches-bin/"
        train, test = [f"data_batch_{i}.bin" for i in range(1, 6)], ["test_batch.bin"]
        names = {"batches.meta.txt": [f"class{i}" for i in range(10)]}
    truth = {"train": {}, "test": {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        def add(name, data):
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for split, batch_files in (("train", train), ("test", test)):
            for name in batch_files:
                fine = rng.integers(0, 100 if hundred else 10, per_file, dtype=np.uint8)
                planes = rng.integers(0, 256, (per_file, 3, 32, 32), dtype=np.uint8)
                labels = [fine // 5, fine] if hundred else [fine]  # coarse byte comes first
                add(name, np.concatenate([*(lab[:, None] for lab in labels),
                                          planes.reshape(per_file, -1)], axis=1).tobytes())
                for lab, image in zip(fine, planes.transpose(0, 2, 3, 1), strict=True):
                    truth[split][image.tobytes()] = int(lab)
        for name, lines in names.items():
            add(name, ("\n".join(lines) + "\n\n").encode())
    return truth


@pytest.fixture
def no_network(monkeypatch):
    """Fails the test on any download attempt or connectivity probe."""
    import tensorflow_datasets as tfds

    from fedjax_rcl.data import tfds_source

    def refuse(*args, **kwargs):
        raise AssertionError("tests must not touch the network")

    monkeypatch.setattr(tfds.download.DownloadManager, "download", refuse)
    monkeypatch.setattr(tfds_source, "_online", refuse)
    return tfds_source


@pytest.mark.parametrize("name, hundred", [("cifar10", False), ("cifar100", True)])
def test_tfds_cifar_prepared_from_archive_without_tf(tmp_path, monkeypatch, no_network, name,
                                                     hundred):
    data_dir = tmp_path / "tfds"
    archive = data_dir / "downloads" / "manual" / f"{name.replace('10', '-10')}-binary.tar.gz"
    truth = _fake_cifar_archive(archive, hundred=hundred, per_file=3)
    check_dataset_spec(name, data_dir=str(data_dir))  # the manual archive makes it preparable
    ds = load_dataset(name, data_dir=str(data_dir), cache_dir=tmp_path / "cache")

    assert "tensorflow" not in sys.modules
    assert ds.name == name and ds.hflip is True and ds.image_shape == (32, 32, 3)
    assert ds.num_classes == (100 if hundred else 10)
    assert ds.class_names[:2] == (("fine0", "fine1") if hundred else ("class0", "class1"))
    expected_stats = {"cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
                      "cifar100": ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))}
    assert (ds.mean, ds.std) == expected_stats[name]
    for split in ("train", "test"):
        images, labels = getattr(ds, f"{split}_images"), getattr(ds, f"{split}_labels")
        assert images.dtype == np.uint8 and labels.dtype == np.int32
        # Same (image, fine label) pairs as written, in whatever order TFDS stored them.
        assert {im.tobytes(): int(lab) for im, lab in zip(images, labels, strict=True)} \
            == truth[split]
    assert (data_dir / name / "3.0.2" / "dataset_info.json").is_file()

    # Cached: the prepared data are not read again.
    with monkeypatch.context() as m:
        m.setattr(no_network, "_read_split", _no_decode)
        cached = load_dataset(name, data_dir=str(data_dir), cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(cached.train_images, ds.train_images)

    # Prepared in data_dir: read through as_data_source, the archive is no longer needed.
    archive.unlink()
    check_dataset_spec(name, data_dir=str(data_dir))
    fresh = load_dataset(name, data_dir=str(data_dir), cache_dir=tmp_path / "cache2")
    np.testing.assert_array_equal(fresh.test_images, ds.test_images)
    np.testing.assert_array_equal(fresh.test_labels, ds.test_labels)

    # Prepared by TensorFlow-based TFDS (tfrecord): not readable here, and the message says so.
    info = data_dir / name / "3.0.2" / "dataset_info.json"
    info.write_text(info.read_text().replace('"array_record"', '"tfrecord"'))
    for call in (check_dataset_spec, load_dataset):
        with pytest.raises(DataError, match=r"stored as \['tfrecord'\], which needs TensorFlow"):
            call(name, data_dir=str(data_dir))


def test_tfds_offline_is_a_data_error(tmp_path, monkeypatch, no_network):
    monkeypatch.setattr(no_network, "_online", lambda: False)
    data_dir = tmp_path / "empty"
    for call in (check_dataset_spec, load_dataset):
        with pytest.raises(DataError, match="cifar10 is not prepared in .* unreachable") as info:
            call("cifar10", data_dir=str(data_dir))
        message = str(info.value)
        assert str(data_dir) in message and "cifar-10-binary.tar.gz" in message
        assert "imagefolder:PATH" in message and "\n" not in message
    assert not (data_dir / "cifar10" / "3.0.2").exists()


def test_tfds_bad_archive_is_a_data_error(tmp_path, no_network):
    data_dir = tmp_path / "tfds"
    archive = data_dir / "downloads" / "manual" / "cifar-10-binary.tar.gz"
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("cifar-10-batches-bin/test_batch.bin")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(DataError, match=r"lacks \[.*'cifar-10-batches-bin/data_batch_1\.bin'"):
        load_dataset("cifar10", data_dir=str(data_dir), cache_dir=tmp_path / "cache")
    assert not (data_dir / "cifar10" / "3.0.2").exists()  # no half-prepared dataset left


# ---------------------------------------------------------------------------------------------
# the shared CIFAR-10 zip (real data)


def _shared_dir() -> Path:
    return Path(os.environ.get("FEDJAX_RCL_SHARED")
                or Path(__file__).resolve().parents[2] / "shared")


@pytest.mark.slow
def test_shared_cifar10_zip(tmp_path, monkeypatch):
    path = _shared_dir() / "data" / "cifar10-jpeg.zip"
    if not path.is_file():
        pytest.skip(f"shared CIFAR-10 zip not found at {path} (set FEDJAX_RCL_SHARED)")
    spec = f"imagefolder:{path}"
    check_dataset_spec(spec)
    start = time.perf_counter()
    ds = load_dataset(spec, cache_dir=tmp_path)
    first = time.perf_counter() - start
    assert ds.train_images.shape == (50_000, 32, 32, 3) and ds.train_images.dtype == np.uint8
    assert ds.test_images.shape == (10_000, 32, 32, 3)
    assert ds.class_names == ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                              "horse", "ship", "truck")
    np.testing.assert_array_equal(np.bincount(ds.train_labels), [5000] * 10)
    np.testing.assert_array_equal(np.bincount(ds.test_labels), [1000] * 10)
    # The named dataset's constants, not the zip's own statistics (std ~0.247).
    assert ds.mean == (0.4914, 0.4822, 0.4465) and ds.std == (0.2023, 0.1994, 0.2010)
    data_mean, data_std = channel_stats(ds.train_images)
    np.testing.assert_allclose(data_mean, ds.mean, atol=5e-3)  # JPEG vs binary
    assert min(data_std) > 0.24  # why the constants matter: the data's own std is larger
    monkeypatch.setattr(image_files, "decode_image", _no_decode)
    start = time.perf_counter()
    cached = load_dataset(spec, cache_dir=tmp_path)
    print(f"shared zip: first load {first:.1f} s, cached {time.perf_counter() - start:.2f} s")
    np.testing.assert_array_equal(cached.test_images, ds.test_images)
    assert sources.default_cache_dir() != tmp_path  # the test used its own cache


# ---------------------------------------------------------------------------------------------
# normalisation: the named constants for named datasets, data statistics otherwise


def _folder_of(tmp_path, classes, size, per_class=2, seed=0):
    rng = np.random.default_rng(seed)
    tree = {f"{split}/{c}/{i}.png": rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            for split in ("train", "test") for c in classes for i in range(per_class)}
    return _write_dir(tmp_path / "folder", _encoded(tree)), tree


@pytest.mark.parametrize("name,classes,size", [
    ("cifar10", sorted(cifar10.CLASSES), 32),
    ("cifar100", sorted(cifar100.CLASSES), 32),
    ("tiny_imagenet", [f"n{i:08d}" for i in range(200)], 64),
])
def test_named_dataset_in_a_folder_gets_the_spec_constants(tmp_path, name, classes, size):
    root, _ = _folder_of(tmp_path, classes, size, per_class=1)
    ds = load_dataset(f"imagefolder:{root}", cache_dir=tmp_path / "cache")
    expected = {"cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
                "cifar100": ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)),
                "tiny_imagenet": ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821))}[name]
    assert (ds.mean, ds.std) == expected


@pytest.mark.parametrize("classes,size", [
    (["cat", "dog", "ship"], 32),  # some CIFAR-10 names, not all of them
    (sorted(cifar10.CLASSES), 16),  # CIFAR-10's names at another size
    ([f"n{i:08d}" for i in range(200)], 32),  # wnids at 32x32
])
def test_unnamed_dataset_in_a_folder_is_normalised_by_its_own_statistics(tmp_path, classes,
                                                                         size):
    root, tree = _folder_of(tmp_path, classes, size, per_class=1)
    ds = load_dataset(f"imagefolder:{root}", cache_dir=tmp_path / "cache")
    x = _expected(tree, "train")[0] / 255.0
    np.testing.assert_allclose(ds.mean, x.mean(axis=(0, 1, 2)), atol=1e-9)
    np.testing.assert_allclose(ds.std, x.std(axis=(0, 1, 2)), atol=1e-9)
    assert normalization.recognise(ds.class_names, ds.image_shape) is None

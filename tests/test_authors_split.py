"""``tools/authors_split.py``: a CIFAR-10 python batch is read as data (whole or a prefix: every
label, the images complete in it), and release image ``i`` maps to the archive file of its class
and rank, in the package loader's order."""

import pickle
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import authors_split as A  # noqa: E402


def _batch(n, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    planes = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    raw = pickle.dumps({"batch_label": "training batch 1 of 5", "labels": labels.tolist(),
                        "data": planes.reshape(n, -1).tobytes(), "filenames": ["x"] * n},
                       protocol=3)
    return raw, labels, planes.transpose(0, 2, 3, 1)


def test_a_batch_and_its_prefixes_give_every_label_and_the_whole_images():
    raw, labels, images = _batch(300)
    y, x = A.read_batch(raw)
    np.testing.assert_array_equal(y, labels)
    np.testing.assert_array_equal(x, images)
    start = raw.find(b"B" + (300 * 3072).to_bytes(4, "little")) + 5
    for cut in (start, start + 3071, start + 3072 * 17 + 5):  # no image, none whole, 17 whole
        y, x = A.read_batch(raw[:cut])
        np.testing.assert_array_equal(y, labels)
        assert x.shape[0] == (cut - start) // 3072
        np.testing.assert_array_equal(x, images[:x.shape[0]])
    with pytest.raises(ValueError, match="not a CIFAR-10 python batch"):
        A.read_batch(pickle.dumps({"data": b"\0" * 10}, protocol=3))


def test_the_release_order_maps_to_class_and_rank_in_the_loaders_order(tmp_path):
    labels = np.array([6, 9, 9, 4, 1, 1, 2, 6, 0, 9])
    np.testing.assert_array_equal(A.ranks(labels), [0, 0, 1, 0, 0, 1, 0, 1, 0, 2])
    counts = np.bincount(labels, minlength=10)
    archive = tmp_path / "c.zip"
    with zipfile.ZipFile(archive, "w") as z:  # written out of order, as zips may be
        for c in reversed(range(10)):
            for r in range(counts[c]):
                z.writestr(f"cifar10/train/{A.CLASSES[c]}/{r:04d}.jpg", b"")
        z.writestr("cifar10/test/airplane/0000.jpg", b"")
    members = A.archive_members(archive)
    assert members == sorted(members) and len(members) == labels.size
    index = A.release_to_archive(labels, members)
    for i, k in enumerate(index):  # the file of image i's class and rank
        assert members[k] == f"train/{A.CLASSES[labels[i]]}/{A.ranks(labels)[i]:04d}.jpg"
    assert sorted(index) == list(range(labels.size))
    with pytest.raises(ValueError, match="no file train/truck/0003"):
        A.release_to_archive(np.append(labels, 9), members)

"""Tiny-ImageNet (200 classes, 64x64; Le & Yang 2015) from the official archive, offline.

``dataset=tiny_imagenet`` reads the layout of ``tiny-imagenet-200.zip`` as published
(http://cs231n.stanford.edu/tiny-imagenet-200.zip), as the zip itself or unpacked:

* ``wnids.txt``: the 200 WordNet ids, one per line (the classes; labels index them sorted, as
  an image folder's class folders);
* ``train/<wnid>/images/*.JPEG``: the training split (500 per class);
* ``val/images/*.JPEG`` with ``val/val_annotations.txt`` (``file<TAB>wnid<TAB>box...``): the
  labelled validation split, used as the test split as in FedRCL's and FedMLB's tables (the
  official ``test/`` images have no labels and are not read).

``data_dir`` names the ``tiny-imagenet-200`` folder, the zip, or a folder holding either; unset,
TFDS's manual-download folder (``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``, then
``downloads/manual``), where the CIFAR archives go too. Images are decoded with Pillow to RGB
(about 1 % of Tiny-ImageNet is grayscale), with the image folder's zip safety rules, and cached
(:func:`fedjax_rcl.data.cache.cached_arrays`); the FedRCL reference's Tiny-ImageNet constants
normalise them (``fedjax_rcl.datasets.tiny_imagenet``).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from fedjax_rcl.data.cache import cached_arrays
from fedjax_rcl.data.dataset import DataError, ImageDataset
from fedjax_rcl.data.files import Entry, decode_images, dir_entries, open_tree, resolve_root

__all__ = ["ARCHIVE", "check_tiny_imagenet", "find_root", "load_tiny_imagenet"]

ARCHIVE = "tiny-imagenet-200"
_HOW = (f"give data_dir=PATH with PATH the {ARCHIVE} folder, {ARCHIVE}.zip or a folder holding "
        f"either (download: http://cs231n.stanford.edu/{ARCHIVE}.zip)")


def _manual_dir() -> Path:
    root = os.environ.get("TFDS_DATA_DIR") or Path.home() / "tensorflow_datasets"
    return Path(root) / "downloads" / "manual"


def find_root(data_dir: str | None) -> Path:
    """The Tiny-ImageNet folder or zip that ``data_dir`` names or holds.

    Raises:
        DataError: Nothing there, saying where it looked.
    """
    base = Path(data_dir).expanduser() if data_dir else _manual_dir()
    candidates = [base, base / ARCHIVE, base / f"{ARCHIVE}.zip"]
    for c in candidates:
        if c.is_file() and (zipfile.is_zipfile(c) or c.suffix == ".zip"):
            return resolve_root(str(c))  # a damaged zip is named as such
        if c.is_dir() and (c / "wnids.txt").is_file():
            return c.resolve()
    looked = ", ".join(str(c) for c in candidates)
    raise DataError(f"dataset='tiny_imagenet': no {ARCHIVE} found (looked at {looked}); {_HOW}")


def _layout(entries, read, root: Path):
    """``(wnids sorted, train members, test members)`` with ``(member, label)`` lists."""
    paths = {e.path for e in entries if not e.is_dir}
    wnid_files = sorted((p for p in paths if p.split("/")[-1] == "wnids.txt"
                         and p.count("/") <= 1), key=len)
    if not wnid_files:
        raise DataError(f"{root} has no wnids.txt (at its top or in one top folder); "
                        f"is it {ARCHIVE}? {_HOW}")
    prefix = wnid_files[0][: -len("wnids.txt")]
    wnids = sorted({w.strip() for w in read(wnid_files[0]).decode().split() if w.strip()})
    if not wnids:
        raise DataError(f"{prefix}wnids.txt in {root} lists no classes")
    label = {w: i for i, w in enumerate(wnids)}
    train = {w: [] for w in wnids}
    for p in paths:
        parts = p[len(prefix):].split("/") if p.startswith(prefix) else []
        if (len(parts) == 4 and parts[0] == "train" and parts[2] == "images"
                and parts[3].lower().endswith((".jpeg", ".jpg", ".png"))):
            if parts[1] not in label:
                raise DataError(f"{p!r} in {root}: class {parts[1]!r} is not in wnids.txt")
            train[parts[1]].append(p)
    empty = [w for w in wnids if not train[w]]
    if empty:
        raise DataError(f"{root}: no training images in {prefix}train/{empty[0]}/images/ "
                        f"({len(empty)} of {len(wnids)} classes have none)")
    annotations = f"{prefix}val/val_annotations.txt"
    if annotations not in paths:
        raise DataError(f"{root} has no {annotations} (the labelled split used for testing)")
    test = []
    for n, line in enumerate(read(annotations).decode().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        member = f"{prefix}val/images/{fields[0]}"
        if len(fields) < 2 or fields[1] not in label:
            raise DataError(f"{annotations} in {root}, line {n}: {line[:80]!r} does not name a "
                            "file and a class of wnids.txt")
        if member not in paths:
            raise DataError(f"{annotations} in {root}, line {n}: {member} is missing")
        test.append((member, label[fields[1]]))
    if not test:
        raise DataError(f"{annotations} in {root} labels no image")
    train_members = sorted((m, label[w]) for w in wnids for m in train[w])
    return wnids, train_members, sorted(test)


def check_tiny_imagenet(data_dir: str | None) -> None:
    """Validates the archive's layout without decoding an image (``DataError`` if wrong)."""
    root = find_root(data_dir)
    with open_tree(root) as (entries, read):
        _layout(_with_text_files(entries, root), read, root)


def _with_text_files(entries, root: Path):
    """A directory walk lists only images; add the two text files the layout needs."""
    if not root.is_dir():
        return entries
    extra = []
    for dirpath, _, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        for f in filenames:
            if f in ("wnids.txt", "val_annotations.txt"):
                extra.append(Entry(f if rel == "." else f"{rel}/{f}", False))
    return [*entries, *extra]


def load_tiny_imagenet(data_dir: str | None, *, mean: tuple[float, ...], std: tuple[float, ...],
                       cache_dir: str | os.PathLike | None = None) -> ImageDataset:
    """Loads Tiny-ImageNet's train and (labelled) validation splits; decoded arrays are cached.

    Returns:
        The dataset named ``"tiny_imagenet"``: ``uint8 [N, 64, 64, 3]`` images, labels
        indexing the sorted wnids, normalised with ``mean``/``std``, ``hflip=True``.
    """
    root = find_root(data_dir)
    if root.is_dir():
        key = ["dir", str(root), [[e.path, e.size, e.mtime_ns] for e in
                                  sorted(dir_entries(root), key=lambda e: e.path)
                                  if not e.is_dir]]
    else:
        st = root.stat()
        key = ["zip", str(root), st.st_size, st.st_mtime_ns]

    def build() -> dict[str, np.ndarray]:
        with open_tree(root) as (entries, read):
            wnids, train, test = _layout(_with_text_files(entries, root), read, root)
            members = train + test
            blobs = [read(m) for m, _ in members]
        images = decode_images(blobs, [f"{m!r} in {root}" for m, _ in members])
        labels = np.array([y for _, y in members], np.int32)
        n = len(train)
        return {"train_images": images[:n], "train_labels": labels[:n],
                "test_images": images[n:], "test_labels": labels[n:],
                "class_names": np.array(wnids)}

    arrays = cached_arrays(cache_dir, "tiny_imagenet", key, build)
    return ImageDataset(
        name="tiny_imagenet",
        train_images=arrays["train_images"], train_labels=arrays["train_labels"],
        test_images=arrays["test_images"], test_labels=arrays["test_labels"],
        class_names=tuple(str(c) for c in arrays["class_names"]), mean=tuple(mean),
        std=tuple(std), hflip=True,
    )

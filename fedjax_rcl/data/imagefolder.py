"""Image-folder datasets: a directory or ``.zip`` laid out ``train/<class>/*``, ``test/<class>/*``.

The layout may sit inside one top-level folder (common for zips: ``cifar10/train/...``).
Classes are the sorted sub-folder names of ``train/``; ``test/`` must have the same ones. Only
files with a common image extension are read (``.DS_Store``, ``Thumbs.db``, hidden files and
macOS ``__MACOSX/`` resource forks are ignored). Images are decoded with Pillow to RGB and must
all have the same size.

Zip members are read by name, never extracted: member names that are absolute or contain
``..`` are refused, and both a member's uncompressed size and an image's pixel count are capped
before anything is decompressed or decoded, so a hostile archive cannot write outside its folder
or exhaust memory. Decoded arrays are cached (:func:`fedjax_rcl.data.cache.cached_arrays`)
under a key of the zip's absolute path, size and mtime (for a directory: every image file's
relative path, size and mtime), so later loads decode nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedjax_rcl.data.cache import cached_arrays
from fedjax_rcl.data.dataset import DataError, ImageDataset, channel_stats
from fedjax_rcl.data.files import (
    IMAGE_EXTENSIONS,
    Entry,
    decode_images,
    dir_entries,
    is_image,
    open_tree,
    resolve_root,
)
from fedjax_rcl.data.normalization import recognise

_log = logging.getLogger(__name__)

__all__ = ["IMAGE_EXTENSIONS", "check_imagefolder", "decode_images", "load_imagefolder"]

_SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the images are: class names and ``(member path, label)`` per split, sorted."""

    classes: tuple[str, ...]
    members: dict[str, list[tuple[str, int]]]


def _layout(entries: Sequence[Entry], root: Path) -> _Layout:
    """Finds the splits and classes among ``entries`` and checks them.

    Raises:
        DataError: Missing split, no classes, differing class sets, an empty class folder or an
            image outside any class folder.
    """
    kept = [e for e in entries
            if not any(p.startswith(".") or p == "__MACOSX" for p in e.path.split("/"))]
    tops = {e.path.split("/")[0] for e in kept}
    # A zip of a folder puts everything under that folder's name: look one level down.
    prefix = f"{next(iter(tops))}/" if len(tops) == 1 and "train" not in tops else ""
    found = set()
    classes = {s: set() for s in _SPLITS}
    files = {s: [] for s in _SPLITS}
    for e in kept:
        if not e.path.startswith(prefix):
            continue
        parts = e.path[len(prefix):].split("/")
        if parts[0] not in _SPLITS:
            continue
        found.add(parts[0])
        if len(parts) == 1:
            continue
        if e.is_dir or len(parts) > 2:
            classes[parts[0]].add(parts[1])
        if not e.is_dir and is_image(e.path):
            if len(parts) == 2:
                raise DataError(f"image {e.path!r} in {root} is not inside a class folder;"
                                f" move it to {parts[0]}/<class>/")
            files[parts[0]].append((e.path, parts[1]))
    for split in _SPLITS:
        if split not in found:
            raise DataError(f"{root} has no {split}/ folder (top level: {sorted(tops)}); expected"
                            " train/<class>/* and test/<class>/*, optionally in one top folder")
    names = tuple(sorted(classes["train"]))
    if not names:
        raise DataError(f"{prefix}train/ in {root} holds no class folders;"
                        " put each class's images in train/<class>/")
    if classes["test"] != classes["train"]:
        missing = sorted(classes["train"] - classes["test"])
        extra = sorted(classes["test"] - classes["train"])
        raise DataError(f"{prefix}test/ in {root} does not have train/'s classes (missing:"
                        f" {missing}, extra: {extra}); both splits need the same class folders")
    label = {c: i for i, c in enumerate(names)}
    members = {}
    for split in _SPLITS:
        counts = np.bincount([label[c] for _, c in files[split]], minlength=len(names))
        if not counts.all():
            empty = names[int(np.argmin(counts))]
            raise DataError(f"class folder {prefix}{split}/{empty}/ in {root} has no images"
                            f" (read extensions: {', '.join(sorted(IMAGE_EXTENSIONS))})")
        members[split] = sorted((m, label[c]) for m, c in files[split])
    return _Layout(names, members)


def check_imagefolder(path: str) -> None:
    """Validates ``imagefolder:PATH`` (existence, zip member names, layout) without decoding.

    Raises:
        DataError: Naming the offending path or member.
    """
    root = resolve_root(path)
    with open_tree(root) as (entries, _):
        _layout(entries, root)


def load_imagefolder(path: str, *, cache_dir: str | os.PathLike | None = None) -> ImageDataset:
    """Loads ``imagefolder:PATH``; decoded arrays are cached, so later loads decode nothing.

    Args:
        path: A directory or zip archive holding ``train/<class>/*`` and ``test/<class>/*``.
        cache_dir: Cache directory (None: ``$FEDJAX_RCL_CACHE`` or ``~/.cache/fedjax_rcl``).

    Returns:
        The dataset named ``"imagefolder:<absolute path>"``; images ``uint8 [N, H, W, 3]``,
        labels index the sorted class names, ``hflip=True``. mean/std are a registered
        dataset's constants when the folder holds it (``normalization.recognise``: CIFAR-10,
        CIFAR-100, Tiny-ImageNet), else the train images' per-channel statistics.

    Raises:
        DataError: On any of the problems listed in the module docstring.
    """
    root = resolve_root(path)
    if root.is_dir():
        entries = sorted(dir_entries(root), key=lambda e: e.path)
        key = ["dir", str(root), [[e.path, e.size, e.mtime_ns] for e in entries if not e.is_dir]]
    else:
        st = root.stat()
        key = ["zip", str(root), st.st_size, st.st_mtime_ns]

    def build() -> dict[str, np.ndarray]:
        with open_tree(root) as (tree_entries, read):
            layout = _layout(tree_entries, root)
            members = layout.members["train"] + layout.members["test"]
            blobs = [read(m) for m, _ in members]
        names = [f"{m!r} in {root}" for m, _ in members]
        images = decode_images(blobs, names)
        labels = np.array([label for _, label in members], np.int32)
        n = len(layout.members["train"])
        mean, std = channel_stats(images[:n])
        return {"train_images": images[:n], "train_labels": labels[:n],
                "test_images": images[n:], "test_labels": labels[n:],
                "class_names": np.array(layout.classes), "mean": np.array(mean),
                "std": np.array(std)}

    arrays = cached_arrays(cache_dir, "imagefolder", key, build)
    class_names = tuple(str(c) for c in arrays["class_names"])
    mean, std = tuple(arrays["mean"].tolist()), tuple(arrays["std"].tolist())
    named = recognise(class_names, arrays["train_images"].shape[1:])
    if named is not None:  # a named dataset keeps its constants whatever the source
        mean, std = named.mean, named.std
        _log.info("%s holds %s: normalising with its named constants", root, named.name)
    return ImageDataset(
        name=f"imagefolder:{root}",
        train_images=arrays["train_images"], train_labels=arrays["train_labels"],
        test_images=arrays["test_images"], test_labels=arrays["test_labels"],
        class_names=class_names, mean=mean, std=std, hflip=True,
    )

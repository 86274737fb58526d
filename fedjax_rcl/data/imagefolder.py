"""Image-folder datasets: a directory or ``.zip`` laid out ``train/<class>/*``, ``test/<class>/*``.

The layout may sit inside one top-level folder (common for zips: ``cifar10/train/...``).
Classes are the sorted sub-folder names of ``train/``; ``test/`` must have the same ones. Only
files with a common image extension are read (``.DS_Store``, ``Thumbs.db``, hidden files and
macOS ``__MACOSX/`` resource forks are ignored). Images are decoded with Pillow to RGB and must
all have the same size.

Zip members are read by name, never extracted: member names that are absolute or contain
``..`` are refused, and both a member's uncompressed size and an image's pixel count are capped
before anything is decompressed or decoded, so a hostile archive cannot write outside its folder
or exhaust memory. Decoded arrays are cached (:func:`fedjax_rcl.data.sources.cached_arrays`)
under a key of the zip's absolute path, size and mtime (for a directory: every image file's
relative path, size and mtime), so later loads decode nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import posixpath
import re
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from fedjax_rcl.data.normalization import NAMED, recognise
from fedjax_rcl.data.sources import DataError, ImageDataset, cached_arrays, channel_stats

_log = logging.getLogger(__name__)

__all__ = ["IMAGE_EXTENSIONS", "check_imagefolder", "decode_images", "load_imagefolder"]

IMAGE_EXTENSIONS = frozenset(
    {".bmp", ".gif", ".jpeg", ".jpg", ".png", ".ppm", ".tif", ".tiff", ".webp"})
MAX_MEMBER_BYTES = 64 << 20  # larger "images" are refused unread (decompression bombs)
MAX_PIXELS = 1 << 24  # checked from the header, before the pixels are decompressed
_SPLITS = ("train", "test")
_ABSOLUTE = re.compile(r"^([/\\]|[A-Za-z]:)")  # POSIX root, Windows root or drive letter


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A file or folder of the tree: POSIX path relative to the root, size, mtime."""

    path: str
    is_dir: bool
    size: int = 0
    mtime_ns: int = 0


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the images are: class names and ``(member path, label)`` per split, sorted."""

    classes: tuple[str, ...]
    members: dict[str, list[tuple[str, int]]]


def _is_image(path: str) -> bool:
    return posixpath.splitext(path)[1].lower() in IMAGE_EXTENSIONS


def _starts_like_zip(path: Path) -> bool:
    """Whether the file begins with a zip local-file header (``PK\\x03\\x04``)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _resolve_root(path: str) -> Path:
    """``PATH`` of ``imagefolder:PATH`` -> absolute path of an existing directory or zip file."""
    root = Path(path).expanduser().resolve()
    if not root.exists():
        raise DataError(f"imagefolder path {root} does not exist; give a directory or .zip"
                        " holding train/<class>/* and test/<class>/*")
    if root.is_file() and not zipfile.is_zipfile(root) and _starts_like_zip(root):
        raise DataError(f"imagefolder path {root} is a damaged or truncated zip archive (it "
                        "starts like one but has no readable directory); copy or download it "
                        "again")
    if not (root.is_dir() or zipfile.is_zipfile(root)):
        raise DataError(f"imagefolder path {root} is neither a directory nor a zip archive;"
                        " give a directory or .zip holding train/<class>/* and test/<class>/*")
    return root


def _zip_entries(zf: zipfile.ZipFile, root: Path) -> list[_Entry]:
    """The zip's members, refusing names that would escape the archive's folder."""
    entries = []
    for info in zf.infolist():
        name = info.filename
        if _ABSOLUTE.match(name) or ".." in name.replace("\\", "/").split("/"):
            raise DataError(f"zip member {name!r} in {root} is an absolute path or contains"
                            " '..' (path escape); refusing to read this archive")
        entries.append(_Entry(name.rstrip("/"), info.is_dir(), info.file_size))
    return entries


def _dir_entries(root: Path) -> list[_Entry]:
    """Every file and folder below ``root`` (sizes and mtimes of files, for the cache key)."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        entries += [_Entry(prefix + d, True) for d in dirnames]
        for f in filenames:
            if _is_image(f):
                st = os.stat(os.path.join(dirpath, f))
                entries.append(_Entry(prefix + f, False, st.st_size, st.st_mtime_ns))
    return entries


def _layout(entries: Sequence[_Entry], root: Path) -> _Layout:
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
        if not e.is_dir and _is_image(e.path):
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


@contextlib.contextmanager
def _open_tree(root: Path) -> Iterator[tuple[list[_Entry], Callable[[str], bytes]]]:
    """Yields the tree's entries and a ``read(member) -> bytes`` for a directory or zip."""
    if root.is_dir():
        def read(member: str) -> bytes:
            try:
                with open(root / member, "rb") as f:
                    data = f.read(MAX_MEMBER_BYTES + 1)
            except OSError as err:
                raise DataError(f"cannot read file {member!r} in {root}: {err}") from None
            if len(data) > MAX_MEMBER_BYTES:
                raise DataError(f"file {member!r} in {root} exceeds {MAX_MEMBER_BYTES} bytes;"
                                " too large for an image of this dataset")
            return data

        yield _dir_entries(root), read
        return
    try:
        zf = zipfile.ZipFile(root)
    except (OSError, zipfile.BadZipFile) as err:
        raise DataError(f"cannot open zip archive {root}: {err}") from None
    with zf:
        def read(member: str) -> bytes:
            info = zf.getinfo(member)
            if info.file_size > MAX_MEMBER_BYTES:
                raise DataError(f"zip member {member!r} in {root} unpacks to {info.file_size}"
                                f" bytes (limit {MAX_MEMBER_BYTES}); refusing to decompress it")
            try:
                return zf.read(info)
            except (OSError, zipfile.BadZipFile, EOFError, NotImplementedError,
                    RuntimeError) as err:  # RuntimeError: encrypted member
                raise DataError(f"cannot read zip member {member!r} in {root}: {err}") from None

        yield _zip_entries(zf, root), read


def _decode(blob: bytes, name: str) -> np.ndarray:
    """Encoded image -> ``uint8 [H, W, 3]``; any failure is a :class:`DataError` naming it."""
    try:
        with Image.open(io.BytesIO(blob)) as im:
            width, height = im.size
            if width * height > MAX_PIXELS:
                raise DataError(f"image {name} is {width}x{height} pixels (limit {MAX_PIXELS});"
                                " refusing to decode it")
            return np.asarray(im.convert("RGB"))
    except DataError:
        raise
    except Exception as err:  # Pillow raises many types (OSError, SyntaxError, ...) on bad data
        raise DataError(f"cannot decode image {name}: {type(err).__name__}: {err}") from None


def decode_images(blobs: Sequence[bytes], names: Sequence[str]) -> np.ndarray:
    """Decodes encoded images of one size to ``uint8 [N, H, W, 3]`` (RGB), in input order.

    Serial on purpose: Pillow's per-image Python overhead holds the GIL (a thread pool was
    slower), and a pool of 2 spawned processes was no faster for the CIFAR-10 zip on the shared
    2-core machine (9.6 s vs 8.4 s) while requiring an ``if __name__ == "__main__"`` guard in
    every calling script.

    Args:
        blobs: ``N >= 1`` encoded images (PNG, JPEG, ...).
        names: Their names, used in error messages.

    Raises:
        DataError: Naming the first image that cannot be decoded, is too large or differs in
            size from the first image.
    """
    from tqdm import tqdm

    first = _decode(blobs[0], names[0])
    out = np.empty((len(blobs), *first.shape), np.uint8)
    # A progress bar (stderr) for decodes long enough to wonder about: the first load of the
    # CIFAR-10 zip takes 10-60 s; later loads read the cache and decode nothing.
    long = len(blobs) >= 5000
    tty = sys.stderr.isatty()
    if long and not tty:  # a log file gets one line, not a bar's redraws
        print(f"decoding {len(blobs)} images (once; cached after)...", file=sys.stderr,
              flush=True)
    items = tqdm(zip(blobs, names, strict=True), total=len(blobs), unit="img",
                 desc="decoding images (once; cached after)", disable=not (long and tty),
                 mininterval=1.0)
    for i, (blob, name) in enumerate(items):
        image = first if i == 0 else _decode(blob, name)
        if image.shape != first.shape:
            (h, w), (h0, w0) = image.shape[:2], first.shape[:2]
            raise DataError(f"image {name} is {w}x{h} but {names[0]} is {w0}x{h0}; all images"
                            " of an imagefolder dataset must have the same size")
        out[i] = image
    return out


def check_imagefolder(path: str) -> None:
    """Validates ``imagefolder:PATH`` (existence, zip member names, layout) without decoding.

    Raises:
        DataError: Naming the offending path or member.
    """
    root = _resolve_root(path)
    with _open_tree(root) as (entries, _):
        _layout(entries, root)


def load_imagefolder(path: str, *, cache_dir: str | os.PathLike | None = None) -> ImageDataset:
    """Loads ``imagefolder:PATH``; decoded arrays are cached, so later loads decode nothing.

    Args:
        path: A directory or zip archive holding ``train/<class>/*`` and ``test/<class>/*``.
        cache_dir: Cache directory (None: ``$FEDJAX_RCL_CACHE`` or ``~/.cache/fedjax_rcl``).

    Returns:
        The dataset named ``"imagefolder:<absolute path>"``; images ``uint8 [N, H, W, 3]``,
        labels index the sorted class names, ``hflip=True``. mean/std are the SPEC's constants
        when the folder holds a dataset the SPEC names (``normalization.recognise``: CIFAR-10,
        CIFAR-100, Tiny-ImageNet), else the train images' per-channel statistics.

    Raises:
        DataError: On any of the problems listed in the module docstring.
    """
    root = _resolve_root(path)
    if root.is_dir():
        entries = sorted(_dir_entries(root), key=lambda e: e.path)
        key = ["dir", str(root), [[e.path, e.size, e.mtime_ns] for e in entries if not e.is_dir]]
    else:
        st = root.stat()
        key = ["zip", str(root), st.st_size, st.st_mtime_ns]

    def build() -> dict[str, np.ndarray]:
        with _open_tree(root) as (tree_entries, read):
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
    if named is not None:  # SPEC §2: a named dataset keeps its constants whatever the source
        mean, std = NAMED[named].mean, NAMED[named].std
        _log.info("%s holds %s: normalising with the SPEC's constants", root, named)
    return ImageDataset(
        name=f"imagefolder:{root}",
        train_images=arrays["train_images"], train_labels=arrays["train_labels"],
        test_images=arrays["test_images"], test_labels=arrays["test_labels"],
        class_names=class_names, mean=mean, std=std, hflip=True,
    )

"""A tree of image files, as a directory or a zip archive, read safely; and image decoding.

Image folders and the Tiny-ImageNet archive are both such trees. Zip members are read by name,
never extracted: names that are absolute or contain ``..`` are refused, and both a member's
uncompressed size and an image's pixel count are capped before anything is decompressed or
decoded, so a hostile archive cannot write outside its folder or exhaust memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import posixpath
import re
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from fedjax_rcl.data.dataset import DataError

__all__ = ["IMAGE_EXTENSIONS", "MAX_MEMBER_BYTES", "MAX_PIXELS", "Entry", "decode_image",
           "decode_images", "dir_entries", "is_image", "open_tree", "resolve_root",
           "zip_entries"]

IMAGE_EXTENSIONS = frozenset(
    {".bmp", ".gif", ".jpeg", ".jpg", ".png", ".ppm", ".tif", ".tiff", ".webp"})
MAX_MEMBER_BYTES = 64 << 20  # larger "images" are refused unread (decompression bombs)
MAX_PIXELS = 1 << 24  # checked from the header, before the pixels are decompressed
_ABSOLUTE = re.compile(r"^([/\\]|[A-Za-z]:)")  # POSIX root, Windows root or drive letter


@dataclasses.dataclass(frozen=True)
class Entry:
    """A file or folder of the tree: POSIX path relative to the root, size, mtime."""

    path: str
    is_dir: bool
    size: int = 0
    mtime_ns: int = 0


def is_image(path: str) -> bool:
    return posixpath.splitext(path)[1].lower() in IMAGE_EXTENSIONS


def _starts_like_zip(path: Path) -> bool:
    """Whether the file begins with a zip local-file header (``PK\\x03\\x04``)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def resolve_root(path: str) -> Path:
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


def zip_entries(zf: zipfile.ZipFile, root: Path) -> list[Entry]:
    """The zip's members, refusing names that would escape the archive's folder."""
    entries = []
    for info in zf.infolist():
        name = info.filename
        if _ABSOLUTE.match(name) or ".." in name.replace("\\", "/").split("/"):
            raise DataError(f"zip member {name!r} in {root} is an absolute path or contains"
                            " '..' (path escape); refusing to read this archive")
        entries.append(Entry(name.rstrip("/"), info.is_dir(), info.file_size))
    return entries


def dir_entries(root: Path) -> list[Entry]:
    """Every file and folder below ``root`` (sizes and mtimes of files, for the cache key)."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        entries += [Entry(prefix + d, True) for d in dirnames]
        for f in filenames:
            if is_image(f):
                st = os.stat(os.path.join(dirpath, f))
                entries.append(Entry(prefix + f, False, st.st_size, st.st_mtime_ns))
    return entries


@contextlib.contextmanager
def open_tree(root: Path) -> Iterator[tuple[list[Entry], Callable[[str], bytes]]]:
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

        yield dir_entries(root), read
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

        yield zip_entries(zf, root), read


def decode_image(blob: bytes, name: str) -> np.ndarray:
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

    Serial on purpose: Pillow's per-image Python overhead holds the GIL, so threads do not
    help; a process pool would need an ``if __name__ == "__main__"`` guard in every calling
    script; and the decoded arrays are cached, so a dataset is decoded once.

    Args:
        blobs: ``N >= 1`` encoded images (PNG, JPEG, ...).
        names: Their names, used in error messages.

    Raises:
        DataError: Naming the first image that cannot be decoded, is too large or differs in
            size from the first image.
    """
    from tqdm import tqdm

    first = decode_image(blobs[0], names[0])
    out = np.empty((len(blobs), *first.shape), np.uint8)
    # A progress bar (stderr) for decodes long enough to wonder about (the first load of a
    # CIFAR-10 zip); later loads read the cache and decode nothing.
    long = len(blobs) >= 5000
    tty = sys.stderr.isatty()
    if long and not tty:  # a log file gets one line, not a bar's redraws
        print(f"decoding {len(blobs)} images (once; cached after)...", file=sys.stderr,
              flush=True)
    items = tqdm(zip(blobs, names, strict=True), total=len(blobs), unit="img",
                 desc="decoding images (once; cached after)", disable=not (long and tty),
                 mininterval=1.0)
    for i, (blob, name) in enumerate(items):
        image = first if i == 0 else decode_image(blob, name)
        if image.shape != first.shape:
            (h, w), (h0, w0) = image.shape[:2], first.shape[:2]
            raise DataError(f"image {name} is {w}x{h} but {names[0]} is {w0}x{h0}; all images"
                            " of an imagefolder dataset must have the same size")
        out[i] = image
    return out

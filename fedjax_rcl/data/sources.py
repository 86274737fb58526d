"""Image data sources: one entry point that turns a dataset spec into in-memory arrays.

A spec is one of

* ``"digits"`` -- scikit-learn's handwritten digits, upsampled to 32x32 (offline default,
  :mod:`fedjax_rcl.data.embedded`);
* ``"imagefolder:PATH"`` -- a directory or ``.zip`` laid out ``train/<class>/*`` and
  ``test/<class>/*`` (:mod:`fedjax_rcl.data.imagefolder`);
* ``"cifar10"`` / ``"cifar100"`` -- through tensorflow-datasets without TensorFlow
  (:mod:`fedjax_rcl.data.tfds_source`);
* ``"tiny_imagenet"`` -- the official ``tiny-imagenet-200`` archive or folder in ``data_dir``
  (:mod:`fedjax_rcl.data.tiny_imagenet`).

Every source returns an :class:`ImageDataset` (uint8 NHWC images, int32 labels, class names,
normalisation constants). Sources that decode many files cache the decoded arrays on disk
(:func:`cached_arrays`), so only the first load of a dataset pays for decoding.

The source modules are imported lazily by :func:`load_dataset`, so importing this module does
not import tensorflow-datasets or scikit-learn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "DataError",
    "ImageDataset",
    "channel_stats",
    "check_dataset_spec",
    "default_cache_dir",
    "load_dataset",
]

_log = logging.getLogger(__name__)

# Bump when the layout or meaning of cached arrays changes: old cache files are then ignored.
CACHE_FORMAT_VERSION = 1
TFDS_NAMES = ("cifar10", "cifar100")
_IMAGEFOLDER_PREFIX = "imagefolder:"
_ALLOWED = ("'digits', 'cifar10', 'cifar100', 'tiny_imagenet' or 'imagefolder:PATH' (a directory "
            "or .zip)")


class DataError(ValueError):
    """Bad dataset spec or unreadable data.

    The message is one line naming what is wrong, the offending value (path, member, spec) and
    what is allowed or how to fix it.
    """


@dataclasses.dataclass(frozen=True, eq=False)
class ImageDataset:
    """A labelled image dataset held in host memory.

    Attributes:
        name: The spec it was loaded from, e.g. ``"digits"``, ``"cifar10"`` or
            ``"imagefolder:/abs/path.zip"``.
        train_images: ``uint8 [N, H, W, C]`` in 0..255.
        train_labels: ``int32 [N]`` in ``0..num_classes-1``.
        test_images: ``uint8 [M, H, W, C]``.
        test_labels: ``int32 [M]``.
        class_names: Name of each label, ``len == num_classes``.
        mean: Per-channel normalisation mean in [0, 1] pixel units (``len == C``).
        std: Per-channel normalisation standard deviation in [0, 1] pixel units.
        hflip: Whether horizontal flips preserve labels (False for digits).

    The arrays are made read-only: one dataset is shared by everything that trains on it.
    """

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    class_names: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    hflip: bool

    def __post_init__(self):
        # Catch a malformed source here rather than as a shape error deep inside a jitted round.
        for split in ("train", "test"):
            images = getattr(self, f"{split}_images")
            labels = getattr(self, f"{split}_labels")
            if images.dtype != np.uint8 or images.ndim != 4 or labels.dtype != np.int32:
                raise TypeError(f"{self.name}: {split} must be uint8 NHWC images and int32 labels,"
                                f" got {images.dtype}{images.shape} and {labels.dtype}")
            if labels.shape != images.shape[:1]:
                raise ValueError(f"{self.name}: {len(labels)} {split} labels for"
                                 f" {len(images)} images")
            images.flags.writeable = False
            labels.flags.writeable = False
        if self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise ValueError(f"{self.name}: train images {self.train_images.shape[1:]} and test"
                             f" images {self.test_images.shape[1:]} differ in shape")
        if not len(self.mean) == len(self.std) == self.train_images.shape[-1]:
            raise ValueError(f"{self.name}: mean/std need one value per channel")

    @property
    def num_classes(self) -> int:
        """Number of classes (labels are ``0..num_classes-1``)."""
        return len(self.class_names)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(H, W, C)`` of every image."""
        return tuple(self.train_images.shape[1:])


def channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) standard deviation of uint8 images, in [0, 1] units.

    Sums run over chunks of images in float64, which is exact for integer pixel values at any
    realistic dataset size (< 2**53 / 255**2 values per channel) and never needs a float copy
    of the whole set (CIFAR-10's train set would be 1.2 GB as float64).

    Args:
        images: ``uint8 [N, H, W, C]``.

    Returns:
        ``(mean, std)``, each a tuple of ``C`` floats.
    """
    total = np.zeros(images.shape[-1])
    total_sq = np.zeros(images.shape[-1])
    for start in range(0, len(images), 1024):
        x = images[start:start + 1024].reshape(-1, images.shape[-1]).astype(np.float64)
        total += x.sum(axis=0)
        total_sq += np.square(x).sum(axis=0)
    count = images.size // images.shape[-1]
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean**2, 0.0))
    return tuple((mean / 255.0).tolist()), tuple((std / 255.0).tolist())


def default_cache_dir() -> Path:
    """Where decoded arrays are cached: ``$FEDJAX_RCL_CACHE``, else ``~/.cache/fedjax_rcl``."""
    return Path(os.environ.get("FEDJAX_RCL_CACHE") or Path.home() / ".cache" / "fedjax_rcl")


def cached_arrays(cache_dir: str | os.PathLike | None, kind: str, key: Sequence,
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Returns ``build()``'s arrays, from the on-disk cache when an entry for ``key`` exists.

    The entry is ``CACHE_DIR/KIND-HASH.npz`` with ``HASH`` over ``(CACHE_FORMAT_VERSION,
    *key)``; callers put into ``key`` whatever identifies the source's content (path, size,
    mtime). It is written to a temporary file in the same directory and renamed into place, so
    a process killed while saving never leaves a partial entry; an unreadable entry counts as a
    miss and is rebuilt. A cache that cannot be written only costs a warning.

    Args:
        cache_dir: Cache directory; None for :func:`default_cache_dir`.
        kind: Short readable prefix of the file name, e.g. ``"imagefolder"``.
        key: JSON-serialisable values identifying the source.
        build: Produces the arrays (``str`` arrays allowed; no object arrays) on a miss.

    Returns:
        Name -> array, as ``build`` returned them.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(json.dumps([CACHE_FORMAT_VERSION, *key]).encode()).hexdigest()
    path = cache_dir / f"{kind}-{digest[:24]}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as npz:
                return {name: npz[name] for name in npz.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            _log.warning("ignoring unreadable cache entry %s (%s); rebuilding it", path, err)
    arrays = build()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # A process killed mid-save leaves its temporary file: drop those older than an hour
        # (younger ones may belong to a concurrent writer).
        for stale in cache_dir.glob(f".{path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                if time.time() - stale.stat().st_mtime > 3600:
                    stale.unlink()
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as err:
        _log.warning("could not write the data cache %s (%s); the next load decodes again",
                     path, err)
    return arrays


def _parse_spec(spec: str) -> tuple[str, str | None]:
    """``spec`` -> ``(kind, argument)``; kind is ``digits``, a TFDS name or ``imagefolder``."""
    if not isinstance(spec, str):
        raise DataError(f"dataset spec must be a string, got {spec!r}; allowed: {_ALLOWED}")
    if spec in ("digits", "tiny_imagenet") or spec in TFDS_NAMES:
        return spec, None
    if spec.startswith(_IMAGEFOLDER_PREFIX):
        path = spec[len(_IMAGEFOLDER_PREFIX):]
        if not path:
            raise DataError(f"dataset spec {spec!r} names no path; write 'imagefolder:PATH' with"
                            " PATH a directory or .zip holding train/<class>/* and test/<class>/*")
        return "imagefolder", path
    raise DataError(f"unknown dataset {spec!r}; allowed: {_ALLOWED}")


def load_dataset(spec: str, *, data_dir: str | None = None,
                 cache_dir: str | None = None) -> ImageDataset:
    """Loads a dataset into memory.

    Args:
        spec: ``"digits"``, ``"cifar10"``, ``"cifar100"``, ``"tiny_imagenet"`` or
            ``"imagefolder:PATH"``.
        data_dir: TFDS data directory for ``cifar10``/``cifar100`` (None: TFDS's default,
            ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``); for ``tiny_imagenet`` where its
            archive or folder is (None: TFDS's ``downloads/manual``); ignored by other sources.
        cache_dir: Where decoded arrays are cached (None: :func:`default_cache_dir`).

    Returns:
        The dataset.

    Raises:
        DataError: Unknown spec, missing or malformed data, or a TFDS dataset that is neither
            prepared nor downloadable.
    """
    kind, arg = _parse_spec(spec)
    if kind == "digits":
        from fedjax_rcl.data import embedded
        return embedded.load_digits(cache_dir)
    if kind == "imagefolder":
        from fedjax_rcl.data import imagefolder
        return imagefolder.load_imagefolder(arg, cache_dir=cache_dir)
    if kind == "tiny_imagenet":
        from fedjax_rcl.data import tiny_imagenet
        return tiny_imagenet.load_tiny_imagenet(data_dir, cache_dir=cache_dir)
    from fedjax_rcl.data import tfds_source
    return tfds_source.load_tfds(kind, data_dir=data_dir, cache_dir=cache_dir)


def check_dataset_spec(spec: str, *, data_dir: str | None = None) -> None:
    """Validates a spec cheaply, without decoding any image.

    Checks the name, an image folder's path and layout (``train/`` and ``test/`` with the same
    non-empty class folders; a zip's member names), and that a TFDS dataset is prepared in
    ``data_dir``, or its archive is in ``DATA_DIR/downloads/manual``, or its host is reachable.

    Args:
        spec: As for :func:`load_dataset`.
        data_dir: As for :func:`load_dataset`.

    Raises:
        DataError: Naming what is wrong and how to fix it.
    """
    kind, arg = _parse_spec(spec)
    if kind == "imagefolder":
        from fedjax_rcl.data import imagefolder
        imagefolder.check_imagefolder(arg)
    elif kind == "tiny_imagenet":
        from fedjax_rcl.data import tiny_imagenet
        tiny_imagenet.check_tiny_imagenet(data_dir)
    elif kind in TFDS_NAMES:
        from fedjax_rcl.data import tfds_source
        tfds_source.check_tfds(kind, data_dir=data_dir)

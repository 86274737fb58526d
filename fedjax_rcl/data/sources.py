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

from fedjax_rcl.data.cache import CACHE_FORMAT_VERSION, cached_arrays, default_cache_dir
from fedjax_rcl.data.dataset import DataError, ImageDataset, channel_stats
from fedjax_rcl.validation import did_you_mean

__all__ = [
    "CACHE_FORMAT_VERSION",
    "DataError",
    "ImageDataset",
    "cached_arrays",
    "channel_stats",
    "check_dataset_spec",
    "default_cache_dir",
    "load_dataset",
]

TFDS_NAMES = ("cifar10", "cifar100")
_IMAGEFOLDER_PREFIX = "imagefolder:"
_ALLOWED = ("'digits', 'cifar10', 'cifar100', 'tiny_imagenet' or 'imagefolder:PATH' (a directory "
            "or .zip)")


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
    close = did_you_mean(spec, ("digits", "tiny_imagenet", *TFDS_NAMES))
    raise DataError(f"unknown dataset {spec!r}; allowed: {_ALLOWED}{close}")


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

"""Image data sources: one entry point that turns a dataset spec into in-memory arrays.

A spec is one of

* ``"digits"`` -- scikit-learn's handwritten digits, upsampled to 32x32 (offline default,
  :mod:`fedjax_rcl.data.embedded`);
* ``"imagefolder:PATH"`` -- a directory or ``.zip`` laid out ``train/<class>/*`` and
  ``test/<class>/*`` (:mod:`fedjax_rcl.data.imagefolder`);
* ``"cifar10"`` / ``"cifar100"`` -- through tensorflow-datasets without TensorFlow
  (:mod:`fedjax_rcl.data.tfds_source`);
* ``"tiny_imagenet"`` -- the official ``tiny-imagenet-200`` archive or folder in ``data_dir``
  (:mod:`fedjax_rcl.data.tiny_imagenet`);
* a name registered with ``fedjax_rcl.registry.register_dataset`` -- the user's loader
  (:func:`from_arrays` checks what it returns).

Every source returns an :class:`ImageDataset` (uint8 NHWC images, int32 labels, class names,
normalisation constants). Sources that decode many files cache the decoded arrays on disk
(:func:`cached_arrays`), so only the first load of a dataset pays for decoding.

The source modules are imported lazily by :func:`load_dataset`, so importing this module does
not import tensorflow-datasets or scikit-learn.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Mapping

import numpy as np

from fedjax_rcl import registry
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
    "from_arrays",
    "load_dataset",
    "spec_only",
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
    if spec in registry.DATASETS:
        return "registered", spec
    names = (*registry.BUILTIN_DATASETS, *registry.DATASETS)
    mine = (f", or a registered one ({', '.join(map(repr, registry.DATASETS))})"
            if registry.DATASETS else ", or one registered by a plugin")
    raise DataError(f"unknown dataset {spec!r}; allowed: {_ALLOWED}{mine}"
                    f"{did_you_mean(spec, names)}")


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
    if kind == "registered":
        return _registered(registry.DATASETS[arg], data_dir)
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


def _registered(entry, data_dir: str | None) -> ImageDataset:
    """Calls a registered loader (with ``data_dir`` when it takes it) and checks its arrays."""
    params = inspect.signature(entry.loader).parameters
    takes = "data_dir" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    try:
        arrays = entry.loader(data_dir=data_dir) if takes else entry.loader()
    except DataError:
        raise
    except Exception as e:  # the user's loader failed: say whose and why, in one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"the loader of dataset {entry.name!r} failed ({type(e).__name__}: "
                        f"{first})") from e
    return from_arrays(entry.name, arrays)


def from_arrays(name: str, arrays: Mapping) -> ImageDataset:
    """An ``ImageDataset`` from a loader's mapping (``registry.DatasetEntry``), checked.

    Images must be uint8 ``[N, H, W, C]`` (``[N, H, W]`` is read as one channel) of one size
    in both splits; labels integers in ``0 .. len(class_names) - 1``; ``mean``/``std`` default
    to the training images' per-channel statistics, ``hflip`` to true.

    Raises:
      DataError: a missing key or a malformed array, naming it.
    """
    if not isinstance(arrays, Mapping):
        raise DataError(f"dataset {name!r}: its loader must return a mapping, got "
                        f"{type(arrays).__name__}")
    missing = [k for k in ("train_images", "train_labels", "test_images", "test_labels",
                           "class_names") if k not in arrays]
    if missing:
        raise DataError(f"dataset {name!r}: its loader's mapping lacks {', '.join(missing)}")
    classes = tuple(str(c) for c in arrays["class_names"])
    out = {}
    for split in ("train", "test"):
        images = np.asarray(arrays[f"{split}_images"])
        if images.ndim == 3:
            images = images[..., None]
        if images.dtype != np.uint8 or images.ndim != 4:
            raise DataError(f"dataset {name!r}: {split}_images must be uint8 [N, H, W, C], got "
                            f"{images.dtype} {images.shape}")
        labels = np.asarray(arrays[f"{split}_labels"])
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or (
                len(labels) and (labels.min() < 0 or labels.max() >= len(classes))):
            raise DataError(f"dataset {name!r}: {split}_labels must be integers in 0.."
                            f"{len(classes) - 1} (one per class name), got {labels.dtype} "
                            f"{labels.shape}")
        if len(labels) != len(images):
            raise DataError(f"dataset {name!r}: {len(labels)} {split}_labels for "
                            f"{len(images)} {split}_images")
        out[split] = (np.ascontiguousarray(images), labels.astype(np.int32))
    if out["train"][0].shape[1:] != out["test"][0].shape[1:]:
        raise DataError(f"dataset {name!r}: train images {out['train'][0].shape[1:]} and test "
                        f"images {out['test'][0].shape[1:]} differ in shape")
    mean, std = channel_stats(out["train"][0])
    mean = tuple(float(m) for m in arrays.get("mean", mean))
    std = tuple(float(s) for s in arrays.get("std", std))
    channels = out["train"][0].shape[-1]
    if len(mean) != channels or len(std) != channels or min(std) <= 0:
        raise DataError(f"dataset {name!r}: mean and std need one value per channel "
                        f"({channels}), std > 0")
    return ImageDataset(name=name, train_images=out["train"][0], train_labels=out["train"][1],
                        test_images=out["test"][0], test_labels=out["test"][1],
                        class_names=classes, mean=mean, std=std,
                        hflip=bool(arrays.get("hflip", True)))


_CHECK_PRESENCE = contextvars.ContextVar("fedjax_rcl_check_data_presence", default=True)


@contextlib.contextmanager
def spec_only():
    """A block in which ``check_dataset_spec`` checks the spec's form (a known name, the
    ``imagefolder:`` form) but not that the data is there: for what reads no data, such as
    ``--print-config``, which must work offline for a dataset this machine does not have."""
    token = _CHECK_PRESENCE.set(False)
    try:
        yield
    finally:
        _CHECK_PRESENCE.reset(token)


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
    if not _CHECK_PRESENCE.get():  # ``spec_only``
        return
    if kind == "imagefolder":
        from fedjax_rcl.data import imagefolder
        imagefolder.check_imagefolder(arg)
    elif kind == "tiny_imagenet":
        from fedjax_rcl.data import tiny_imagenet
        tiny_imagenet.check_tiny_imagenet(data_dir)
    elif kind in TFDS_NAMES:
        from fedjax_rcl.data import tfds_source
        tfds_source.check_tfds(kind, data_dir=data_dir)

"""Image data sources: one entry point that turns a dataset spec into in-memory arrays.

A spec is one of

* a registered dataset's name: the built-in ones (``digits``, the offline default; ``cifar10``,
  ``cifar100``, ``tiny_imagenet``; one module each under :mod:`fedjax_rcl.datasets`) or one a
  plugin registers, both through ``fedjax_rcl.registry.register_dataset`` (:func:`from_arrays`
  checks what a loader returns as arrays);
* ``"imagefolder:PATH"`` -- a directory or ``.zip`` laid out ``train/<class>/*`` and
  ``test/<class>/*`` (:mod:`fedjax_rcl.data.imagefolder`); one that holds a registered dataset
  with fixed constants is normalised with them (:mod:`fedjax_rcl.data.normalization`).

Every source returns an :class:`ImageDataset` (uint8 NHWC images, int32 labels, class names,
normalisation constants). Sources that decode many files cache the decoded arrays on disk
(:func:`cached_arrays`), so only the first load of a dataset pays for decoding.

The source modules are imported lazily, so importing this module does not import
tensorflow-datasets or scikit-learn.
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
from fedjax_rcl.validation import ConfigError, did_you_mean

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

def _parse_spec(spec: str) -> tuple[registry.DatasetEntry | None, str | None]:
    """``spec`` -> ``(entry, None)`` for a registered dataset, ``(None, path)`` for an image
    folder."""
    import fedjax_rcl.datasets  # noqa: F401  (registers the built-in datasets)

    allowed = (f"{', '.join(map(repr, registry.DATASETS))} or '{registry.IMAGEFOLDER_PREFIX}PATH' "
               "(a directory or .zip), or a dataset a plugin registers")
    if not isinstance(spec, str):
        raise DataError(f"dataset spec must be a string, got {spec!r}; allowed: {allowed}")
    if spec.startswith(registry.IMAGEFOLDER_PREFIX):
        path = spec[len(registry.IMAGEFOLDER_PREFIX):]
        if not path:
            raise DataError(f"dataset spec {spec!r} names no path; write 'imagefolder:PATH' with"
                            " PATH a directory or .zip holding train/<class>/* and test/<class>/*")
        return None, path
    if spec in registry.DATASETS:
        return registry.DATASETS[spec], None
    raise DataError(f"unknown dataset {spec!r}; allowed: {allowed}"
                    f"{did_you_mean(spec, list(registry.DATASETS))}")


def load_dataset(spec: str, *, data_dir: str | None = None,
                 cache_dir: str | None = None) -> ImageDataset:
    """Loads a dataset into memory.

    Args:
        spec: a registered dataset's name (``"digits"``, ``"cifar10"``, ``"cifar100"``,
            ``"tiny_imagenet"``, a plugin's) or ``"imagefolder:PATH"``.
        data_dir: Where the dataset's files are, for the loaders that take it (``cifar10``/
            ``cifar100``: TFDS's data directory, None: ``$TFDS_DATA_DIR`` or
            ``~/tensorflow_datasets``; ``tiny_imagenet``: its archive or folder, None: TFDS's
            ``downloads/manual``).
        cache_dir: Where decoded arrays are cached (None: :func:`default_cache_dir`).

    Returns:
        The dataset.

    Raises:
        DataError: Unknown spec, missing or malformed data, or a TFDS dataset that is neither
            prepared nor downloadable.
        ConfigError: A channel whose normalisation std is below ``MIN_STD`` (its training
            images are constant in it), which would make training diverge in round 1.
    """
    entry, path = _parse_spec(spec)
    if entry is None:
        from fedjax_rcl.data import imagefolder
        dataset = imagefolder.load_imagefolder(path, cache_dir=cache_dir)
    else:
        dataset = _registered(entry, data_dir, cache_dir)
    _check_std(spec, dataset)
    return dataset


MIN_STD = 1e-3
"""The smallest per-channel normalisation std (in [0, 1] pixel units) a dataset may have."""


def _check_std(spec: str, dataset: ImageDataset) -> None:
    """Refuses a dataset that normalisation would divide by (almost) zero: a channel whose
    std is below ``MIN_STD`` (constant images in it) makes the inputs huge or non-finite, and
    the first round's loss NaN."""
    for channel, std in enumerate(dataset.std):
        if not std >= MIN_STD:  # also NaN
            raise ConfigError([
                f"dataset={spec!r}: channel {channel} has std {std:.3g} (in [0, 1] pixel "
                f"units, below {MIN_STD:g}): its training images are constant in that channel, "
                "so normalising divides by ~0 and training diverges; use images that vary in "
                "every channel"])


def _registered(entry, data_dir: str | None, cache_dir: str | None = None) -> ImageDataset:
    """Calls a registered loader (with ``data_dir`` and ``cache_dir`` where it takes them) and
    checks the arrays it returns."""
    params = inspect.signature(entry.loader).parameters
    anything = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in (("data_dir", data_dir), ("cache_dir", cache_dir))
              if k in params or anything}
    try:
        out = entry.loader(**kwargs)
    except DataError:
        raise
    except Exception as e:  # the user's loader failed: say whose and why, in one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"the loader of dataset {entry.name!r} failed ({type(e).__name__}: "
                        f"{first})") from e
    if isinstance(out, ImageDataset):
        return out
    if entry.mean is not None and isinstance(out, Mapping):
        out = {"mean": entry.mean, "std": entry.std, **out}
    return from_arrays(entry.name, out)


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
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
            raise DataError(f"dataset {name!r}: {split}_labels must be integers in 0.."
                            f"{len(classes) - 1} (one per class name), got {labels.dtype} "
                            f"{labels.shape}")
        outside = np.flatnonzero((labels < 0) | (labels >= len(classes)))
        if len(outside):  # the first offending sample, so that the user can find it
            i = int(outside[0])
            raise DataError(f"dataset {name!r}: {split}_labels[{i}] = {int(labels[i])} is out of "
                            f"range ({len(outside)} of {len(labels)} {split} labels are): labels "
                            f"must be integers in 0..{len(classes) - 1}, one per class name "
                            f"({len(classes)} given)")
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
    entry, path = _parse_spec(spec)
    if not _CHECK_PRESENCE.get():  # ``spec_only``
        return
    if entry is None:
        from fedjax_rcl.data import imagefolder
        imagefolder.check_imagefolder(path)
    elif entry.check is not None:
        entry.check(data_dir=data_dir)

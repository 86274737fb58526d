"""CIFAR-10 and CIFAR-100 through tensorflow-datasets, without TensorFlow.

TFDS itself imports without TensorFlow, but its CIFAR builders do not prepare without it: they
read the binary batches through ``tf.io.gfile`` and encode PNGs with TF, and TFDS's archive
extractor writes through ``tf.io.gfile`` too. The builders here subclass TFDS's and replace only
the two generator methods: the archive is read in memory with :mod:`tarfile` (never extracted),
the records are parsed with NumPy and the images encoded by Pillow. Everything else -- dataset
name and version (so the prepared folder is ``DATA_DIR/cifar10/3.0.2`` as TFDS's own), download
with checksum verification, writing -- is TFDS's. Data are prepared as ``array_record`` and read
back with ``builder.as_data_source()``, both TF-free.

Resolution order for a dataset:

1. prepared in ``data_dir`` (as ``array_record``): read it;
2. else its archive (``cifar-10-binary.tar.gz`` / ``cifar-100-binary.tar.gz``) is in
   ``DATA_DIR/downloads/manual/``: prepare from it, offline;
3. else the download host answers within 3 s: download and prepare;
4. else :class:`~fedjax_rcl.data.dataset.DataError` saying how to fix it (TFDS itself would
   retry an offline download for minutes).

Decoded arrays are cached like image folders, keyed by the prepared folder and its
``dataset_info.json``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import socket
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image
from tensorflow_datasets.image_classification import cifar

from fedjax_rcl.data.cache import cached_arrays
from fedjax_rcl.data.dataset import DataError, ImageDataset

__all__ = ["check_tfds", "load_tfds"]

# Per-channel (mean, std) in [0, 1] units (the FedRCL reference's constants).
DOWNLOAD_HOST = ("www.cs.toronto.edu", 443)
CONNECT_TIMEOUT_S = 3.0
_READ_CHUNK = 4096  # examples decoded per as_data_source() batch read


class _TfFreeCifar:
    """Mixin over TFDS's ``Cifar10``/``Cifar100`` replacing the TF-dependent generator parts."""

    @property
    def manual_archive(self) -> Path:
        """Where a pre-downloaded archive is picked up: TFDS's default manual folder."""
        url_name = posixpath.basename(self._cifar_info.url)
        return Path(self.data_dir_root) / "downloads" / "manual" / url_name

    def _split_generators(self, dl_manager):
        info = self._cifar_info
        archive = self.manual_archive
        if not archive.is_file():
            archive = dl_manager.download(info.url)  # checksum-verified against TFDS's registry
        wanted = [*info.train_files, *info.test_files, *info.label_files]
        files = _read_tar_members(Path(archive), info.prefix, wanted)
        for key, label_file in zip(info.label_keys, info.label_files, strict=True):
            self.info.features[key].names = [n for n in files[label_file].decode().split("\n")
                                             if n]
        return {
            tfds.Split.TRAIN: self._generate_examples(
                "train_", [files[f] for f in info.train_files]),
            tfds.Split.TEST: self._generate_examples(
                "test_", [files[f] for f in info.test_files]),
        }

    def _generate_examples(self, split_prefix: str, blobs: Sequence[bytes]) -> Iterator:
        """Yields ``(index, example)`` like TFDS's generator, from the batch files' bytes.

        A record is one byte per label key (CIFAR-100: coarse, fine) and 3072 bytes of pixels
        stored as three 32x32 planes (R, G, B).
        """
        keys = self._cifar_info.label_keys
        index = 0
        for blob in blobs:
            records = np.frombuffer(blob, np.uint8).reshape(-1, len(keys) + 3072)
            images = records[:, len(keys):].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            for labels, image in zip(records[:, :len(keys)], images, strict=True):
                example = dict(zip(keys, labels.tolist(), strict=True))
                example["id"] = f"{split_prefix}{index:05d}"
                # A PIL image is PNG-encoded by Pillow; a NumPy array would go through TF.
                example["image"] = Image.fromarray(image)
                yield index, example
                index += 1


class _Cifar10(_TfFreeCifar, cifar.Cifar10, skip_registration=True):
    name = "cifar10"
    # Checksums are looked up next to a builder's code; use the ones TFDS ships for CIFAR.
    url_infos = cifar.Cifar10.url_infos


class _Cifar100(_TfFreeCifar, cifar.Cifar100, skip_registration=True):
    name = "cifar100"
    url_infos = cifar.Cifar100.url_infos


_BUILDERS = {"cifar10": _Cifar10, "cifar100": _Cifar100}


def _read_tar_members(archive: Path, prefix: str, names: Sequence[str]) -> dict[str, bytes]:
    """Reads ``prefix + name`` for each name from a (gzipped) tar into memory."""
    wanted = {prefix + n: n for n in names}
    found = {}
    try:
        with tarfile.open(archive) as tar:
            for member in tar:
                if member.isfile() and member.name in wanted:
                    found[wanted[member.name]] = tar.extractfile(member).read()
    except (OSError, tarfile.TarError, EOFError) as err:
        raise DataError(f"cannot read CIFAR archive {archive}: {err}") from None
    missing = sorted(set(names) - set(found))
    if missing:
        raise DataError(f"CIFAR archive {archive} lacks {[prefix + m for m in missing]}; is it"
                        " the binary version (cifar-*-binary.tar.gz)?")
    return found


def _online() -> bool:
    """Whether the download host accepts a TCP connection within ``CONNECT_TIMEOUT_S``."""
    try:
        with socket.create_connection(DOWNLOAD_HOST, timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """TFDS's warnings muted: looking for a prepared version, it warns about every version
    folder without its metadata, which is what an unprepared data_dir has; what matters is
    reported as a DataError."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


def _builder(name: str, data_dir: str | os.PathLike | None):
    with _quiet():
        return _BUILDERS[name](data_dir=None if data_dir is None else os.fspath(data_dir))


def _is_prepared(builder) -> bool:
    with _quiet():
        return builder.is_prepared()


def _check_readable(builder) -> None:
    """Raises unless the prepared data have a format readable without TensorFlow."""
    formats = builder.info.available_file_formats()
    if not formats & tfds.core.file_adapters.FileFormat.with_random_access():
        raise DataError(
            f"{builder.name} in {builder.data_dir} is stored as"
            f" {sorted(f.value for f in formats)}, which needs TensorFlow to read; point"
            " data_dir at an empty folder (it is then prepared as array_record) or delete that"
            " folder")


def _check_preparable(builder) -> None:
    """Raises unless an unprepared dataset can be prepared: manual archive or host online."""
    if builder.manual_archive.is_file() or _online():
        return
    raise DataError(
        f"{builder.name} is not prepared in {builder.data_dir_root} and"
        f" {DOWNLOAD_HOST[0]} is unreachable (offline?); fix: prepare it once while online"
        f" with this data_dir, or put {builder.manual_archive.name} into"
        f" {builder.manual_archive.parent}, or use 'imagefolder:PATH' (a folder or .zip of"
        " train/<class>/* and test/<class>/* images)")


def check_tfds(name: str, *, data_dir: str | os.PathLike | None = None) -> None:
    """Checks that ``name`` is prepared readably in ``data_dir`` or can be prepared now.

    Raises:
        DataError: Prepared in a TF-only format, or not prepared while its archive is absent and
            its host unreachable.
    """
    builder = _builder(name, data_dir)
    if _is_prepared(builder):
        _check_readable(builder)
    else:
        _check_preparable(builder)


def _read_split(builder, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Decodes one prepared split: ``uint8 [N, 32, 32, 3]`` images, ``int32 [N]`` labels."""
    source = builder.as_data_source(split=split)
    images = np.empty((len(source), *builder.info.features["image"].shape), np.uint8)
    labels = np.empty(len(source), np.int32)
    for start in range(0, len(source), _READ_CHUNK):
        batch = source.__getitems__(list(range(start, min(start + _READ_CHUNK, len(source)))))
        for i, example in enumerate(batch, start):
            images[i] = example["image"]
            labels[i] = example["label"]  # CIFAR-100: the fine label ("coarse_label" is apart)
    return images, labels


def load_tfds(name: str, *, mean: tuple[float, ...], std: tuple[float, ...],
              data_dir: str | os.PathLike | None = None,
              cache_dir: str | os.PathLike | None = None) -> ImageDataset:
    """Loads ``cifar10`` or ``cifar100``, preparing it in ``data_dir`` first if needed.

    Args:
        name: ``"cifar10"`` or ``"cifar100"``.
        mean, std: its normalisation constants (``fedjax_rcl.datasets.cifar10``, ...).
        data_dir: TFDS data directory (None: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
        cache_dir: Cache of decoded arrays (None: ``$FEDJAX_RCL_CACHE`` or
            ``~/.cache/fedjax_rcl``).

    Returns:
        The dataset: ``uint8 [N, 32, 32, 3]`` images in TFDS's stored order, ``int32`` labels
        (CIFAR-100: the 100 fine classes), ``mean``/``std``, ``hflip=True``.

    Raises:
        DataError: See the module docstring; a failed download or prepare is reported as one.
    """
    builder = _builder(name, data_dir)
    if not _is_prepared(builder):
        _check_preparable(builder)
        try:
            builder.download_and_prepare(file_format="array_record")
        except DataError:
            raise
        except Exception as err:
            raise DataError(f"preparing {name} in {builder.data_dir_root} failed:"
                            f" {type(err).__name__}: {err}") from err
    _check_readable(builder)
    info_file = Path(builder.data_dir) / "dataset_info.json"
    st = info_file.stat()
    key = ["tfds", name, str(info_file.resolve()), st.st_size, st.st_mtime_ns]

    def build() -> dict[str, np.ndarray]:
        train_images, train_labels = _read_split(builder, "train")
        test_images, test_labels = _read_split(builder, "test")
        return {"train_images": train_images, "train_labels": train_labels,
                "test_images": test_images, "test_labels": test_labels}

    arrays = cached_arrays(cache_dir, f"tfds-{name}", key, build)
    return ImageDataset(
        name=name,
        train_images=arrays["train_images"], train_labels=arrays["train_labels"],
        test_images=arrays["test_images"], test_labels=arrays["test_labels"],
        class_names=tuple(builder.info.features["label"].names),
        mean=mean, std=std, hflip=True,
    )

"""The in-memory form every data source returns, and the error every source raises.

An ``ImageDataset`` holds uint8 NHWC images, int32 labels, class names and the normalisation
constants of one labelled image dataset; ``DataError`` is a bad spec or unreadable data, its
message one line naming the value and how to fix it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["DataError", "ImageDataset", "channel_stats"]


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

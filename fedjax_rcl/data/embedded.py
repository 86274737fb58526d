"""The embedded offline dataset: scikit-learn's handwritten digits, upsampled to 32x32.

``sklearn.datasets.load_digits`` ships 1,797 8x8 grey images (values 0..16, 10 classes) inside
the scikit-learn wheel, so the default run needs no download. Images are scaled to 0..255 and
upsampled bilinearly to 32x32 so that the CIFAR-sized models apply unchanged.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
from PIL import Image

from fedjax_rcl.data.cache import cached_arrays
from fedjax_rcl.data.dataset import ImageDataset, channel_stats

__all__ = ["load_digits"]

_SIZE = 32
_TEST_FRACTION = 0.2
_SPLIT_SEED = 0


def _decode_digits() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits as sklearn_digits  # a slow import: only when used

    digits = sklearn_digits()
    small = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)  # [N, 8, 8], 0..255
    images = np.stack([
        np.asarray(Image.fromarray(im).resize((_SIZE, _SIZE), Image.Resampling.BILINEAR))
        for im in small
    ])[..., None]
    return {"images": images, "labels": digits.target.astype(np.int32)}


def load_digits(cache_dir: str | None = None) -> ImageDataset:
    """Loads the digits as ``uint8 [N, 32, 32, 1]`` with a stratified 80/20 train/test split.

    The split puts ``round(0.2 * n_c)`` images of each class ``c`` into test, chosen by a
    permutation drawn from ``np.random.default_rng(0)`` (so it never depends on any run
    setting); both splits keep the original order. mean/std are the train images' statistics.
    Digits are not mirror-symmetric, so ``hflip`` is False. The decoded arrays are cached like
    any other source (importing scikit-learn is slow, and a cached load needs none of it).
    """
    version = importlib.metadata.version("scikit-learn")
    arrays = cached_arrays(cache_dir, "digits", ["digits", version, _SIZE], _decode_digits)
    images, labels = arrays["images"], arrays["labels"]

    rng = np.random.default_rng(_SPLIT_SEED)
    is_test = np.zeros(len(labels), dtype=bool)
    for c in range(10):
        members = np.flatnonzero(labels == c)
        is_test[rng.permutation(members)[: round(_TEST_FRACTION * len(members))]] = True

    mean, std = channel_stats(images[~is_test])
    return ImageDataset(
        name="digits",
        train_images=images[~is_test], train_labels=labels[~is_test],
        test_images=images[is_test], test_labels=labels[is_test],
        class_names=tuple(str(c) for c in range(10)),
        mean=mean, std=std, hflip=False,
    )

"""Shared fixtures: small synthetic datasets and configs that compile fast on CPU."""

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from fedjax_rcl.data import ImageDataset

# Tests never use the user's cache.
os.environ.setdefault("FEDJAX_RCL_CACHE", tempfile.mkdtemp(prefix="fedjax-rcl-test-cache-"))


def shared_dir() -> Path:
    """The team's shared folder (``../shared`` next to the checkout), or $FEDJAX_RCL_SHARED."""
    return Path(os.environ.get("FEDJAX_RCL_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def toy_dataset(n_train=240, n_test=80, size=16, classes=4, seed=0) -> ImageDataset:
    """Learnable toy images: each class brightens its own quadrant, plus noise."""
    rng = np.random.default_rng(seed)

    def make(n):
        labels = rng.integers(0, classes, n).astype(np.int32)
        images = rng.integers(0, 90, (n, size, size, 3)).astype(np.int32)
        h = size // 2
        for c in range(classes):
            r, q = divmod(c, 2)
            images[labels == c, r * h:(r + 1) * h, q * h:(q + 1) * h, :] += 150
        return np.clip(images, 0, 255).astype(np.uint8), labels

    (xtr, ytr), (xte, yte) = make(n_train), make(n_test)
    return ImageDataset("toy", xtr, ytr, xte, yte, tuple(f"c{i}" for i in range(classes)),
                        (0.4, 0.4, 0.4), (0.3, 0.3, 0.3), True)


@pytest.fixture(scope="session")
def toy():
    return toy_dataset()

"""Which registered dataset an image folder holds, so that it is normalised with that dataset's
constants.

A dataset with fixed normalisation constants (CIFAR-10, CIFAR-100 and Tiny-ImageNet take the
FedRCL reference's) keeps them whatever the source -- TFDS, or an image folder/zip of the same
dataset such as a CIFAR-10 JPEG archive -- so that every source trains the same model;
statistics computed from the data are only for datasets not recognised. An image folder is
recognised by its class names and image size, which pin a dataset down without reading a single
pixel (each dataset's ``recognise``, ``fedjax_rcl.registry.DatasetEntry``; ``by_class_names``
and ``by_class_pattern`` build the two kinds).

Why it matters: the shared zip's own statistics give a standard deviation of about 0.247 per
channel where the constants say 0.20, so inputs would be scaled by about 0.82 against every
run of the paper.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from fedjax_rcl import registry

__all__ = ["by_class_names", "by_class_pattern", "recognise"]


def _distinct(class_names: Sequence[str], num_classes: int) -> bool:
    return len(class_names) == num_classes and len(set(class_names)) == num_classes


def by_class_names(names, image_size: int) -> Callable[[Sequence[str], tuple], bool]:
    """A recogniser: exactly these class names (any order), ``image_size`` square RGB."""
    names = frozenset(names)

    def recognise(class_names: Sequence[str], image_shape: Sequence[int]) -> bool:
        return (tuple(image_shape) == (image_size, image_size, 3)
                and _distinct(class_names, len(names)) and set(class_names) == names)

    return recognise


def by_class_pattern(pattern: str, num_classes: int,
                     image_size: int) -> Callable[[Sequence[str], tuple], bool]:
    """A recogniser: ``num_classes`` distinct class names each matching ``pattern``,
    ``image_size`` square RGB."""

    def recognise(class_names: Sequence[str], image_shape: Sequence[int]) -> bool:
        return (tuple(image_shape) == (image_size, image_size, 3)
                and _distinct(class_names, num_classes)
                and all(re.fullmatch(pattern, n) for n in class_names))

    return recognise


def recognise(class_names: Sequence[str], image_shape: Sequence[int]
              ) -> registry.DatasetEntry | None:
    """The registered dataset with fixed constants that an image folder with these classes and
    ``(H, W, C)`` images holds, or None. Reads the registry as it is (the built-in datasets
    import this module; ``fedjax_rcl.data.sources`` has registered them before it loads a
    folder).

    >>> recognise(["cat", "dog", "airplane", "automobile", "bird", "deer", "frog", "horse",
    ...            "ship", "truck"], (32, 32, 3)).name
    'cifar10'
    """
    for entry in registry.DATASETS.values():
        if entry.recognise is not None and entry.mean is not None and entry.recognise(
                tuple(class_names), tuple(image_shape)):
            return entry
    return None

"""``dataset=tiny_imagenet``: Tiny-ImageNet (200 classes, 64x64) from the official archive,
offline (``fedjax_rcl.data.tiny_imagenet``), normalised with the FedRCL reference's constants;
an image folder of 200 WordNet ids at 64x64 is recognised as it."""

from __future__ import annotations

from fedjax_rcl import registry
from fedjax_rcl.data.normalization import by_class_pattern

MEAN, STD = (0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)


def load(data_dir=None, cache_dir=None):
    from fedjax_rcl.data import tiny_imagenet

    return tiny_imagenet.load_tiny_imagenet(data_dir, mean=MEAN, std=STD, cache_dir=cache_dir)


def check(data_dir=None) -> None:
    from fedjax_rcl.data import tiny_imagenet

    tiny_imagenet.check_tiny_imagenet(data_dir)


registry.register_dataset(
    "tiny_imagenet", load, mean=MEAN, std=STD, recognise=by_class_pattern(r"n\d{8}", 200, 64),
    check=check,
    doc="Tiny-ImageNet from tiny-imagenet-200.zip, unpacked or not, in data_dir (default: "
        "TFDS's downloads/manual); its labelled val split is the test split")

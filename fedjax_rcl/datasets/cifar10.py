"""``dataset=cifar10``: CIFAR-10 through tensorflow-datasets without TensorFlow
(``fedjax_rcl.data.tfds_source``), normalised with the FedRCL reference's constants; an image
folder with its ten class names at 32x32 is recognised as it."""

from __future__ import annotations

from fedjax_rcl import registry
from fedjax_rcl.data.normalization import by_class_names

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
CLASSES = frozenset("airplane automobile bird cat deer dog frog horse ship truck".split())


def load(data_dir=None, cache_dir=None):
    from fedjax_rcl.data import tfds_source

    return tfds_source.load_tfds("cifar10", mean=MEAN, std=STD, data_dir=data_dir,
                                 cache_dir=cache_dir)


def check(data_dir=None) -> None:
    from fedjax_rcl.data import tfds_source

    tfds_source.check_tfds("cifar10", data_dir=data_dir)


registry.register_dataset(
    "cifar10", load, mean=MEAN, std=STD, recognise=by_class_names(CLASSES, 32), check=check,
    doc="CIFAR-10 through tensorflow-datasets (prepared in data_dir, its archive in "
        "data_dir/downloads/manual, or downloaded)")

"""``dataset=cifar100``: CIFAR-100's 100 fine classes through tensorflow-datasets without
TensorFlow (``fedjax_rcl.data.tfds_source``), normalised with the FedRCL reference's constants;
an image folder with its hundred fine-label names at 32x32 is recognised as it."""

from __future__ import annotations

from fedjax_rcl import registry
from fedjax_rcl.data.normalization import by_class_names

MEAN, STD = (0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)
CLASSES = frozenset("""
    apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus
    butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch
    crab crocodile cup dinosaur dolphin elephant flatfish forest fox girl hamster house kangaroo
    keyboard lamp lawn_mower leopard lion lizard lobster man maple_tree motorcycle mountain mouse
    mushroom oak_tree orange orchid otter palm_tree pear pickup_truck pine_tree plain plate poppy
    porcupine possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk skyscraper
    snail snake spider squirrel streetcar sunflower sweet_pepper table tank telephone television
    tiger tractor train trout tulip turtle wardrobe whale willow_tree wolf woman worm
    """.split())


def load(data_dir=None, cache_dir=None):
    from fedjax_rcl.data import tfds_source

    return tfds_source.load_tfds("cifar100", mean=MEAN, std=STD, data_dir=data_dir,
                                 cache_dir=cache_dir)


def check(data_dir=None) -> None:
    from fedjax_rcl.data import tfds_source

    tfds_source.check_tfds("cifar100", data_dir=data_dir)


registry.register_dataset(
    "cifar100", load, mean=MEAN, std=STD, recognise=by_class_names(CLASSES, 32), check=check,
    doc="CIFAR-100 (the 100 fine classes) through tensorflow-datasets, as cifar10")

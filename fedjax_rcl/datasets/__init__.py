"""The built-in datasets, one module each: every module here registers its dataset through
``fedjax_rcl.registry.register_dataset``, the call a user's dataset plugin makes, with its
loader, its one-line description, its normalisation and, where it has one, its cheap check.

Importing this package registers them all (the list below), so a new built-in dataset is one
module here, its line below and its test. A module stays light to import: it imports its data
source (TFDS, scikit-learn, an archive reader) only when the data are loaded or checked.
"""

from fedjax_rcl.datasets import cifar10, cifar100, digits, tiny_imagenet

__all__ = ["cifar10", "cifar100", "digits", "tiny_imagenet"]

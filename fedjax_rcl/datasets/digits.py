"""``dataset=digits``: scikit-learn's handwritten digits upsampled to 32x32, the offline default
(``fedjax_rcl.data.embedded``); normalised by its own statistics."""

from __future__ import annotations

from fedjax_rcl import registry


def load(cache_dir=None):
    from fedjax_rcl.data import embedded

    return embedded.load_digits(cache_dir)


registry.register_dataset(
    "digits", load,
    doc="scikit-learn's handwritten digits (1,797 images, 10 classes) upsampled to 32x32: "
        "offline, the default")

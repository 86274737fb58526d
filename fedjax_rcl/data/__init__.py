"""Datasets, client partitions, device packing and augmentation.

Importing this package stays light (NumPy only); ``augment`` and ``device`` pull in JAX and are
imported from their modules.
"""

from fedjax_rcl.data.partitioning import (
    METHODS,
    PARTITIONS,
    class_counts,
    heterogeneity_summary,
    load_reference_split,
    partition,
    plot_class_counts,
)
from fedjax_rcl.data.sources import DataError, ImageDataset, check_dataset_spec, load_dataset

__all__ = [
    "METHODS",
    "PARTITIONS",
    "DataError",
    "ImageDataset",
    "check_dataset_spec",
    "class_counts",
    "heterogeneity_summary",
    "load_dataset",
    "load_reference_split",
    "partition",
    "plot_class_counts",
]

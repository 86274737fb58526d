"""The images and splits our MOON Table 1 runs train on, written for the authors' code.

Run with this package installed (it decodes the JPEG archive and draws the splits exactly as
the suite's runs do); ``harness.py`` then serves them to the authors' MOON code, which runs in
its own PyTorch environment:

    CIFAR10_JPEG_ZIP=/path/cifar10-jpeg.zip python experiments/moon_table1/authors/export.py \\
        --out ~/.cache/fedjax-rcl/authors_moon/cifar10_moon_table1.npz

The file holds ``train_images`` / ``test_images`` (uint8, N x 32 x 32 x 3, our training order),
``train_labels`` / ``test_labels``, and for each seed ``split_s<seed>``: the concatenated client
index lists with ``split_s<seed>_sizes``, drawn by ``experiment.make_partition`` from the suite's
own config (``experiments/paper/moon_cifar10_cnn.yaml`` with ``seed=<seed>``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fedjax_rcl.config import load_config
from fedjax_rcl.data.sources import load_dataset
from fedjax_rcl.experiment import make_partition

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "experiments" / "paper" / "moon_cifar10_cnn.yaml"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    arrays = {}
    for seed in args.seeds:
        cfg = load_config(str(CONFIG), [f"seed={seed}"])
        if not arrays:
            data = load_dataset(cfg.dataset)
            arrays.update(train_images=data.train_images, train_labels=data.train_labels,
                          test_images=data.test_images, test_labels=data.test_labels)
        parts = make_partition(cfg, np.asarray(arrays["train_labels"]))
        arrays[f"split_s{seed}"] = np.concatenate(parts).astype(np.int64)
        arrays[f"split_s{seed}_sizes"] = np.array([len(p) for p in parts], np.int64)
        print(f"seed {seed}: client sizes {arrays[f'split_s{seed}_sizes'].tolist()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **arrays)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

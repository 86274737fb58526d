"""The FedRCL authors' client split on an image-folder copy of CIFAR-10 (such as the JPEG archive),
and a check of the mapping against lossless images.

The authors ship their splits (``client_data/CIFAR10/balanced/dirichlet0.3_clients100.txt`` in
skynbe/FedRCL) as indices into the binary release's training order, without labels. An
image-folder copy made from that release in order, numbering each class's files from 0
(``train/<class>/NNNN.jpg``, as the JPEG archive is), holds release image ``i`` at
``train/<class of i>/<rank of i among its class>``. So the release's label sequence is all the
mapping needs; any copy of the release's python batches has it ahead of the pixels, so even a
prefix of each ``data_batch_N`` will do.

    # the authors' split in our loader's order (partition=file split_file=OUT)
    python tools/authors_split.py map \
        --split FedRCL/client_data/CIFAR10/balanced/dirichlet0.3_clients100.txt \
        --labels BATCHES_DIR_OR_LABELS.npy --archive cifar10-jpeg.zip --out split.txt
    # the mapping checked image by image wherever lossless pixels are at hand (prefixes of the
    # python batches), and the archive's JPEG error measured on them
    python tools/authors_split.py verify --batches BATCHES_DIR --archive cifar10-jpeg.zip \
        --json out.json

``map`` also checks that the package's loader gives every mapped image the release's label
(its sorted class folders are the release's classes, in order); the mapping itself is what
``verify`` checks: it compares each lossless image with the archive file the mapping gives it
and with the next file of the same class (a wrong image of the right class), and the mapping
holds where the first is far closer than the second.
"""

from __future__ import annotations

import argparse
import io
import json
import pickletools
import struct
import sys
import zipfile
from pathlib import Path

import numpy as np

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
           "truck")
IMAGE_BYTES = 32 * 32 * 3
TRAIN_BATCHES = tuple(f"data_batch_{k}" for k in range(1, 6))
_STRINGS = {"SHORT_BINSTRING", "BINSTRING", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
            "SHORT_BINBYTES", "BINBYTES"}
_INTS = {"BININT", "BININT1", "BININT2", "LONG1"}


def read_batch(raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The labels and whatever images a CIFAR-10 python batch holds, whole or a prefix of one.

    The batch is a pickled dict whose ``labels`` list comes before its ``data`` array
    (``[n, 3072]`` uint8: the red, green and blue planes of 32x32 images), so a prefix holds
    every label and the first images. Nothing is unpickled: the opcodes are read as data.

    Returns:
      ``labels`` int64 ``[n]`` and ``images`` uint8 ``[m, 32, 32, 3]``, ``m <= n`` the images
      complete in ``raw``.
    """
    labels: list[int] = []
    in_labels, data_at = False, None
    try:
        for op, arg, pos in pickletools.genops(io.BytesIO(raw)):
            if op.name in _STRINGS:
                key = arg.decode("latin-1") if isinstance(arg, bytes) else str(arg)
                if key in ("data", b"data"):
                    data_at = pos
                    break
                in_labels = key == "labels"
            elif in_labels and op.name in _INTS:
                labels.append(int(arg))
    except ValueError:  # the prefix ends inside an opcode
        pass
    if not labels:
        raise ValueError("no 'labels' list found: not a CIFAR-10 python batch")
    y = np.asarray(labels, np.int64)
    if data_at is None:
        return y, np.zeros((0, 32, 32, 3), np.uint8)
    # The pixels: one byte string of n * 3072 bytes (BINSTRING 'T' in the release's Python 2
    # pickles, BINBYTES 'B' in Python 3's), its 4-byte length ahead of it.
    size = struct.pack("<I", y.size * IMAGE_BYTES)
    at = min((i for i in (raw.find(b"T" + size, data_at), raw.find(b"B" + size, data_at))
              if i >= 0), default=-1)
    if at < 0:
        return y, np.zeros((0, 32, 32, 3), np.uint8)
    body = raw[at + 5:at + 5 + y.size * IMAGE_BYTES]
    m = len(body) // IMAGE_BYTES
    images = np.frombuffer(body[:m * IMAGE_BYTES], np.uint8).reshape(m, 3, 32, 32)
    return y, images.transpose(0, 2, 3, 1).copy()


def release_labels(source: str | Path) -> np.ndarray:
    """The 50,000 training labels in the release's order: from a ``.npy`` file, or from a folder
    holding ``data_batch_1`` .. ``data_batch_5`` (whole or prefixes)."""
    source = Path(source)
    if source.suffix == ".npy":
        y = np.load(source).astype(np.int64).ravel()
    else:
        y = np.concatenate([read_batch((source / b).read_bytes())[0] for b in TRAIN_BATCHES])
    if y.shape != (50000,) or y.min() < 0 or y.max() > 9:
        raise ValueError(f"{source}: expected 50,000 labels in 0..9, got {y.shape} in "
                         f"{y.min()}..{y.max()}")
    return y


def ranks(labels: np.ndarray) -> np.ndarray:
    """``r[i]``: how many images of ``labels[i]``'s class come before ``i``."""
    r = np.zeros(labels.size, np.int64)
    for c in np.unique(labels):
        at = np.flatnonzero(labels == c)
        r[at] = np.arange(at.size)
    return r


def _images(z: zipfile.ZipFile) -> list[str]:
    return [n for n in z.namelist() if n.lower().endswith((".jpg", ".jpeg", ".png"))]


def _top_folder(names: list[str]) -> str:
    """A folder common to every member (``cifar10/`` of ``cifar10/train/...``), which is not
    part of the layout; ``""`` when there is none."""
    tops = {n.split("/", 1)[0] for n in names}
    top = next(iter(tops)) if len(tops) == 1 else "train"
    return "" if top in ("train", "test") else top + "/"


def archive_members(archive: str | Path, split: str = "train") -> list[str]:
    """The archive's image files of ``split`` in the order the package's image-folder loader
    reads them (sorted paths), without a common top folder."""
    with zipfile.ZipFile(archive) as z:
        names = _images(z)
    strip = len(_top_folder(names))
    return sorted(n[strip:] for n in names if n[strip:].startswith(f"{split}/"))


def release_to_archive(labels: np.ndarray, members: list[str], split: str = "train"
                       ) -> np.ndarray:
    """``index[i]``: the position in ``members`` (the loader's order) of release image ``i``,
    by its class and its rank within the class (``<split>/<class>/<rank:04d>.<ext>``)."""
    where = {}
    for k, m in enumerate(members):
        _, cls, name = m.split("/")
        where[(cls, int(Path(name).stem))] = k
    r = ranks(labels)
    try:
        return np.array([where[(CLASSES[c], int(k))] for c, k in zip(labels, r, strict=True)])
    except KeyError as e:
        raise ValueError(f"the archive has no file {split}/{e.args[0][0]}/{e.args[0][1]:04d}.*; "
                         "it was not numbered in the release's order from 0") from None


def map_split(args) -> int:
    from fedjax_rcl.data import load_dataset, load_reference_split

    y = release_labels(args.labels)
    parts = load_reference_split(args.split, num_samples=y.size)
    members = archive_members(args.archive)
    index = release_to_archive(y, members)
    ours = load_dataset(f"imagefolder:{args.archive}").train_labels
    wrong = int(np.sum(ours[index] != y))
    if wrong:
        raise SystemExit(f"{wrong} mapped images carry another label in the archive: the labels "
                         "or the archive are not the release's")
    mapped = {k: sorted(int(i) for i in index[p]) for k, p in enumerate(parts)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(str(mapped))
    sizes = [len(v) for v in mapped.values()]
    print(json.dumps({"split": str(args.split), "clients": len(mapped), "samples": sum(sizes),
                      "client_sizes": sorted(set(sizes)), "labels_checked": int(y.size),
                      "out": str(args.out)}))
    return 0


def _decode(z: zipfile.ZipFile, name: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(z.read(name))) as im:
        return np.asarray(im.convert("RGB"), np.int16)


def verify(args) -> int:
    """Each lossless image against the archive file the mapping names and against the next file
    of its class; and the archive's JPEG error on the matched pairs."""
    batches = Path(args.batches)
    train_y = release_labels(args.labels or batches)
    out = {"batches": {}, "archive": str(args.archive)}
    members = {split: archive_members(args.archive, split) for split in ("train", "test")}
    train_index = release_to_archive(train_y, members["train"])
    with zipfile.ZipFile(args.archive) as z:
        prefix = _top_folder(_images(z))
        for name in (*TRAIN_BATCHES, "test_batch"):
            if not (batches / name).exists():
                continue
            y, images = read_batch((batches / name).read_bytes())
            split = "test" if name == "test_batch" else "train"
            labels = y if split == "test" else train_y
            offset = 0 if split == "test" else 10000 * (int(name[-1]) - 1)
            if split == "train" and not np.array_equal(y, train_y[offset:offset + y.size]):
                raise SystemExit(f"{name}: its labels differ from --labels")
            index = (train_index if split == "train"
                     else release_to_archive(labels, members[split], split))
            per_class = ranks(labels)
            matched, control, psnr = [], [], []
            for k in range(images.shape[0]):
                i = offset + k
                lossless = images[k].astype(np.int16)
                jpeg = _decode(z, prefix + members[split][index[i]])
                d = np.abs(jpeg - lossless)
                matched.append(float(d.mean()))
                mse = float(np.mean(d.astype(np.float64) ** 2))
                psnr.append(10 * np.log10(255.0 ** 2 / mse) if mse else float("inf"))
                cls, r = CLASSES[labels[i]], (per_class[i] + 1) % (5000 if split == "train"
                                                                    else 1000)
                other = _decode(z, prefix + f"{split}/{cls}/{r:04d}.jpg")
                control.append(float(np.abs(other - lossless).mean()))
            m, c = np.array(matched), np.array(control)
            out["batches"][name] = {
                "images": int(m.size), "labels": int(y.size),
                "matched_mean_abs_error": {"median": float(np.median(m)), "max": float(m.max())},
                "next_in_class_mean_abs_error": {"median": float(np.median(c)),
                                                 "min": float(c.min())},
                "matched_closer_than_control": int(np.sum(m < c)),
                "psnr_db": {"median": float(np.median(psnr)), "p5": float(np.percentile(psnr, 5)),
                            "p95": float(np.percentile(psnr, 95))},
            }
            print(name, json.dumps(out["batches"][name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("map", help="the authors' split file in the archive's (our loader's) order")
    m.add_argument("--split", required=True, help="the authors' split file")
    m.add_argument("--labels", required=True,
                   help="the release's training labels: a .npy, or a folder of data_batch_1..5")
    m.add_argument("--archive", required=True, help="the image-folder zip (train/<class>/NNNN.*)")
    m.add_argument("--out", required=True)
    v = sub.add_parser("verify", help="the mapping and the JPEG error on lossless images")
    v.add_argument("--batches", required=True,
                   help="a folder of the release's python batches (whole or prefixes)")
    v.add_argument("--labels", help="training labels (default: from --batches)")
    v.add_argument("--archive", required=True)
    v.add_argument("--json")
    args = p.parse_args(argv)
    return map_split(args) if args.cmd == "map" else verify(args)


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint size and save/restore time for the run state of a few configurations.

    python tools/bench_checkpoint.py     # prints a table, appends it to benchmarks/HISTORY.md

Measures, per configuration: the state's bytes, bytes on disk, the time ``save`` blocks the
training loop (device-to-host copy; the write itself runs in the background), the time until the
checkpoint is complete on disk, and the restore time (fingerprint check included).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from fedjax_rcl.checkpoint import Checkpointer, state_nbytes
from fedjax_rcl.config import Config
from fedjax_rcl.data import ImageDataset
from fedjax_rcl.experiment import build

CONFIGS = [
    ("cnn", "fedrcl", 100),
    ("cnn", "moon", 100),
    ("resnet18", "fedrcl", 100),
]


def fake_cifar(n=5000) -> ImageDataset:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    y = (np.arange(n) % 10).astype(np.int32)
    return ImageDataset("fake-cifar", x, y, x[:500], y[:500], tuple(map(str, range(10))),
                        (0.5,) * 3, (0.25,) * 3, True)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(model, algorithm, clients, repeats=3):
    cfg = Config(dataset="fake", model=model, algorithm=algorithm, num_clients=clients,
                 partition="iid")
    exp = build(cfg, fake_cifar())
    state = exp.state
    jax.block_until_ready(state)
    root = Path(tempfile.mkdtemp())
    try:
        ckpt = Checkpointer(root / "ckpt", keep=2)
        ckpt.save(0, state, {"round": 0})  # warm-up (handler set-up, fingerprint compile)
        ckpt.wait()
        blocking, complete = [], []
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            ckpt.save(step, state, {"round": step})
            blocking.append(time.perf_counter() - t0)
            ckpt.wait()
            complete.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        restored = ckpt.restore_latest(state)
        restore_s = time.perf_counter() - t0
        assert restored.step == repeats
        size = du(root / "ckpt" / str(repeats))
        ckpt.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"model": model, "algorithm": algorithm, "clients": clients,
            "state_mb": state_nbytes(state) / 2**20, "disk_mb": size / 2**20,
            "save_blocking_s": float(np.median(blocking)),
            "save_complete_s": float(np.median(complete)), "restore_s": restore_s}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    rows = [measure(*c) for c in CONFIGS]
    header = ("| model | algorithm | clients | state MB | on disk MB | save blocks s | "
              "save complete s | restore s |\n|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['model']} | {r['algorithm']} | {r['clients']} | {r['state_mb']:.1f} | "
             f"{r['disk_mb']:.1f} | {r['save_blocking_s']:.3f} | {r['save_complete_s']:.3f} | "
             f"{r['restore_s']:.3f} |" for r in rows]
    table = "\n".join([header, *lines])
    print(table)
    if not args.no_append:
        machine = (f"{platform.processor() or platform.machine()}, {jax.device_count()} "
                   f"{jax.default_backend()} device(s), jax {jax.__version__}")
        with open(Path(__file__).resolve().parents[1] / "benchmarks" / "HISTORY.md", "a") as f:
            f.write(f"\n## Checkpoints ({time.strftime('%Y-%m-%d')}, {machine})\n\n"
                    "`python tools/bench_checkpoint.py`: the whole run state (global model, "
                    "server optimizer, client-state table, key, round) through Orbax; median "
                    "of 3 saves.\n\n" + table + "\n")


if __name__ == "__main__":
    main()

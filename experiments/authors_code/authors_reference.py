"""Runs the FedRCL authors' released code (skynbe/FedRCL) on this project's data and split.

Why: to tell whether a gap between our numbers and the paper's lies in our implementation or in
what both are fed (issue "like for like with the paper"). The authors' code is run unmodified:
this script only composes its Hydra config, registers two additions in its own registries and
drives its ``Trainer``:

* **data adapter** -- a ``CIFAR10`` dataset class that serves the images this project decoded
  from the same archive, in this project's order, as PIL images through the authors' own
  torchvision transforms (their ``datasets/build.py``), and a client split file in their format
  (``{client: [indices]}``) holding *our* run's split, read by their ``get_dataset``;
* **model width and depth** -- ``ResNet10W16``, their ``ResNet_base`` (forward, levels, the
  3x3 stem without max-pool, GroupNorm with 2 groups, their ``BasicBlock``) built with one block
  per stage and widths 16/32/64/128, this project's CPU fidelity model; their model builder has
  no width or depth argument (``ResNet18_base`` fixes 64 channels and [2, 2, 2, 2]).

Everything else is theirs: client sampling (``np.random.choice``), initialisation (PyTorch's
defaults), local SGD with clipping at 10 and the per-epoch 0.998 decay, aggregation, evaluation
on the test set after each round. Settings changed from their defaults, all of them on the command
line here: ``dataset=cifar10``, ``client=base`` (FedAvg) or ``client=fedrcl`` (their default
loss), ``split.alpha``, ``trainer.global_rounds``, ``seed``, ``use_amp=False`` (their autocast
and GradScaler are CUDA's; on a CPU they do nothing), ``num_workers=0``, ``pin_memory=False``,
``wandb=False``, ``eval.freq=1``.

Chunks and resume: their own resume (``load_model_path``) restores the model but not the random
generators, so a resumed run would sample other clients than an uninterrupted one. This driver
saves the model with the NumPy, PyTorch and Python generator states after each chunk and restores
all of them, so chunks continue the same sequence.

Two steps, in two environments::

  # 1) in this project's environment: the decoded images and a run's split
  python experiments/authors_code/authors_reference.py export \
      experiments/runs/seeds_cpu/fedavg-a0.3-s1 --out runs/authors_data/s1
  # 2) in an environment with the authors' requirements (torch, torchvision, hydra-core,
  #    omegaconf, coloredlogs, wandb, netcal, matplotlib), given a checkout of their code
  python experiments/authors_code/authors_reference.py run --checkout PATH/FedRCL \
      --data runs/authors_data/s1 --algorithm fedrcl --rounds 25 \
      --run-dir experiments/runs/authors_code/fedrcl-a0.3-s1

``run`` writes ``metrics.jsonl`` (one line per round: ``round`` counted from 1 as ours,
``test_accuracy`` in [0, 1]), ``config.yaml`` (their composed config), ``commands.txt`` and
``environment.jsonl`` in the run directory, and its resume state under ``checkpoints/`` (never
committed). Run it again with a larger ``--rounds`` to continue.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

CLIENT = {"fedavg": "base", "fedrcl": "fedrcl"}


# ------------------------------------------------------------------------------------------
# Step 1: export (this project's environment).
# ------------------------------------------------------------------------------------------


def export(run: str, out: str, dataset: str | None) -> None:
    """Writes the run's images (train and test, uint8, our order) and its client split."""
    import numpy as np
    from omegaconf import OmegaConf

    from fedjax_rcl.data import load_dataset, partition

    run_path = Path(run)
    cfg = OmegaConf.load(run_path / "config.yaml" if run_path.is_dir() else run_path)
    spec = dataset or str(cfg.dataset)
    ds = load_dataset(spec, data_dir=cfg.get("data_dir"))
    parts = partition(ds.train_labels, int(cfg.num_clients), method=str(cfg.partition),
                      seed=int(cfg.seed), alpha=float(cfg.alpha),
                      shards_per_client=int(cfg.shards_per_client), balanced=bool(cfg.balanced))
    out_path = Path(out)
    out_path.mkdir(parents=True, exist_ok=True)
    np.savez(out_path / "images.npz", train_images=ds.train_images, train_labels=ds.train_labels,
             test_images=ds.test_images, test_labels=ds.test_labels,
             class_names=np.array(ds.class_names))
    mode = "iid" if cfg.partition == "iid" else f"dirichlet{cfg.alpha}"
    split_dir = out_path / "client_data" / "CIFAR10" / "balanced"
    split_dir.mkdir(parents=True, exist_ok=True)
    split = {c: [int(i) for i in p] for c, p in enumerate(parts)}
    # Their get_dataset eval()s the file's last line: the str() of a dict, on one line.
    (split_dir / f"{mode}_clients{cfg.num_clients}.txt").write_text(str(split) + "\n")
    meta = {"source_run": str(run_path), "dataset": spec, "seed": int(cfg.seed),
            "partition": str(cfg.partition), "alpha": float(cfg.alpha),
            "num_clients": int(cfg.num_clients), "split_mode": mode,
            "train": int(len(ds.train_labels)), "test": int(len(ds.test_labels)),
            "our_mean": list(ds.mean), "our_std": list(ds.std)}
    (out_path / "export.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out_path}: {meta['train']} train / {meta['test']} test images, "
          f"{len(parts)} clients ({mode}, seed {cfg.seed})")


# ------------------------------------------------------------------------------------------
# Step 2: run (the authors' environment).
# ------------------------------------------------------------------------------------------


def _adapters(data_dir: Path, width: int):
    """The data adapter and the model of the fidelity width, in their registries."""
    import numpy as np
    import torch.nn as nn
    from datasets.build import DATASET_REGISTRY
    from models.build import ENCODER_REGISTRY
    from models.resnet import BasicBlock
    from models.resnet_base import ResNet_base
    from PIL import Image

    arrays = np.load(data_dir / "images.npz")

    class ArrayCIFAR10:
        """torchvision's CIFAR10 interface (``classes``, ``class_to_idx``, ``targets``,
        ``__getitem__`` -> (PIL image, int label) through ``transform``) over our arrays."""

        def __init__(self, root=None, train=True, transform=None, download=False, **_):
            key = "train" if train else "test"
            self.data = arrays[f"{key}_images"]
            self.targets = [int(t) for t in arrays[f"{key}_labels"]]
            self.classes = [str(c) for c in arrays["class_names"]]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
            self.transform = transform

        def __len__(self):
            return len(self.targets)

        def __getitem__(self, i):
            img = Image.fromarray(self.data[i])
            if self.transform is not None:
                img = self.transform(img)
            return img, self.targets[i]

    DATASET_REGISTRY._obj_map["CIFAR10"] = ArrayCIFAR10

    class ResNet10W16(ResNet_base):
        """Their ResNet_base with one BasicBlock per stage at widths w, 2w, 4w, 8w (their
        ``ResNet.__init__`` with the width and depth as arguments; nothing else differs)."""

        def __init__(self, args, num_classes=10, l2_norm=False, use_bn_layer=False, **kwargs):
            nn.Module.__init__(self)
            w = width
            self.l2_norm = l2_norm
            self.in_planes = w
            self.conv1 = nn.Conv2d(3, w, kernel_size=3, stride=1, padding=1, bias=False)
            self.bn1 = nn.GroupNorm(2, w) if not use_bn_layer else nn.BatchNorm2d(w)
            self.layer1 = self._make_layer(BasicBlock, w, 1, 1, use_bn_layer=use_bn_layer)
            self.layer2 = self._make_layer(BasicBlock, 2 * w, 1, 2, use_bn_layer=use_bn_layer)
            self.layer3 = self._make_layer(BasicBlock, 4 * w, 1, 2, use_bn_layer=use_bn_layer)
            self.layer4 = self._make_layer(BasicBlock, 8 * w, 1, 2, use_bn_layer=use_bn_layer)
            self.logit_detach = False
            self.num_layers = 6
            self.fc = nn.Linear(8 * w, num_classes, bias=not l2_norm)

    ENCODER_REGISTRY._obj_map["ResNet10W16"] = ResNet10W16


def _environment() -> dict:
    import torch

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in info:
                info[key] = value.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    feats = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    cpu = f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model " \
          f"{info.get('model', '?')})"
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": platform.node(), "cpu": cpu, "cpu_features": feats,
            "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def run(checkout: str, data: str, algorithm: str, rounds: int, run_dir: str, width: int,
        threads: int | None) -> None:
    import random

    import numpy as np
    import torch

    checkout_path = Path(checkout).resolve()
    data_dir = Path(data).resolve()
    out = Path(run_dir).resolve()
    meta = json.loads((data_dir / "export.json").read_text())
    if threads:
        torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "commands.txt", "a") as f:
        f.write("python " + " ".join(shlex.quote(a) for a in sys.argv) + "\n")
    with open(out / "environment.jsonl", "a") as f:
        f.write(json.dumps(_environment()) + "\n")

    os.chdir(checkout_path)  # their build_dataset opens datasets/configs.yaml relative to it
    sys.path.insert(0, str(checkout_path))
    import logging

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    overrides = [
        "dataset=cifar10", f"client={CLIENT[algorithm]}", "model.name=ResNet10W16",
        f"model.last_feature_dim={8 * width}", "split.mode=dirichlet" if meta["partition"] ==
        "dirichlet" else "split.mode=iid", f"split.alpha={meta['alpha']}",
        f"trainer.num_clients={meta['num_clients']}", f"trainer.global_rounds={rounds}",
        f"seed={meta['seed']}", "use_amp=False", "num_workers=0", "pin_memory=False",
        "wandb=False", "eval.freq=1", f"dataset.client_path={data_dir / 'client_data'}",
        f"dataset.path={data_dir}", "dataset.download=False",
        f"checkpoint_path={out / 'checkpoints'}", f"log_dir={out / 'checkpoints'}",
        "save_freq=-1", f"exp_name={algorithm}",
    ]
    with initialize_config_dir(config_dir=str(checkout_path / "configs"), version_base=None):
        args = compose(config_name="config", overrides=overrides)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(args))

    from clients.build import get_client_type
    from evalers.build import get_evaler_type
    from models.build import build_encoder
    from servers.build import build_server
    from trainers.build import get_trainer_type
    from utils import initalize_random_seed

    _adapters(data_dir, width)
    logging.getLogger().setLevel(logging.WARNING)
    from datasets.build import build_datasets

    initalize_random_seed(args)
    model = build_encoder(args)
    client_type = get_client_type(args)
    server = build_server(args)
    datasets = build_datasets(args)
    trainer = get_trainer_type(args)(
        model=model, client_type=client_type, server=server, evaler_type=get_evaler_type(args),
        datasets=datasets, device=torch.device("cpu"), args=args, config=None)

    state_path = out / "checkpoints" / "driver_state.pt"
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        trainer.model.load_state_dict(state["model"])
        trainer.start_round = state["rounds_done"]
        np.random.set_state(state["numpy"])  # noqa: NPY002 (their code draws from it)
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        print(f"resuming {out.name} at round {state['rounds_done']}", flush=True)
    if trainer.start_round >= rounds:
        print(f"nothing to do: {out.name} is at round {trainer.start_round}")
        return

    metrics = out / "metrics.jsonl"
    if metrics.exists():  # drop rounds after the state (a chunk killed before its save)
        kept = [ln for ln in metrics.read_text().splitlines()
                if ln and json.loads(ln)["round"] <= trainer.start_round]
        metrics.write_text("".join(ln + "\n" for ln in kept))
    original_evaluate = trainer.evaluate
    t0 = time.time()

    def evaluate(epoch, local_datasets=None):
        result = original_evaluate(epoch=epoch, local_datasets=local_datasets)
        with open(metrics, "a") as f:
            f.write(json.dumps({"round": epoch + 1, "test_accuracy": result["acc"] / 100.0,
                                "elapsed_s": round(time.time() - t0, 3)}) + "\n")
        print(f"{out.name} round {epoch + 1}: {result['acc']:.2f}%", flush=True)
        return result

    trainer.evaluate = evaluate
    trainer.train()
    state_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = state_path.with_suffix(".tmp")
    torch.save({"model": trainer.model.state_dict(), "rounds_done": rounds,
                "numpy": np.random.get_state(),  # noqa: NPY002 (their global generator)
                "torch": torch.get_rng_state(),
                "python": random.getstate()}, tmp)
    os.replace(tmp, state_path)
    print(f"{out.name}: rounds {rounds} done", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write a run's images and split for the authors' code")
    e.add_argument("run", help="a run directory (or its config.yaml) of this project")
    e.add_argument("--out", required=True)
    e.add_argument("--dataset", help="dataset spec (default: the run's)")
    r = sub.add_parser("run", help="train with the authors' code on an export")
    r.add_argument("--checkout", required=True, help="a checkout of skynbe/FedRCL")
    r.add_argument("--data", required=True, help="an export directory")
    r.add_argument("--algorithm", choices=sorted(CLIENT), required=True)
    r.add_argument("--rounds", type=int, required=True, help="train up to this round")
    r.add_argument("--run-dir", required=True)
    r.add_argument("--width", type=int, default=16)
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    a = p.parse_args(argv)
    if a.cmd == "export":
        export(a.run, a.out, a.dataset)
    else:
        run(a.checkout, a.data, a.algorithm, a.rounds, a.run_dir, a.width, a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The authors' MOON code (QinbinLi/MOON) on our images and our split, on a CPU.

Runs their ``main.py`` unchanged, in their own PyTorch environment, with the paper's CIFAR-10
command (their README's: simple CNN, lr 0.01, mu 5, 10 local epochs, 10 parties, Dirichlet
beta 0.5, batch 64, temperature 0.5, projection output 256, weight decay 1e-5), changing only
what it must, each change applied from outside their files before ``main.py`` runs:

1. **Images**: their ``CIFAR10_truncated`` reads ``torchvision.datasets.CIFAR10``; that name in
   their ``datasets`` module is replaced by a stand-in holding our decoded JPEG images and
   labels (``export.py``) in the same ``data`` / ``targets`` form. Their transforms, data
   loaders and normalisation are untouched.
2. **Split**: their ``partition_data`` draws its own Dirichlet split; it is replaced by one
   returning the same tuple with our split of this seed as ``net_dataidx_map`` (client ``i``
   of our run is their party ``i``), their class-count record kept.
3. **Device**: their code calls ``.cuda()`` on tensors, models and losses; on a CPU these are
   made to return the object unchanged, and ``--device cpu`` is passed. Their
   ``compute_accuracy`` picks its loss by ``device == 'cpu'``, which a ``torch.device`` no
   longer equals in current PyTorch (no branch is taken and it fails): it is given the string
   ``'cpu'`` instead.
4. **Records**: their log keeps minutes only; a logging handler added beside theirs writes
   each round's global test accuracy to ``WORKDIR/metrics.jsonl`` with the round's seconds and
   the part of them spent evaluating the global model (on the training and test sets, as
   their loop does every round).
5. Optionally (``--skip-client-evals``), the accuracy evaluations inside their local training
   functions (each client's train and test accuracy before and after its local epochs, used
   only for their log) return zeros instead of running; the global model's evaluation after
   each round, which is the metric, always runs. Off by default.

    AUTHORS_MOON=/path/QinbinLi-MOON  # a checkout of 8fcba3c
    python experiments/moon_table1/authors/harness.py --data cifar10_moon_table1.npz \\
        --alg moon --seed 0 --rounds 100 --workdir RUN_DIR

``--epochs`` and ``--rounds`` override their values for timing runs; everything else is the
README's command. Their code seeds NumPy, PyTorch and ``random`` with ``--init_seed``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import runpy
import sys
import time
from pathlib import Path

import numpy as np


def paper_argv(alg: str, seed: int, rounds: int, epochs: int, workdir: Path) -> list[str]:
    """Their README's CIFAR-10 command, with ``--alg``, seed, rounds and epochs given."""
    return ["main.py", "--dataset=cifar10", "--model=simple-cnn", f"--alg={alg}", "--lr=0.01",
            "--mu=5", f"--epochs={epochs}", f"--comm_round={rounds}", "--n_parties=10",
            "--partition=noniid", "--beta=0.5", f"--logdir={workdir / 'logs'}",
            f"--datadir={workdir / 'data'}", f"--modeldir={workdir / 'models'}",
            f"--init_seed={seed}", "--device=cpu", f"--log_file_name=seed{seed}"]


class _Metrics(logging.Handler):
    """Each round's global test accuracy, with the seconds since the run started."""

    def __init__(self, path: Path):
        super().__init__()
        self.path, self.t0, self.round, self.start = path, time.time(), -1, time.time()
        self.eval_s = 0.0  # this round's seconds in the global model's evaluations

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("in comm round:"):
            self.round, self.start, self.eval_s = int(message.split(":")[1]), time.time(), 0.0
        elif message.startswith(">> Global Model Test accuracy:"):
            row = {"round": self.round + 1, "test_accuracy": float(message.split(":")[1]),
                   "round_s": round(time.time() - self.start, 2),
                   "global_eval_s": round(self.eval_s, 2),
                   "elapsed_s": round(time.time() - self.t0, 2)}
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")


def install(checkout: Path, data: dict, seed: int, metrics: Path, skip_client_evals: bool):
    """Applies the changes listed in the module docstring; returns their ``main.py``'s path."""
    import torch

    record = _Metrics(metrics)

    sys.path.insert(0, str(checkout))
    torch.Tensor.cuda = lambda self, *a, **k: self  # 3. no GPU: stay on the CPU
    torch.nn.Module.cuda = lambda self, *a, **k: self
    import datasets  # their modules
    import utils

    class OurCIFAR10:  # 1. our decoded images in torchvision's CIFAR10 form
        def __init__(self, root, train=True, transform=None, target_transform=None,
                     download=False):
            split = "train" if train else "test"
            self.data = data[f"{split}_images"]
            self.targets = data[f"{split}_labels"].astype(np.int64).tolist()

    datasets.CIFAR10 = OurCIFAR10
    sizes = data[f"split_s{seed}_sizes"]
    flat = data[f"split_s{seed}"]
    ours = dict(enumerate(np.split(flat, np.cumsum(sizes)[:-1])))

    def partition_data(dataset, datadir, logdir, partition, n_parties, beta=0.4):  # 2.
        assert dataset == "cifar10" and n_parties == len(ours), (dataset, n_parties)
        X_train, y_train, X_test, y_test = utils.load_cifar10_data(datadir)
        counts = utils.record_net_data_stats(y_train, ours, logdir)
        return X_train, y_train, X_test, y_test, ours, counts

    utils.partition_data = partition_data
    compute_accuracy = utils.compute_accuracy
    local = {"train_net", "train_net_fedprox", "train_net_fedcon", "train_net_scaffold"}

    def on_the_cpu(model, dataloader, get_confusion_matrix=False, device="cpu", **kwargs):
        client = sys._getframe(1).f_code.co_name in local
        if skip_client_evals and client:  # 5.
            return (0.0, None, 0.0) if get_confusion_matrix else (0.0, 0.0)
        start = time.time()
        out = compute_accuracy(model, dataloader, get_confusion_matrix, device="cpu", **kwargs)
        if not client:
            record.eval_s += time.time() - start
        return out

    utils.compute_accuracy = on_the_cpu  # 3.
    basic_config = logging.basicConfig

    def with_metrics(**kwargs):  # 4. their handlers, then ours beside them
        basic_config(**kwargs)
        logging.getLogger().addHandler(record)

    logging.basicConfig = with_metrics
    return checkout / "main.py"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", type=Path,
                        default=Path(os.environ.get("AUTHORS_MOON", "QinbinLi-MOON")))
    parser.add_argument("--data", type=Path, required=True, help="export.py's .npz")
    parser.add_argument("--alg", choices=["fedavg", "moon", "fedprox"], default="moon")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--skip-client-evals", action="store_true")
    args = parser.parse_args(argv)
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    metrics = args.workdir / "metrics.jsonl"
    if metrics.exists():
        sys.exit(f"{metrics} exists: their code has no exact resume; use a new --workdir")
    with np.load(args.data) as f:
        data = {k: f[k] for k in f.files}
    main_py = install(args.checkout.resolve(), data, args.seed, metrics, args.skip_client_evals)
    sys.argv = paper_argv(args.alg, args.seed, args.rounds, args.epochs, args.workdir)
    (args.workdir / "command.json").write_text(json.dumps(
        {"harness": sys.orig_argv, "their_argv": sys.argv}, indent=1) + "\n")
    os.chdir(args.checkout)
    runpy.run_path(str(main_py), run_name="__main__")


if __name__ == "__main__":
    main()

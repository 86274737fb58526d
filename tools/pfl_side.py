"""pfl 0.6.0's side of ``tools/bench_pfl.py``: its simulation of pfl-research's CIFAR-10
benchmark workload (PyTorch backend, CPU), run in pfl's own interpreter as a worker that the
benchmark drives line by line on stdin/stdout (``train N`` -> per-round seconds; ``eval`` ->
seconds of one central evaluation), so that pfl and this project alternate in one run.

    /tmp/pflvenv/bin/python tools/pfl_side.py     # then type: train 3 / eval
    (pip install pfl==0.6.0 torch==2.13.0 in that venv)

The workload as pfl's ``benchmarks/image_classification`` baseline configures it for
``cifar10_iid``, ``simple_cnn``, ``fedavg``, no DP: synthetic CIFAR-10-shaped data (speed
only) of 1000 clients x 50 images, cohort 50, 1 local epoch at batch 10 (5 SGD steps, lr 0.1),
central SGD lr 1.0, users weighted equally, pfl's ``simple_cnn`` (conv3x3 32, conv3x3 64,
max-pool, dropout .25, dense 128, dropout .5, dense 10; 'valid' convolutions, 1,626,442
parameters, NHWC input transposed inside the model as pfl's ``Transpose2D``), central evaluation
of 10,000 test images at batch 500.

Timing: ``FederatedAlgorithm.run`` runs all its rounds internally, so each ``train N`` runs it
for N more central iterations (pfl resumes from its iteration counter) and a callback placed
last timestamps ``after_central_iteration``: a round covers pfl's context creation, sampling,
the 50 local updates with model-difference extraction, postprocessors, aggregation and the
central step. pfl would also evaluate every trained client in iterations that are multiples of
``evaluation_frequency`` (iteration 0 always is): the worker sets that frequency out of reach
and starts pfl's counter at 1 through its checkpoint-restore API, since the workload asks for
central evaluation only.

Several processes (pfl's guide to fast simulations: on one GPU, 1 to 5 processes sharing it
train the cohort's users between them): ``tools/bench_pfl.py --pfl-workers N`` starts N of
these workers with pfl's own ``PFL_WORKER_ADDRESSES`` / ``PFL_WORKER_RANK`` and sends each
the same commands; pfl then splits every cohort across them and all-reduces the model updates
(``torch.distributed``: NCCL where CUDA is available, else gloo). ``PFL_BENCH_DIST_BACKEND=gloo``
makes the workers use gloo on a GPU too, for a GPU where NCCL refuses several processes on
one device; that is this benchmark's change to pfl, named in its results.
"""
# ruff: noqa: E402 - pfl's imports follow the backend patch, which must precede them
import json
import os
import sys
import tempfile
import time

os.environ.setdefault('PFL_PYTORCH_DEVICE', 'cpu')

import numpy as np
import torch
import torch.distributed


def _force_backend(backend: str) -> None:
    """Makes pfl's ``init_process_group`` use ``backend`` (pfl picks NCCL whenever CUDA is
    available and offers no setting); before pfl is imported, which creates its context."""
    init = torch.distributed.init_process_group

    def init_process_group(*args, **kwargs):
        kwargs.pop("backend", None)
        return init(*args[1:], backend=backend, **kwargs)

    torch.distributed.init_process_group = init_process_group


if os.environ.get("PFL_BENCH_DIST_BACKEND"):
    _force_backend(os.environ["PFL_BENCH_DIST_BACKEND"])

import torch.nn as nn
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByUser
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.internal.ops.common_ops import all_reduce_metrics
from pfl.internal.ops.pytorch_ops import to_tensor
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel
from pfl.privacy import CentrallyAppliedPrivacyMechanism, NoPrivacy

NUM_CLIENTS = 1000
IMAGES_PER_CLIENT = 50
NUM_TEST = 10_000
COHORT_SIZE = 50
LOCAL_BATCH = 10
LOCAL_EPOCHS = 1
LOCAL_LR = 0.1
CENTRAL_LR = 1.0
EVAL_BATCH = 500
# pfl evaluates every *training* client before and after local training when
# iteration % evaluation_frequency == 0.  The workload asks for central
# evaluation only, so make that condition unreachable (see _skip_iteration_0).
_NO_CLIENT_EVAL = 10**12


class _NHWCToNCHW(nn.Module):
    def forward(self, x):
        return x.permute(0, 3, 1, 2)


class _SimpleCNN(nn.Sequential):
    """pfl benchmarks' simple_cnn for 32x32x3 inputs and 10 classes, with the
    loss/metrics methods PyTorchModel requires."""

    def __init__(self, num_outputs: int = 10):
        flat = ((32 - 4) // 2)**2 * 64
        super().__init__(_NHWCToNCHW(), nn.Conv2d(3, 32, (3, 3)), nn.ReLU(),
                         nn.Conv2d(32, 64, (3, 3)), nn.ReLU(),
                         nn.MaxPool2d((2, 2)), nn.Dropout(0.25), nn.Flatten(),
                         nn.Linear(flat, 128), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(128, num_outputs))
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(m.weight)

    def loss(self, inputs, targets, eval=False):
        self.eval() if eval else self.train()
        return nn.functional.cross_entropy(self(inputs),
                                           targets.squeeze().long())

    @torch.no_grad()
    def metrics(self, inputs, targets, eval=True):
        self.eval() if eval else self.train()
        logits = self(inputs)
        targets = targets.squeeze().long()
        n = len(inputs)
        correct = (logits.argmax(-1) == targets).float().sum().item()
        loss = nn.functional.cross_entropy(logits, targets,
                                           reduction='sum').item()
        return {'loss': Weighted(loss, n), 'accuracy': Weighted(correct, n)}


class _CentralEval(CentralEvaluationCallback):
    """pfl's CentralEvaluationCallback, minus the evaluation it does in
    on_train_begin (that would run once per run() call), plus timing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds = []  # (round_number, seconds)

    def on_train_begin(self, *, model):
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *,
                                central_iteration):
        t0 = time.perf_counter()
        out = super().after_central_iteration(
            aggregate_metrics, model, central_iteration=central_iteration)
        if len(out[1]) > 0:
            self.seconds.append(
                (central_iteration, time.perf_counter() - t0))
        return out


class _RoundTimer(TrainingProcessCallback):

    def __init__(self):
        self.stamps: list[float] = []

    def on_train_begin(self, *, model):
        self.stamps = [time.perf_counter()]
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *,
                                central_iteration):
        self.stamps.append(time.perf_counter())
        return False, Metrics()

    def round_seconds(self):
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


def _skip_iteration_0(algorithm):
    # Iteration 0 always satisfies `iteration % evaluation_frequency == 0`, so
    # pfl would evaluate each of the 50 trained clients before and after local
    # training in that round.  Start pfl's iteration counter at 1 through its
    # public checkpoint-restore API (FederatedAlgorithm.load) to avoid that.
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, 'algorithm_checkpoint.json'), 'w') as f:
            json.dump({'current_central_iteration': 1}, f)
        algorithm.load(d)


def make_pfl_runner(eval_every: int | None = None):
    """Builds pfl's simulation once; returns run(num_rounds) -> list of
    per-round wall seconds (training rounds).

    With eval_every=None no central evaluation happens inside run().  With
    eval_every=N, pfl's CentralEvaluationCallback evaluates the 10,000 test
    images (batch 500) after every N-th round (global round count, starting at
    1); that evaluation time is INCLUDED in the per-round seconds of those
    rounds and also listed in run.eval_seconds as (round_number, seconds).

    Extra attributes: run.central_eval() -> (seconds, metrics dict) times one
    standalone central evaluation; run.num_params; run.model (PyTorchModel).
    """
    # PFL_BENCH_THREADS: torch's intra-op threads (default: every core, as pfl runs).
    torch.set_num_threads(int(os.environ.get("PFL_BENCH_THREADS", 0)) or os.cpu_count() or 1)
    torch.manual_seed(0)
    np.random.seed(0)  # noqa: NPY002 -- pfl's user sampler draws from NumPy's global state

    rng = np.random.default_rng(0)
    n_train = NUM_CLIENTS * IMAGES_PER_CLIENT
    train_x = rng.standard_normal((n_train, 32, 32, 3), dtype=np.float32)
    train_y = rng.integers(0, 10, size=n_train, dtype=np.int64)
    test_x = rng.standard_normal((NUM_TEST, 32, 32, 3), dtype=np.float32)
    test_y = rng.integers(0, 10, size=NUM_TEST, dtype=np.int64)

    # As pfl's benchmark: user data converted to torch tensors up front
    # (pfl's to_tensor, which makes labels float32 too), users are
    # contiguous slices, sampled uniformly at random with replacement.
    tx, ty = to_tensor(train_x), to_tensor(train_y)
    users = {
        u: (tx[u * IMAGES_PER_CLIENT:(u + 1) * IMAGES_PER_CLIENT],
            ty[u * IMAGES_PER_CLIENT:(u + 1) * IMAGES_PER_CLIENT])
        for u in range(NUM_CLIENTS)
    }
    train_fed = FederatedDataset.from_slices(
        users, get_user_sampler('random', list(users)))
    vx, vy = to_tensor(test_x), to_tensor(test_y)
    n_val_users = NUM_TEST // IMAGES_PER_CLIENT
    val_fed = FederatedDataset.from_slices(  # required, unused (val cohort 0)
        {
            u: (vx[u * IMAGES_PER_CLIENT:(u + 1) * IMAGES_PER_CLIENT],
                vy[u * IMAGES_PER_CLIENT:(u + 1) * IMAGES_PER_CLIENT])
            for u in range(n_val_users)
        }, get_user_sampler('random', list(range(n_val_users))))
    central_data = Dataset(raw_data=[test_x, test_y])

    net = _SimpleCNN(10)
    num_params = sum(p.numel() for p in net.parameters())
    model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(
            [p for p in net.parameters() if p.requires_grad], CENTRAL_LR))

    backend = SimulatedBackend(
        training_data=train_fed,
        val_data=val_fed,
        postprocessors=[
            WeightByUser(),
            NoPrivacy(),
            CentrallyAppliedPrivacyMechanism(NoPrivacy())
        ])
    algorithm = FederatedAveraging()
    _skip_iteration_0(algorithm)

    train_params = NNTrainHyperParams(local_learning_rate=LOCAL_LR,
                                      local_num_epochs=LOCAL_EPOCHS,
                                      local_batch_size=LOCAL_BATCH)
    eval_params = NNEvalHyperParams(local_batch_size=EVAL_BATCH)
    eval_cb = None
    if eval_every:
        eval_cb = _CentralEval(central_data,
                               model_eval_params=eval_params,
                               frequency=eval_every)
    state = {'next_iteration': 1}

    def run(num_rounds: int) -> list[float]:
        timer = _RoundTimer()
        callbacks = ([eval_cb] if eval_cb else []) + [timer]
        params = NNAlgorithmParams(
            central_num_iterations=state['next_iteration'] + num_rounds,
            evaluation_frequency=_NO_CLIENT_EVAL,
            train_cohort_size=COHORT_SIZE,
            val_cohort_size=0)
        algorithm.run(algorithm_params=params,
                      backend=backend,
                      model=model,
                      model_train_params=train_params,
                      model_eval_params=eval_params,
                      callbacks=callbacks,
                      send_metrics_to_platform=False)  # no stdout dump/round
        state['next_iteration'] += num_rounds
        secs = timer.round_seconds()
        assert len(secs) == num_rounds, (len(secs), num_rounds)
        return secs

    central_part = central_data.get_worker_partition()

    def central_eval():
        # As pfl's CentralEvaluationCallback by default: each worker evaluates its share of
        # the central data, then the metrics are all-reduced (one worker: all of it).
        t0 = time.perf_counter()
        m = all_reduce_metrics(model.evaluate(central_part, eval_params=eval_params))
        dt = time.perf_counter() - t0
        return dt, m.to_simple_dict()

    run.eval_seconds = eval_cb.seconds if eval_cb else []
    run.central_eval = central_eval
    run.num_params = num_params
    run.model = model
    return run



def main() -> None:
    import pfl

    run = make_pfl_runner()
    dist = torch.distributed.is_initialized()
    print(json.dumps({"pfl": pfl.__version__, "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "parameters": run.num_params,
                      "rank": torch.distributed.get_rank() if dist else 0,
                      "world_size": torch.distributed.get_world_size() if dist else 1,
                      "backend": torch.distributed.get_backend() if dist else None,
                      "device": str(next(run.model._model.parameters()).device)}),
          flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["train"]:
            print(json.dumps({"round_seconds": run(int(command[1]))}), flush=True)
        elif command[:1] == ["eval"]:
            print(json.dumps({"seconds": run.central_eval()[0]}), flush=True)


if __name__ == "__main__":
    main()

"""Does the FedRCL authors' mixed precision change what local training does?

The authors' code trains with ``use_amp: True``: each client runs its forward and loss under
``torch.cuda.amp.autocast`` (float16), builds a fresh ``GradScaler()`` every round (initial scale
2**16) and steps with ``scale(loss).backward(); unscale_(opt); clip_grad_norm_(params, 10);
step(opt); update()``, so a step whose gradients hold an inf/NaN is skipped and the scale halved.
We train in float32 and never skip. This probe runs four arms of the same small federation from
the same initial weights, client sample, shuffles and augmentations -- FedAvg and FedRCL, each in
float32 and with the authors' AMP emulated -- and records:

- per client and round: the skipped steps (count and step indices), the final loss scale, the
  mean loss (and FedRCL's CE / SCL / penalty terms), the pre-clip gradient norm, the largest
  unscaled gradient entry (``65504 / that`` is the largest scale whose weight gradients fit in
  float16), and which parameters held the non-finite gradients of the skipped steps;
- after every round, on 1,000 fixed test images, for the averaged model in float32: accuracy,
  the share of predictions in the most predicted class, and the mean pairwise cosine similarity
  (off-diagonal) of the embedding and of each pooled pre-ReLU level.

AMP emulation. PyTorch 2.13 does support ``torch.autocast("cpu", dtype=torch.float16)``, but its
CPU op lists are not CUDA's (it leaves GroupNorm, normalize, logsumexp, softplus and log_softmax in
float16, which CUDA autocast runs in float32) and float16 convolutions on an AVX2 CPU are ~10x
slower than float32 ones; the probe measures both (``autocast_check`` in the output). The arms
therefore use :class:`CudaAutocast`, a ``TorchFunctionMode`` applying CUDA autocast's rules to
the ops our model and losses call: conv2d / linear / matmul / mm / bmm get float16-rounded inputs
and weights, compute in float32 (as cuDNN / cuBLAS accumulate) and return a float16 tensor;
group_norm, cross_entropy, logsumexp, softplus, log_softmax, softmax, exp, log and normalize
run in float32; every other op runs in its input's dtype, as under CUDA autocast. Autograd then
produces float16 gradients exactly where CUDA would: each float32 <-> float16 cast's backward
rounds the gradient to float16, turning anything past 65504 into inf. The loss scaler is the real
``torch.amp.GradScaler("cpu")`` (init 2**16, growth 2 every 2000 good steps, backoff 0.5), made
fresh per client per round, with ``unscale_`` before clipping as the authors do.

Model and setting: ResNet-10 (one BasicBlock per stage), width 16, GroupNorm(2) -- our CPU-scale
stand-in for the paper's ResNet-18 -- on the CIFAR-10 JPEG archive split over 100 clients by the
reference's balanced Dirichlet(0.3) procedure (drawn anew); 5 clients per round (seeded), 5 local
epochs of batch 50, lr 0.1 * 0.998^(round + epoch), clip 10, weight decay 1e-3, uniform
averaging (``fedjax_rcl.bench.torch_reference`` mirrors our objectives and optimizer). The arms
advance round by round together, so a run cut short by ``--cpu-budget-s`` leaves all arms at the
same round; the JSON is rewritten after every round.

Usage (one thread; 11 CPU minutes for the 5 rounds on a 2-core AVX2 EPYC; results and reading
in ``experiments/amp_probe/README.md``)::

    OMP_NUM_THREADS=1 python experiments/amp_probe/amp_probe.py --cpu-budget-s 1000 \
        --out experiments/amp_probe/amp_probe.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

from fedjax_rcl.bench import torch_reference as tr  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

FP16_MAX = 65504.0
INIT_SCALE = 2.0**16
MODEL_KW = {"stage_sizes": (1, 1, 1, 1), "width": 16}

# CUDA autocast's lists (torch/csrc/autograd/autocast_mode.cpp, the amp docs), restricted to
# the ops our model and objectives call; matched by name, so that functions and Tensor methods
# (``u @ v`` arrives as ``Tensor.matmul``) are both caught.
_LOWER = {"conv2d", "linear", "matmul", "__matmul__", "mm", "bmm"}
_FP32 = {"group_norm", "cross_entropy", "logsumexp", "softplus", "log_softmax", "softmax", "exp",
         "log", "normalize", "norm"}


def _func_name(func) -> str:
    return getattr(func, "__name__", None) or repr(func)


class CudaAutocast(TorchFunctionMode):
    """CUDA float16 autocast emulated on the CPU with float32 kernels (see module docstring).

    ``record`` counts, per op name, the dtype of the op's first floating output (set it to a
    Counter to trace; None to skip the bookkeeping)."""

    def __init__(self):
        super().__init__()
        self.record: Counter | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _func_name(func)
        if name in _LOWER:
            def to_half(t):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    return t.half().float()  # float16 storage, float32 arithmetic
                return t
            args, kwargs = tree_map(to_half, (args, kwargs))
            out = func(*args, **kwargs).half()
        elif name in _FP32:
            def to_float(t):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float16:
                    return t.float()
                return t
            args, kwargs = tree_map(to_float, (args, kwargs))
            out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if self.record is not None:
            first = out[0] if isinstance(out, tuple | list) and out else out
            if isinstance(first, torch.Tensor) and first.is_floating_point():
                self.record[f"{name}:{str(first.dtype).removeprefix('torch.')}"] += 1
        return out


# --------------------------------------------------------------------------------------------
# The CPU autocast check.
# --------------------------------------------------------------------------------------------


def autocast_check() -> dict:
    """What ``torch.autocast("cpu", float16)`` does to our ops, how fast CPU float16 convs are,
    and how close :class:`CudaAutocast`'s convolution is to a native float16 one."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 16, 32, 32, generator=gen).to(memory_format=torch.channels_last)
    w = torch.randn(16, 16, 3, 3, generator=gen) * 0.1
    gn = torch.nn.GroupNorm(2, 16)
    lin = torch.nn.Linear(16, 10)
    y = torch.zeros(50, dtype=torch.long)
    dtypes = {}
    with torch.autocast("cpu", dtype=torch.float16):
        c = F.conv2d(x, w, padding=1)
        g = gn(c)
        e = g.mean((2, 3))
        logits = lin(e)
        u = F.normalize(e, dim=-1)
        s = u @ u.T
        for name, v in [("conv2d", c), ("group_norm", g), ("mean", e), ("linear", logits),
                        ("normalize", u), ("matmul", s), ("mm", torch.mm(u, u.T)),
                        ("logsumexp", torch.logsumexp(s / 0.05, -1)),
                        ("softplus", F.softplus(s)), ("log_softmax", F.log_softmax(s, -1)),
                        ("cross_entropy", F.cross_entropy(logits, y))]:
            dtypes[name] = str(v.dtype).removeprefix("torch.")

    def ms(fn, n):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return 1e3 * (time.perf_counter() - t0) / n

    w32 = w.clone().requires_grad_()
    w16 = w.half().requires_grad_()
    x16 = x.half()
    fp32_ms = ms(lambda: F.conv2d(x, w32, padding=1).sum().backward(), 5)
    fp16_ms = ms(lambda: F.conv2d(x16, w16, padding=1).float().sum().backward(), 2)
    with torch.no_grad():
        native = F.conv2d(x16, w.half(), padding=1).float()
        with CudaAutocast():
            emulated = F.conv2d(x, w, padding=1)
        emulated = emulated.float()
    rel = float((native - emulated).abs().max() / native.abs().max())
    return {
        "cpu_autocast_fp16_available": bool(torch.amp.autocast_mode.is_autocast_available("cpu")),
        "cpu_autocast_output_dtypes": dtypes,
        "cuda_autocast_would_give": {
            "conv2d": "float16", "group_norm": "float32", "mean": "input dtype",
            "linear": "float16", "normalize": "float32", "matmul": "float16", "mm": "float16",
            "logsumexp": "float32", "softplus": "float32", "log_softmax": "float32",
            "cross_entropy": "float32"},
        "conv16x16_b50_32x32_fwd_bwd_ms": {"float32": fp32_ms, "native_float16": fp16_ms},
        "emulated_vs_native_fp16_conv_max_rel_diff": rel,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


# --------------------------------------------------------------------------------------------
# The federation with the authors' AMP.
# --------------------------------------------------------------------------------------------


class ProbeFederation(tr.TorchFederation):
    """``TorchFederation`` with optional emulated AMP and per-step bookkeeping."""

    def __init__(self, *args, amp: bool, **kwargs):
        super().__init__(*args, **kwargs)
        if self.objective.algorithm not in ("fedavg", "fedrcl"):
            raise ValueError("the probe runs FedAvg and FedRCL")
        self.amp = amp
        self.autocast = CudaAutocast() if amp else None
        self.scaler = None
        self.steps: list[dict] = []
        self.param_names = [n for n, _ in self.local_model.named_parameters()]
        self.nonfinite_params: Counter = Counter()

    def train_step(self, x, labels, lr: float) -> dict:
        """The authors' step: (autocast) forward + loss, scaled backward, unscale, clip 10, step,
        update; the float32 arm is the same without autocast and scaler."""
        if self.amp:
            with self.autocast:
                out = self.local_model(x, features=self.objective.needs_features)
                loss, terms = self.objective(out, labels)
        else:
            out = self.local_model(x, features=self.objective.needs_features)
            loss, terms = self.objective(out, labels)
        self.optimizer.zero_grad(set_to_none=True)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.amp:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
        else:
            loss.backward()
        grads = [q.grad for q in self.local_params]
        gmax = float(torch.stack(torch._foreach_norm(grads, math.inf)).max())
        norm = float(torch.nn.utils.clip_grad_norm_(self.local_params, self.clip_norm,
                                                    foreach=True))
        if self.amp:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < before  # growth needs 2000 good steps
        else:
            self.optimizer.step()
            skipped = False
        if skipped:
            self.nonfinite_params.update(n for n, g in zip(self.param_names, grads, strict=True)
                                         if not bool(torch.isfinite(g).all()))
        self.steps.append({"loss": float(loss.detach()), "skipped": skipped, "grad_norm": norm,
                           "grad_max": gmax,
                           **{k: float(v) for k, v in terms.items()}})
        return {"loss": loss.detach()}

    def local_update(self, client: int, round_index: int, *, max_steps: int | None = None):
        """One client's round (a fresh GradScaler, as the authors' ``local_train``); returns the
        client's record."""
        self.steps = []
        if self.amp:
            self.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_factor=2.0,
                                               backoff_factor=0.5, growth_interval=2000)
        super().local_update(client, round_index, max_steps=max_steps)
        steps = self.steps
        finite_norms = [s["grad_norm"] for s in steps if math.isfinite(s["grad_norm"])]
        finite_max = [s["grad_max"] for s in steps if math.isfinite(s["grad_max"])]
        record = {
            "client": int(client),
            "steps": len(steps),
            "skipped": sum(s["skipped"] for s in steps),
            "skipped_steps": [i for i, s in enumerate(steps) if s["skipped"]],
            "final_scale": self.scaler.get_scale() if self.amp else None,
            "loss": float(np.mean([s["loss"] for s in steps])),
            "loss_first": steps[0]["loss"],
            "loss_last": steps[-1]["loss"],
            "grad_norm_median": float(np.median(finite_norms)) if finite_norms else None,
            "grad_norm_max": max(finite_norms) if finite_norms else None,
            "clipped_steps": sum(n > self.clip_norm for n in finite_norms),
            "grad_max_max": max(finite_max) if finite_max else None,
        }
        for term in ("ce", "scl", "penalty"):
            if term in steps[0]:
                record[term] = float(np.mean([s[term] for s in steps]))
        self.last_record = record
        return record["loss"]


def evaluate(model, images, labels, mean, std, *, batch: int = 500) -> dict:
    """The averaged model in float32 on fixed test images: accuracy, collapse indicators."""
    model.eval()
    logits, emb, levels = [], [], []
    with torch.no_grad():
        for start in range(0, len(labels), batch):
            out = model(tr.normalize(images[start:start + batch], mean, std), features=True)
            logits.append(out.logits)
            emb.append(out.embedding)
            levels.append(out.features)
    logits = torch.cat(logits)
    pred = logits.argmax(-1)
    counts = torch.bincount(pred, minlength=logits.shape[1])

    def mean_cos(f):
        u = tr.l2_normalize(f)
        n = u.shape[0]
        s = u @ u.T
        return float((s.sum() - s.diagonal().sum()) / (n * (n - 1)))

    level_feats = [torch.cat([lv[i] for lv in levels]) for i in range(len(levels[0]))]
    return {
        "accuracy": float((pred == labels).float().mean()),
        "loss": float(F.cross_entropy(logits, labels)),
        "top_class": int(counts.argmax()),
        "top_class_fraction": float(counts.max()) / len(labels),
        "predicted_classes": int((counts > 0).sum()),
        "cos_embedding": mean_cos(torch.cat(emb)),
        "cos_levels": [mean_cos(f) for f in level_feats],
        "finite": bool(torch.isfinite(logits).all()),
    }


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next(line for line in text.splitlines() if line.startswith("flags")).split()
        model = next(line for line in text.splitlines() if line.startswith("model name"))
        info["cpu"] = model.split(":", 1)[1].strip()
        info["avx2"] = "avx2" in flags
        info["avx512"] = sorted(f for f in flags if f.startswith("avx512"))
    except (OSError, StopIteration):
        pass
    return info


ARMS = {"fedavg_fp32": ("fedavg", False), "fedavg_amp": ("fedavg", True),
        "fedrcl_fp32": ("fedrcl", False), "fedrcl_amp": ("fedrcl", True)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="imagefolder:" + os.environ.get(
        "CIFAR10_JPEG_ZIP", "data/cifar10-jpeg.zip"))
    p.add_argument("--out", default=str(ROOT / "experiments/amp_probe/amp_probe.json"))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-clients", type=int, default=100)
    p.add_argument("--clients-per-round", type=int, default=5)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--test-images", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-budget-s", type=float, default=1100.0,
                   help="stop before a round that would take the process past this CPU time")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cpu0, wall0 = time.process_time(), time.perf_counter()

    from fedjax_rcl.data import load_dataset, partition

    ds = load_dataset(a.dataset)
    train_images = np.array(ds.train_images)  # writable: the federations share it, no copy
    train_labels = np.asarray(ds.train_labels)
    clients = partition(train_labels, a.num_clients, method="dirichlet", seed=a.seed,
                        alpha=a.alpha, balanced=True)
    rng = np.random.default_rng(a.seed)
    sampled = [sorted(rng.choice(a.num_clients, a.clients_per_round, replace=False).tolist())
               for _ in range(a.rounds)]
    test_idx = np.sort(np.random.default_rng(a.seed + 1).choice(len(ds.test_labels),
                                                                 a.test_images, replace=False))
    test_images = torch.from_numpy(np.array(ds.test_images[test_idx]))
    test_labels = torch.from_numpy(np.asarray(ds.test_labels)[test_idx].astype(np.int64))
    mean = torch.tensor(ds.mean, dtype=torch.float32)
    std = torch.tensor(ds.std, dtype=torch.float32)
    num_classes = len(ds.class_names)

    result = {
        "command": "OMP_NUM_THREADS=1 python experiments/amp_probe/amp_probe.py "
                   + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "config": {**vars(a), "model": "resnet10 width 16 GroupNorm(2)", "model_kwargs": MODEL_KW,
                   "lr": 0.1, "lr_decay": 0.998, "clip_norm": 10.0, "weight_decay": 1e-3,
                   "init_scale": INIT_SCALE, "sampled_clients": sampled,
                   "test_indices_seed": a.seed + 1, "mean": list(ds.mean), "std": list(ds.std)},
        "autocast_check": autocast_check(),
    }
    torch.manual_seed(a.seed)
    init = tr.build_model("resnet18", num_classes=num_classes, **MODEL_KW).state_dict()
    feds = {}
    for name in a.arms:
        algorithm, amp = ARMS[name]
        fed = ProbeFederation("resnet18", algorithm, images=train_images, labels=train_labels,
                              client_indices=clients, num_classes=num_classes, mean=ds.mean,
                              std=ds.std, batch=a.batch, epochs=a.epochs,
                              hflip=bool(ds.hflip), seed=a.seed, model_kwargs=MODEL_KW, amp=amp)
        fed.global_model.load_state_dict(init)
        feds[name] = fed
    first = feds[a.arms[0]]
    result["initial_eval"] = evaluate(first.global_model, test_images, test_labels, mean, std)
    result["arms"] = {name: {"rounds": []} for name in a.arms}
    result["rounds_completed"] = 0
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    # Trace the emulated dtypes of one FedRCL AMP step (the richest op mix).
    traced = next((f for f in feds.values() if f.amp and f.objective.needs_features), None)
    if traced is not None:
        traced.autocast.record = Counter()

    round_cpu = []
    for r in range(a.rounds):
        spent = time.process_time() - cpu0
        if round_cpu and spent + max(round_cpu) > a.cpu_budget_s:
            result["stopped_early"] = (f"CPU budget: {spent:.0f} s spent, a round takes "
                                       f"~{max(round_cpu):.0f} s")
            break
        c0 = time.process_time()
        for name, fed in feds.items():
            t0 = time.perf_counter()
            total = [torch.zeros_like(q) for q in fed.global_params]
            records = []
            for k in sampled[r]:
                fed.local_update(k, r)
                records.append(fed.last_record)
                if fed.autocast is not None and fed.autocast.record is not None:
                    result["emulated_op_dtypes"] = dict(sorted(fed.autocast.record.items()))
                    fed.autocast.record = None
                with torch.no_grad():
                    torch._foreach_add_(total, fed.local_params)
            with torch.no_grad():
                torch._foreach_mul_(total, 1.0 / len(records))
            fed._copy(fed.global_params, total)
            ev = evaluate(fed.global_model, test_images, test_labels, mean, std)
            result["arms"][name]["rounds"].append({
                "round": r, "clients": records, "eval": ev,
                "seconds": time.perf_counter() - t0})
            result["arms"][name]["nonfinite_grad_params"] = dict(fed.nonfinite_params)
            print(f"round {r} {name:12s} acc {ev['accuracy']:.3f} "
                  f"top {ev['top_class_fraction']:.2f} cos_emb {ev['cos_embedding']:.3f} skipped "
                  f"{[c['skipped'] for c in records]} loss "
                  f"{np.mean([c['loss'] for c in records]):.3f}", flush=True)
        round_cpu.append(time.process_time() - c0)
        result["rounds_completed"] = r + 1
        result["cpu_s"] = time.process_time() - cpu0
        result["wall_s"] = time.perf_counter() - wall0
        result["round_cpu_s"] = round_cpu
        out_path.write_text(json.dumps(result, indent=1))
    result["cpu_s"] = time.process_time() - cpu0
    result["wall_s"] = time.perf_counter() - wall0
    out_path.write_text(json.dumps(result, indent=1))
    print(f"wrote {out_path} ({result['rounds_completed']} rounds, {result['cpu_s']:.0f} CPU s)")


if __name__ == "__main__":
    main()

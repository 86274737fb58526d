"""A lean PyTorch eager implementation of our client update, for a speed comparison.

``tools/bench_round.py`` compares our compiled JAX round (every sampled client trained side by
side in one program) with the same work done the way a PyTorch user would: eagerly, client after
client. For the comparison to mean anything both sides must compute the same thing, so this
module mirrors ``fedjax_rcl`` operation for operation and ``tests/test_torch_reference.py``
checks it against our code on identical weights and inputs:

- models (``models/cnn.py``, ``models/resnet.py``): MOON's small CNN and the CIFAR ResNet-18 with
  GroupNorm(2, C, eps 1e-5), bias-free convolutions padded symmetrically, each returning logits,
  the pre-ReLU multi-level features pooled to ``[B, C]``, the embedding and optionally MOON's
  projection head (Linear(D, D) - ReLU - Linear(D, 256));
- data (``engine/client.py``, ``data/augment.py``): each step gathers its batch by index from the
  uint8 NHWC training set and augments it with the same composed inverse coordinate map (rotation
  +-10 degrees nearest/zero-fill, 4-pixel padded crop, horizontal flip), all in one gather, then
  normalizes;
- objectives (``algorithms/``, ``losses/``): FedAvg = cross-entropy; FedRCL = CE + mean over the
  levels of (hard-mined SCL + penalty); MOON = CE + mu * model-contrastive loss with the global
  and previous-local projections computed without gradient;
- optimizer (``engine/client.client_optimizer``): global-norm clipping at 10, then PyTorch SGD's
  coupled weight decay 1e-3, momentum 0, lr ``0.1 * 0.998 ** (round + epoch)``;
- round: every client starts from the global model, runs E epochs over a fresh shuffle of its
  indices per epoch, and the round averages the client models uniformly.

Only what counts is built: FedAvg and MOON skip the feature pooling they never read, FedRCL runs
no frozen global-model forward (the authors' reference does one and never uses it), and the
per-level contrastive losses are batched into one ``[L, B, B]`` computation to spare eager
dispatch. Models run in ``channels_last`` memory format: on a 2-core CPU it is PyTorch's fastest
layout for the ResNet (BENCHMARKS.md), and an NHWC batch permuted to NCHW *is*
channels_last, so the augmentation output needs no copy.

Usage::

    from fedjax_rcl.bench.torch_reference import round_seconds, eval_seconds
    round_seconds("resnet18", "fedrcl", clients=5, steps=5, epochs=1, data=dataset, repeats=1)
    eval_seconds("cnn", data=dataset)

    python -m fedjax_rcl.bench.torch_reference --model cnn --algorithm fedrcl --steps 10 --epochs 1

``data`` is a ``fedjax_rcl.data.ImageDataset`` or anything with its ``train_images``,
``train_labels`` (and, for evaluation, ``test_images``, ``test_labels``) attributes or keys; its
``mean``, ``std``, ``hflip`` and ``class_names`` are used when present. It needs PyTorch
(``pip install 'fedjax-rcl[bench]'``). Its computation imports nothing of the simulator, so
that it stays an independent implementation of the same work; only the GFLOP/s it reports,
once the timing is done, count FLOPs with ``fedjax_rcl.bench.flops`` (our model's traced
program, the same count as every other benchmark row).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

try:  # PyTorch is an optional, benchmark-only dependency: the module imports without it.
    import torch
    import torch.nn.functional as F
    from torch import nn

    _Module = nn.Module
except ImportError:  # pragma: no cover - exercised only where torch is absent
    torch = None
    F = None
    nn = None
    _Module = object

MODELS = ("cnn", "resnet18")
ALGORITHMS = ("fedavg", "fedrcl", "moon")
# CIFAR-10's constants: the default when ``data`` names none.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)
# Our losses' sentinels (``fedjax_rcl/losses/contrastive.py``): far outside [-1, 1], finite.
_SIM_SENTINEL = 1e4
_NORM_EPS = 1e-12
_NUM_HARD_NEGATIVES = 2
_RESNET18_STAGES = (2, 2, 2, 2)


def _require_torch() -> None:
    if torch is None:
        raise ImportError("fedjax_rcl.bench.torch_reference needs PyTorch: "
                          "pip install 'fedjax-rcl[bench]'")


# --------------------------------------------------------------------------------------------
# Models.
# --------------------------------------------------------------------------------------------


class TorchOutput(NamedTuple):
    """As ``fedjax_rcl.models.ModelOutput``: logits ``[B, K]``; pre-ReLU levels pooled to
    ``[B, C_l]`` (empty when the caller asked for none); embedding ``[B, D]``; projection
    ``[B, P]`` or None."""

    logits: Any
    features: list
    embedding: Any
    projection: Any = None


class ProjectionHead(_Module):
    """MOON's 2-layer MLP: Linear(D, D) -> ReLU -> Linear(D, P) (``models/base.py``)."""

    def __init__(self, dim: int, out: int = 256):
        super().__init__()
        self.proj1 = nn.Linear(dim, dim)
        self.proj2 = nn.Linear(dim, out)

    def forward(self, h):
        return self.proj2(F.relu(self.proj1(h)))


class SmallCNN(_Module):
    """MOON's ``SimpleCNN`` (``models/cnn.py``): conv5x5(C->6) -> ReLU -> pool2 -> conv5x5(6->16)
    -> ReLU -> pool2 -> flatten -> fc 120 -> ReLU -> fc 84 -> ReLU -> head.

    Levels: both conv outputs and both hidden dense outputs, pre-ReLU. The flatten is PyTorch's
    ``(C, H, W)`` order; :func:`load_flax_params` permutes ``fc1``'s rows from our ``(H, W, C)``.
    """

    def __init__(self, num_classes: int, *, in_channels: int = 3, image_size: int = 32,
                 projection_dim: int | None = None):
        super().__init__()
        side = ((image_size - 4) // 2 - 4) // 2
        self.flatten_shape = (16, side, side)
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.head = nn.Linear(84, num_classes)
        self.projection = ProjectionHead(84, projection_dim) if projection_dim else None

    def forward(self, x, *, features: bool = True) -> TorchOutput:
        f1 = self.conv1(x)
        x = F.max_pool2d(F.relu(f1), 2)
        f2 = self.conv2(x)
        x = F.max_pool2d(F.relu(f2), 2).flatten(1)
        f3 = self.fc1(x)
        f4 = self.fc2(F.relu(f3))
        x = F.relu(f4)
        levels = [f1.mean((2, 3)), f2.mean((2, 3)), f3, f4] if features else []
        z = self.projection(x) if self.projection is not None else None
        return TorchOutput(self.head(x), levels, x, z)


def _gn(channels: int):
    return nn.GroupNorm(2, channels, eps=1e-5)


class BasicBlock(_Module):
    """conv3x3 -> GN -> ReLU -> conv3x3 -> GN, plus the (projected) shortcut; returns pre-ReLU."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.norm1 = _gn(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.norm2 = _gn(width)
        self.project = stride != 1 or cin != width
        if self.project:
            self.shortcut_conv = nn.Conv2d(cin, width, 1, stride, bias=False)
            self.shortcut_norm = _gn(width)

    def forward(self, x):
        y = F.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        if self.project:
            x = self.shortcut_norm(self.shortcut_conv(x))
        return x + y


class ResNet18(_Module):
    """CIFAR ResNet-18 with GroupNorm(2, C) (``models/resnet.py``, the reference's
    ``ResNet18_base``): levels = the stem's GN output and each stage's last block output, all
    pre-ReLU; head = global average pool -> Linear(512, classes). Module names follow our Flax
    names (``stem_conv``, ``stage2_block1.shortcut_norm``, ...) so weights copy by name.

    ``stage_sizes`` and ``width`` give the same family as our ``resnet10``/``resnet18(width=)``:
    blocks per stage (``(1, 1, 1, 1)`` is ResNet-10) and the first stage's channels (stages
    ``w/2w/4w/8w``; the stem has ``w``); the defaults are ResNet-18."""

    def __init__(self, num_classes: int, *, in_channels: int = 3,
                 projection_dim: int | None = None,
                 stage_sizes: Sequence[int] = _RESNET18_STAGES, width: int = 64):
        super().__init__()
        widths = tuple(width * 2**s for s in range(len(stage_sizes)))
        self.stem_conv = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.stem_norm = _gn(widths[0])
        cin = widths[0]
        self.block_names = []
        for s, (blocks, width) in enumerate(zip(stage_sizes, widths, strict=True)):
            for b in range(blocks):
                name = f"stage{s + 1}_block{b + 1}"
                setattr(self, name, BasicBlock(cin, width, 2 if (s > 0 and b == 0) else 1))
                self.block_names.append((name, b == blocks - 1))
                cin = width
        self.head = nn.Linear(cin, num_classes)
        self.projection = ProjectionHead(cin, projection_dim) if projection_dim else None

    def forward(self, x, *, features: bool = True) -> TorchOutput:
        x = self.stem_norm(self.stem_conv(x))
        levels = [x.mean((2, 3))] if features else []
        x = F.relu(x)
        for name, last_of_stage in self.block_names:
            x = getattr(self, name)(x)
            if features and last_of_stage:
                levels.append(x.mean((2, 3)))
            x = F.relu(x)
        embedding = x.mean((2, 3))
        z = self.projection(embedding) if self.projection is not None else None
        return TorchOutput(self.head(embedding), levels, embedding, z)


def build_model(model_name: str, *, num_classes: int = 10, in_channels: int = 3,
                image_size: int = 32, projection_dim: int | None = None,
                stage_sizes: Sequence[int] = _RESNET18_STAGES, width: int = 64):
    """A torch model by our config name, in channels_last memory format.

    ``stage_sizes`` and ``width`` shape the ResNet (see :class:`ResNet18`; ``(1, 1, 1, 1)`` and
    16 are our ``resnet10`` at ``width: 16``); the CNN ignores them.

    channels_last is PyTorch's fastest CPU layout for the ResNet and no slower for the CNN
    (BENCHMARKS.md, "Figures behind the code's choices"), and our NHWC batches permuted to NCHW
    are channels_last already, so inputs need no copy.
    """
    _require_torch()
    if model_name == "cnn":
        model = SmallCNN(num_classes, in_channels=in_channels, image_size=image_size,
                         projection_dim=projection_dim)
    elif model_name == "resnet18":
        model = ResNet18(num_classes, in_channels=in_channels, projection_dim=projection_dim,
                         stage_sizes=stage_sizes, width=width)
    else:
        raise ValueError(f"model={model_name!r}: allowed {MODELS}")
    return model.to(memory_format=torch.channels_last)


def _flatten_tree(tree: Mapping, prefix: tuple = ()) -> dict[tuple, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten_tree(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def flax_to_torch_state(model, flax_params: Mapping) -> dict[str, Any]:
    """Our Flax params as a state dict for ``model`` (a :class:`SmallCNN` or :class:`ResNet18`).

    Layouts: conv kernels HWIO -> OIHW; dense kernels ``[in, out]`` -> ``[out, in]``; GroupNorm
    ``scale`` -> ``weight``; the extra ``gn`` scope of our ``Norm`` wrapper is dropped. The CNN's
    ``fc1`` reads a flatten of NHWC maps in our model and of NCHW maps here, so its input rows are
    permuted from ``(h, w, c)`` to ``(c, h, w)`` order.
    """
    _require_torch()
    state = {}
    for path, value in _flatten_tree(flax_params).items():
        names = [p for p in path[:-1] if p != "gn"]
        leaf = path[-1]
        arr = torch.from_numpy(np.array(value, dtype=np.float32))
        if leaf == "kernel" and arr.ndim == 4:
            arr = arr.permute(3, 2, 0, 1)
        elif leaf == "kernel" and names == ["fc1"] and isinstance(model, SmallCNN):
            c, h, w = model.flatten_shape
            arr = arr.reshape(h, w, c, -1).permute(3, 2, 0, 1).reshape(arr.shape[1], -1)
        elif leaf == "kernel":
            arr = arr.T
        state[".".join(names + ["bias" if leaf == "bias" else "weight"])] = arr.contiguous()
    return state


def load_flax_params(model, flax_params: Mapping):
    """Copies our Flax params into ``model`` in place (strict: every tensor, no leftovers);
    returns the model. ``copy_`` keeps the model's memory format (channels_last stays)."""
    state = flax_to_torch_state(model, flax_params)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"flax params do not fit the torch model: missing {missing}, "
                         f"unexpected {unexpected}")
    return model


# --------------------------------------------------------------------------------------------
# Augmentation: one gather per batch.
# --------------------------------------------------------------------------------------------


class AugmentParams(NamedTuple):
    """Per-sample draws, as ``fedjax_rcl.data.augment.augment_params``: ``angle`` float32
    radians, ``oy``/``ox`` crop offsets in ``0..2p``, ``flip`` bool; each ``[B]``."""

    angle: Any
    oy: Any
    ox: Any
    flip: Any


def draw_augment_params(batch: int, generator, *, max_degrees: float = 10.0,
                        crop_padding: int = 4, hflip: bool = True) -> AugmentParams:
    """Draws a batch's augmentation with ``generator`` (same distributions as ours; the random
    streams differ, which does not matter for the work done)."""
    angle = torch.deg2rad((torch.rand(batch, generator=generator) * 2.0 - 1.0) * max_degrees)
    oy = torch.randint(0, 2 * crop_padding + 1, (batch,), generator=generator)
    ox = torch.randint(0, 2 * crop_padding + 1, (batch,), generator=generator)
    flip = torch.rand(batch, generator=generator) < 0.5
    if not hflip:
        flip = torch.zeros_like(flip)
    return AugmentParams(angle, oy, ox, flip)


def source_index(params: AugmentParams, height: int, width: int, crop_padding: int):
    """The composed inverse map of ``fedjax_rcl.data.augment.source_coordinates``, batched.

    Output pixel ``(y, x)`` of sample ``b`` reads source ``(r, c)``: flip ``x``, shift by the crop
    offset, then rotate back about the image centre and round to nearest (half to even, like
    ``jnp.round``). Same float32 operations in the same order as ours, so the rounded indices are
    the same. Returns ``(rows, cols, valid)``, each ``[B, H, W]``; ``valid`` is False where the
    crop padding or the rotation's outside is read (zero fill).
    """
    y = torch.arange(height).view(1, height, 1)
    x = torch.arange(width).view(1, 1, width)
    xf = torch.where(params.flip.view(-1, 1, 1), width - 1 - x, x)
    u = y + params.oy.view(-1, 1, 1) - crop_padding
    v = xf + params.ox.view(-1, 1, 1) - crop_padding
    in_crop = (u >= 0) & (u < height) & (v >= 0) & (v < width)
    cy, cx = (height - 1) / 2.0, (width - 1) / 2.0
    angle = params.angle.to(torch.float32).view(-1, 1, 1)
    cos, sin = torch.cos(angle), torch.sin(angle)
    du, dv = u.to(torch.float32) - cy, v.to(torch.float32) - cx
    r = torch.round(cos * du + sin * dv + cy).to(torch.int64)
    c = torch.round(-sin * du + cos * dv + cx).to(torch.int64)
    valid = in_crop & (r >= 0) & (r < height) & (c >= 0) & (c < width)
    return r.clamp_(0, height - 1), c.clamp_(0, width - 1), valid


def gather_augmented(images, idx, params: AugmentParams | None, *, crop_padding: int = 4):
    """``uint8 [N, H, W, C]`` training set, ``[B]`` indices -> augmented ``uint8 [B, H, W, C]``.

    Batch gather and augmentation are one ``index_select`` on the set viewed as ``[N*H*W, C]``
    pixels (flat source pixel ``idx_b * H * W + r * W + c``); zero fill is a mask. ``params=None``
    gathers without augmentation.
    """
    n, h, w, ch = images.shape
    b = idx.shape[0]
    if params is None:
        return images.index_select(0, idx)
    rows, cols, valid = source_index(params, h, w, crop_padding)
    flat = (idx.view(-1, 1, 1) * (h * w) + rows * w + cols).view(-1)
    out = images.view(n * h * w, ch).index_select(0, flat).view(b, h, w, ch)
    return out * valid.unsqueeze(-1).to(out.dtype)


def normalize(images, mean, std):
    """``uint8 [B, H, W, C]`` -> ``float32 (x/255 - mean)/std`` laid out NCHW in channels_last
    memory (a free permute of the NHWC result), the same float32 operations as ours."""
    x = (images.to(torch.float32) / 255.0 - mean) / std
    return x.permute(0, 3, 1, 2)


# --------------------------------------------------------------------------------------------
# Objectives.
# --------------------------------------------------------------------------------------------


def l2_normalize(x):
    """``x / max(||x||, 1e-12)``, as ours and ``F.normalize``."""
    return F.normalize(x, dim=-1, eps=_NORM_EPS)


def rcl_terms(levels: Sequence, labels, *, temperature: float = 0.05, threshold: float = 0.7):
    """Hard-mined SCL and penalty of ``fedjax_rcl.losses.rcl_loss_terms`` (``mining="hard"``),
    each averaged over the levels; all levels at once as a ``[L, B, B]`` similarity stack.

    Per level and anchor i: positive ``p_i = min_{y_j = y_i} s_ij`` (i included); negatives =
    the 2 largest other-class ``s_ik`` (missing slots contribute nothing); ``scl_i =
    logsumexp([p_i, negs]/t) - p_i/t``. Penalty: ``m_i = min_{j != i, y_j = y_i} s_ij``; ``q_i =
    m_i`` if i has a classmate and ``m_i >= threshold`` (a selection without gradient) else -1;
    ``pen_i = softplus((q_i - s_ii)/t)``. Means over all anchors, then over levels.

    Returns:
      ``(scl, penalty)`` scalars.
    """
    sims = torch.stack([u @ u.T for u in map(l2_normalize, levels)])  # [L, B, B]
    batch = sims.shape[-1]
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(batch, dtype=torch.bool)
    positive = sims.masked_fill(~same, _SIM_SENTINEL).amin(-1)
    negatives, index = sims.masked_fill(same, -_SIM_SENTINEL).topk(
        min(_NUM_HARD_NEGATIVES, batch), dim=-1)
    valid = torch.gather((~same).expand_as(sims), -1, index)
    logits = torch.cat([positive.unsqueeze(-1), negatives.masked_fill(~valid, -math.inf)], -1)
    logits = logits / temperature
    scl = (torch.logsumexp(logits, -1) - logits[..., 0]).mean()
    classmates = same & ~eye
    least = sims.masked_fill(~classmates, _SIM_SENTINEL).amin(-1)
    gate = classmates.any(-1) & (least >= threshold)  # bool: carries no gradient
    q = torch.where(gate, least, torch.full_like(least, -1.0))
    penalty = F.softplus((q - sims.diagonal(dim1=-2, dim2=-1)) / temperature).mean()
    return scl, penalty


def moon_loss(z, z_global, z_prev, *, temperature: float = 0.5):
    """``fedjax_rcl.losses.moon_loss``: ``mean softplus((cos(z, z_prev) - cos(z, z_global))/t)``,
    the two-way cross-entropy of MOON Eq. 3; the targets carry no gradient."""
    local = l2_normalize(z)
    positive = (local * l2_normalize(z_global.detach())).sum(-1)
    negative = (local * l2_normalize(z_prev.detach())).sum(-1)
    return F.softplus((negative - positive) / temperature).mean()


@dataclasses.dataclass(frozen=True)
class Objective:
    """One algorithm's local objective and its hyperparameters (our defaults)."""

    algorithm: str
    temperature: float = 0.05  # FedRCL
    threshold: float = 0.7
    beta: float = 1.0
    mu: float = 1.0  # MOON
    moon_temperature: float = 0.5

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r}: allowed {ALGORITHMS}")

    @property
    def needs_features(self) -> bool:
        return self.algorithm == "fedrcl"

    def __call__(self, out: TorchOutput, labels, *, z_global=None, z_prev=None):
        """``(loss, {term: value})`` from the local model's output on the batch."""
        ce = F.cross_entropy(out.logits, labels)
        if self.algorithm == "fedavg":
            return ce, {"ce": ce}
        if self.algorithm == "fedrcl":
            scl, penalty = rcl_terms(out.features, labels, temperature=self.temperature,
                                     threshold=self.threshold)
            return ce + scl + self.beta * penalty, {"ce": ce, "scl": scl, "penalty": penalty}
        con = moon_loss(out.projection, z_global, z_prev, temperature=self.moon_temperature)
        return ce + self.mu * con, {"ce": ce, "moon": con}


# --------------------------------------------------------------------------------------------
# Client updates and the round.
# --------------------------------------------------------------------------------------------


def _field(data, name: str, default=None):
    if isinstance(data, Mapping):
        return data.get(name, default)
    return getattr(data, name, default)


def _tensor(array, dtype):
    """A torch tensor sharing the array's memory when it is writable (our datasets' arrays are
    read-only, which torch warns about: those are copied once)."""
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array).to(dtype)


def _minor_faults() -> int:
    """This process's minor page faults so far (``getrusage``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


class TorchFederation:
    """The federation in PyTorch: a global model, per-client index lists, MOON's per-client
    previous models, and the client update run client after client.

    Models are built once (construction is not part of a round's work); each client copies the
    global weights into the one local model, trains it, and adds it to a running sum that becomes
    the uniform mean at the end of the round. ``model_kwargs`` go to :func:`build_model` (e.g.
    the ResNet's ``stage_sizes`` and ``width``).
    """

    def __init__(self, model_name: str, algorithm: str | Objective, *, images, labels,
                 client_indices: Sequence, num_classes: int, mean=CIFAR10_MEAN, std=CIFAR10_STD,
                 batch: int = 50, epochs: int = 5, lr: float = 0.1, lr_decay: float = 0.998,
                 weight_decay: float = 1e-3, clip_norm: float = 10.0, hflip: bool = True,
                 max_degrees: float = 10.0, crop_padding: int = 4, augment: bool = True,
                 projection_dim: int = 256, flax_params: Mapping | None = None, seed: int = 0,
                 model_kwargs: Mapping | None = None, autocast=None):
        _require_torch()
        # Mixed precision as the FedRCL authors train it: the forward pass and the objective
        # under ``torch.autocast`` (here on the CPU, e.g. torch.bfloat16), weights in float32.
        self.autocast = autocast
        self.objective = algorithm if isinstance(algorithm, Objective) else Objective(algorithm)
        self.images = _tensor(images, torch.uint8)
        self.labels = _tensor(labels, torch.int64)
        self.clients = [_tensor(c, torch.int64) for c in client_indices]
        if any(len(c) == 0 for c in self.clients):
            raise ValueError("every client needs at least one sample")
        self.mean = torch.tensor(mean, dtype=torch.float32)
        self.std = torch.tensor(std, dtype=torch.float32)
        self.batch, self.epochs = batch, epochs
        self.lr, self.lr_decay = lr, lr_decay
        self.clip_norm = clip_norm
        self.hflip, self.max_degrees, self.crop_padding = hflip, max_degrees, crop_padding
        self.augment = augment
        self.seed = seed
        moon = self.objective.algorithm == "moon"
        kw = dict(num_classes=num_classes, in_channels=self.images.shape[-1],
                  image_size=self.images.shape[1], projection_dim=projection_dim if moon else None)
        if model_name == "resnet18":
            kw.pop("image_size")
        kw.update(model_kwargs or {})  # e.g. the ResNet's stage_sizes and width
        self.global_model = build_model(model_name, **kw)
        if flax_params is not None:
            load_flax_params(self.global_model, flax_params)
        self.global_model.eval().requires_grad_(False)  # read and overwritten, never trained
        self.local_model = build_model(model_name, **kw)
        self.global_params = list(self.global_model.parameters())
        self.local_params = list(self.local_model.parameters())
        # Momentum 0: SGD keeps no state, so one optimizer serves every client; PyTorch's
        # weight_decay adds lambda * w to the (already clipped) gradient, as our optax chain.
        self.optimizer = torch.optim.SGD(self.local_params, lr=lr, momentum=0.0,
                                         weight_decay=weight_decay, foreach=True)
        self.prev_model = None
        self.prev_state: dict[int, list] = {}
        if moon:
            self.prev_model = build_model(model_name, **kw).eval().requires_grad_(False)
            self.prev_params = list(self.prev_model.parameters())
            # A client that never trained uses the initial global model.
            self.initial_params = [p.detach().clone() for p in self.global_params]

    def _copy(self, dst: list, src: list) -> None:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)

    def client_generator(self, round_index: int, client: int):
        """Shuffles and augmentations depend only on (seed, round, client), as ours."""
        seed = int(np.random.SeedSequence([self.seed, round_index, client]).generate_state(1)[0])
        return torch.Generator().manual_seed(seed)

    def prepare_batch(self, idx, generator):
        """Gathers, augments and normalizes one batch: NCHW float32 in channels_last memory."""
        params = None
        if self.augment:
            params = draw_augment_params(idx.shape[0], generator, max_degrees=self.max_degrees,
                                         crop_padding=self.crop_padding, hflip=self.hflip)
        return normalize(gather_augmented(self.images, idx, params,
                                          crop_padding=self.crop_padding), self.mean, self.std)

    def train_step(self, x, labels, lr: float) -> dict:
        """Forward, objective, backward, clip, SGD step on the local model; returns the terms."""
        z_global = z_prev = None
        if self.prev_model is not None:
            with torch.no_grad():  # MOON's targets: two extra forwards without gradient
                z_global = self.global_model(x, features=False).projection
                z_prev = self.prev_model(x, features=False).projection
        with torch.autocast("cpu", dtype=self.autocast or torch.bfloat16,
                            enabled=self.autocast is not None):
            out = self.local_model(x, features=self.objective.needs_features)
            loss, terms = self.objective(out, labels, z_global=z_global, z_prev=z_prev)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip_norm:
            nn.utils.clip_grad_norm_(self.local_params, self.clip_norm, foreach=True)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return {"loss": loss.detach(), **{k: v.detach() for k, v in terms.items()}}

    def local_update(self, client: int, round_index: int, *, max_steps: int | None = None):
        """One client's local training from the current global model (left in ``local_model``).

        Epoch e uses a fresh permutation of the client's indices and lr ``lr * decay**(round +
        e)``; a final partial batch wraps around to the start of the permutation, as ours.
        Returns the mean loss over the steps run.
        """
        indices = self.clients[client]
        size = indices.shape[0]
        steps_per_epoch = -(-size // self.batch)
        gen = self.client_generator(round_index, client)
        self._copy(self.local_params, self.global_params)
        if self.prev_model is not None:
            self._copy(self.prev_params, self.prev_state.get(client, self.initial_params))
        self.local_model.train()
        losses = []
        for epoch in range(self.epochs):
            if max_steps is not None and len(losses) >= max_steps:
                break
            perm = indices[torch.randperm(size, generator=gen)]
            lr = self.lr * self.lr_decay ** (round_index + epoch)
            for b in range(steps_per_epoch):
                if max_steps is not None and len(losses) >= max_steps:
                    break
                pos = torch.arange(b * self.batch, (b + 1) * self.batch) % size
                idx = perm[pos]
                x = self.prepare_batch(idx, gen)
                losses.append(self.train_step(x, self.labels[idx], lr)["loss"])
        if self.prev_model is not None:
            self.prev_state[client] = [p.detach().clone() for p in self.local_params]
        return float(torch.stack(losses).mean()) if losses else float("nan")

    def run_round(self, round_index: int, clients: Sequence[int] | None = None) -> dict:
        """Trains ``clients`` (default: all) one after another and sets the global model to the
        uniform mean of their models."""
        clients = range(len(self.clients)) if clients is None else clients
        total = [torch.zeros_like(p) for p in self.global_params]
        losses = []
        for k in clients:
            losses.append(self.local_update(k, round_index))
            with torch.no_grad():
                torch._foreach_add_(total, self.local_params)
        with torch.no_grad():
            torch._foreach_mul_(total, 1.0 / len(losses))
        self._copy(self.global_params, total)
        return {"client_losses": losses}


# --------------------------------------------------------------------------------------------
# Timing.
# --------------------------------------------------------------------------------------------


def _num_classes(data, labels) -> int:
    names = _field(data, "class_names")
    return len(names) if names is not None else int(np.max(labels)) + 1


def _norm_constants(data):
    return (tuple(_field(data, "mean", None) or CIFAR10_MEAN),
            tuple(_field(data, "std", None) or CIFAR10_STD))


def round_seconds(model_name: str, algorithm: str, *, clients: int = 5, steps: int = 50,
                  batch: int = 50, data, repeats: int = 3, epochs: int = 5,
                  warmup_steps: int = 2, threads: int | None = 2,
                  flax_params: Mapping | None = None, seed: int = 0, autocast=None) -> dict:
    """Times one federated round done client by client in PyTorch eager.

    Each of ``clients`` clients holds ``steps // epochs * batch`` distinct training samples
    (drawn at random from ``data``) and runs ``epochs`` epochs of ``steps // epochs`` steps, so
    every client does exactly ``steps`` steps of ``batch`` images, as the JAX benchmark's round.
    One-time work (building the models, converting the data) is outside the timing, and so are
    ``warmup_steps`` untimed steps that let PyTorch/oneDNN allocate and pick kernels; each timed
    repeat is one full round, consecutive repeats being consecutive rounds.

    Args:
      model_name: ``"cnn"``, ``"resnet18"`` or ``"resnet10"`` (one BasicBlock per stage).
      algorithm: ``"fedavg" | "fedrcl" | "moon"``.
      clients: clients trained in the round.
      steps: local steps per client (must be a multiple of ``epochs``).
      batch: images per step.
      data: the dataset (see the module docstring).
      repeats: timed rounds; the median is reported.
      epochs: local epochs (lr decays per epoch; indices reshuffle per epoch).
      warmup_steps: untimed steps before timing.
      threads: ``torch.set_num_threads`` (None: leave PyTorch's setting).
      flax_params: optional Flax params to start from (our initial model), else PyTorch's init.
      seed: seeds the client split, shuffles and augmentation.
      autocast: a torch dtype (``torch.bfloat16``) to run the forward pass and objective under
        ``torch.autocast("cpu")``; None: float32.

    Returns:
      A dict: ``round_s`` (median), ``round_s_all``, ``minor_faults_all`` (the process's minor
      page faults in each timed round: memory the allocators got afresh from the kernel),
      ``client_step_ms`` (median round over ``clients * steps``), ``images_per_s``,
      ``step_gflop``, ``gflop_per_s``, ``losses`` (each round's mean client loss, to show
      training happened), settings and versions.
    """
    _require_torch()
    if steps < 1 or epochs < 1 or steps % epochs:
        raise ValueError(f"steps={steps} must be a positive multiple of epochs={epochs}")
    _set_threads(threads)
    images = np.asarray(_field(data, "train_images"))
    labels = np.asarray(_field(data, "train_labels"))
    per_client = steps // epochs * batch
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    order = np.resize(order, clients * per_client)  # wraps only when the set is too small
    parts = [order[k * per_client:(k + 1) * per_client] for k in range(clients)]
    mean, std = _norm_constants(data)
    num_classes = _num_classes(data, labels)
    fed = TorchFederation(model_name, algorithm, images=images, labels=labels,
                          client_indices=parts, num_classes=num_classes, mean=mean, std=std,
                          batch=batch, epochs=epochs, hflip=bool(_field(data, "hflip", True)),
                          flax_params=flax_params, seed=seed, autocast=autocast)
    if warmup_steps:
        fed.local_update(0, 0, max_steps=warmup_steps)
    times, losses, faults = [], [], []
    for r in range(repeats):
        f0 = _minor_faults()
        t0 = time.perf_counter()
        out = fed.run_round(r)
        times.append(time.perf_counter() - t0)
        faults.append(_minor_faults() - f0)
        losses.append(float(np.mean(out["client_losses"])))
    median = statistics.median(times)
    from fedjax_rcl.bench.flops import train_step_flops  # after the timing: it imports JAX

    step_flops = train_step_flops(model_name, algorithm, batch, num_classes=num_classes,
                                  image_size=images.shape[1], in_channels=images.shape[-1])
    return {
        "implementation": "pytorch-eager",
        "model": model_name,
        "algorithm": algorithm,
        "clients": clients,
        "steps": steps,
        "epochs": epochs,
        "batch": batch,
        "round_s": median,
        "round_s_all": times,
        "minor_faults_all": faults,
        "client_step_ms": 1e3 * median / (clients * steps),
        "images_per_s": clients * steps * batch / median,
        "step_gflop": step_flops / 1e9,
        "gflop_per_s": clients * steps * step_flops / median / 1e9,
        "losses": losses,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def eval_seconds(model_name: str, *, data, batch: int = 500, repeats: int = 3,
                 threads: int | None = 2, flax_params: Mapping | None = None) -> dict:
    """Times one evaluation of the model on the full test set, in batches of ``batch`` under
    ``torch.no_grad()`` (normalize, forward, accuracy and cross-entropy), as our
    ``engine/evaluate.py``; the last batch is short here where ours is padded.

    Returns:
      A dict: ``eval_s`` (median), ``eval_s_all``, ``images``, ``images_per_s``,
      ``gflop_per_s``, ``accuracy`` and ``loss`` of the last repeat, settings and versions.
    """
    _require_torch()
    _set_threads(threads)
    images = _tensor(_field(data, "test_images"), torch.uint8)
    labels = _tensor(_field(data, "test_labels"), torch.int64)
    train_labels = _field(data, "train_labels")
    num_classes = _num_classes(data, train_labels if train_labels is not None else labels)
    mean, std = (torch.tensor(c, dtype=torch.float32) for c in _norm_constants(data))
    kw = dict(num_classes=num_classes, in_channels=images.shape[-1])
    if model_name == "cnn":
        kw["image_size"] = images.shape[1]
    model = build_model(model_name, **kw).eval()
    if flax_params is not None:
        load_flax_params(model, flax_params)

    def evaluate():
        correct, loss = 0, 0.0
        with torch.no_grad():
            for start in range(0, len(labels), batch):
                x = normalize(images[start:start + batch], mean, std)
                logits = model(x, features=False).logits
                y = labels[start:start + batch]
                correct += int((logits.argmax(-1) == y).sum())
                loss += float(F.cross_entropy(logits, y, reduction="sum"))
        return correct / len(labels), loss / len(labels)

    evaluate()  # warm-up, untimed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        accuracy, loss = evaluate()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    from fedjax_rcl.bench.flops import forward_flops  # after the timing: it imports JAX

    flops = forward_flops(model_name, num_classes=num_classes, image_size=images.shape[1],
                          in_channels=images.shape[-1])
    return {
        "implementation": "pytorch-eager",
        "model": model_name,
        "batch": batch,
        "eval_s": median,
        "eval_s_all": times,
        "images": len(labels),
        "images_per_s": len(labels) / median,
        "gflop_per_s": len(labels) * flops / median / 1e9,
        "accuracy": accuracy,
        "loss": loss,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _random_cifar(n_train: int, n_test: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "train_images": rng.integers(0, 256, (n_train, 32, 32, 3), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train).astype(np.int32),
        "test_images": rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test).astype(np.int32),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Quick sanity timing on random CIFAR-shaped data; prints JSON lines."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="cnn")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="fedrcl")
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval", action="store_true", help="also time a 10,000-image evaluation")
    a = p.parse_args(argv)
    data = _random_cifar(max(a.clients * a.steps // a.epochs * a.batch, 1000), 10_000)
    print(json.dumps(round_seconds(a.model, a.algorithm, clients=a.clients, steps=a.steps,
                                   batch=a.batch, epochs=a.epochs, data=data, repeats=a.repeats,
                                   threads=a.threads)))
    if a.eval:
        print(json.dumps(eval_seconds(a.model, data=data, threads=a.threads)))


if __name__ == "__main__":
    main()

r"""Analytic client resource counts for MFCL: communication bits, client FLOPs, client memory.

MFCL: Motamedi & Kim, "Modular Federated Contrastive Learning with Twin Normalization for
Resource-limited Clients", TMLR (OpenReview https://openreview.net/forum?id=FlxnywWi14). The
paper claims that MFCL reduces "the communication burden and memory footprint compared to
end-to-end training" and counts its resources in its Eqs. 4-6; this module does not reproduce
those equations. Every equation in it is **our derivation** from the MFCL protocol below and
from layer shapes, labelled "derived"; none is quoted from the paper.

Protocol counted (the project's spec):

* Phase 1: each of M clients trains the *client module* -- ResNet-18's first two 3x3 convs
  (3 -> C, C -> C; stride 1, padding 1, no bias), each followed by a normalisation and a ReLU,
  then a 2x2 max-pool -- together with a mirrored *decoder* -- transposed 3x3 conv stride 2
  (C -> C, no bias) + norm + ReLU, 3x3 conv (C -> C, no bias) + norm + ReLU, 3x3 conv
  (C -> 3, with bias) -- by reconstruction, for R1 FedAvg rounds of E local epochs on its n_k
  samples. Every client takes part in every round; client module and decoder go down and up
  each round, and the final aggregated client module goes down once more so that the client
  can compute representations.
* Phase 2: each client that is not dropped (probability delta) uploads, for rho draws per
  sample, the representations (H/2 x W/2 x C values at ``bits`` bits) of two augmented views.
  The server trains the rest of the network; the client only runs forward passes.
* End-to-end baseline (what the paper's abstract compares with): federated contrastive
  training of the whole CIFAR ResNet-18 (widths C, 2C, 4C, 8C; 11,168,832 parameters at C=64
  with GroupNorm/TwinNorm, i.e. the project's ``resnet18`` without its classifier) plus an MLP
  projection head, FedAvg of the whole model each round, two views per sample.

Conventions (stated once, used everywhere):

* FLOPs: a multiply-add counts as 2 FLOPs; a bias adds 1 FLOP per output value.
  Normalisation, ReLU, pooling, residual additions and the loss are not counted (for the
  client module they are about 1% of the convolutions' FLOPs: ~8 FLOPs per normalised value
  against 2*9*C_in per conv output value).
* A transposed convolution costs ``2 * h_in * w_in * c_in * c_out * k^2`` FLOPs (every input
  value scatters a k x k x c_out patch; the usual count of fvcore/thop).
* Training FLOPs = 3x forward FLOPs: backward = 2x forward (input gradient + weight gradient).
* Communication: parameters at ``param_bits`` (32), representations at ``bits``;
  normalisation statistics of BatchNorm are model state that FedAvg averages (as the project
  does), so they are communicated but not trained.
* Training memory = parameters + gradients + Adam's two moments (4 copies of the trainable
  parameters) + model state + stored activations: the input and every layer's output (conv,
  norm, ReLU, pool, add, dense) kept for the backward pass, for one batch. Inference memory
  = parameters + state + the largest (input + output) pair of one layer for one batch.
  Framework workspaces, in-place fusions and data-loading buffers are not counted.
* Expected values over the client dropout: a dropped client neither computes nor uploads
  phase-2 representations; ``mean`` is over the M clients, ``max`` is the largest client.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np

FLOPS_PER_MAC = 2
BACKWARD_FACTOR = 2  # backward pass = 2x forward pass
TRAIN_FACTOR = 1 + BACKWARD_FACTOR
ADAM_SLOTS = 2  # first and second moments
NORMS = ("twin", "group", "batch")

_PAPER = ("Motamedi & Kim, MFCL (TMLR); counted from the protocol and layer shapes, not "
          "quoted from the paper's Eqs. 4-6")


# ---------------------------------------------------------------------------------- validation


def _int(name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return int(value)


def _real(name: str, value, *, minimum: float = 0.0, strict: bool = False) -> float:
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real)
          and math.isfinite(float(value))
          and (float(value) > minimum if strict else float(value) >= minimum))
    if not ok:
        rel = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite real number {rel} {minimum}; got {value!r}")
    return float(value)


def _hw(image_hw) -> tuple[int, int]:
    try:
        h, w = image_hw
    except (TypeError, ValueError):
        raise ValueError(f"image_hw must be a pair (H, W); got {image_hw!r}") from None
    for v in (h, w):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 2 or v % 2:
            raise ValueError(
                f"image_hw must be two even ints >= 2 (the client module's 2x2 max-pool and "
                f"the decoder's stride-2 transposed conv need even sides); got {image_hw!r}")
    return int(h), int(w)


def _norm(norm) -> str:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}; got {norm!r}")
    return norm


def _samples(num_samples_per_client) -> np.ndarray:
    try:
        n = np.asarray(num_samples_per_client)
    except (TypeError, ValueError) as e:
        raise ValueError(f"num_samples_per_client must be a 1-D sequence of ints >= 0; got "
                         f"{num_samples_per_client!r} ({e})") from e
    if n.ndim != 1 or n.size == 0 or n.dtype.kind not in "iu" or (n < 0).any():
        raise ValueError(
            f"num_samples_per_client must be a non-empty 1-D sequence of ints >= 0 (one per "
            f"client); got {num_samples_per_client!r}")
    return n.astype(np.int64)


# ------------------------------------------------------------------------------- layer counts


def conv_output_size(size: int, k: int, stride: int = 1, padding: int = 0) -> int:
    """Output side of a convolution: ``floor((size + 2 * padding - k) / stride) + 1``."""
    return (size + 2 * padding - k) // stride + 1


def conv_flops(h_out: int, w_out: int, c_in: int, c_out: int, k: int, *,
               bias: bool = False) -> int:
    r"""Forward FLOPs of one k x k convolution for one image (derived, standard count).

    .. math::
      F_\text{conv} = 2\, h_\text{out} w_\text{out}\, c_\text{out}\, c_\text{in}\, k^2
      \;(+\, h_\text{out} w_\text{out} c_\text{out} \text{ with a bias}),

    a multiply-add counted as 2 FLOPs. Backward is 2x this (``BACKWARD_FACTOR``).
    """
    for name, v in (("h_out", h_out), ("w_out", w_out), ("c_in", c_in), ("c_out", c_out),
                    ("k", k)):
        _int(name, v)
    outputs = h_out * w_out * c_out
    return FLOPS_PER_MAC * outputs * c_in * k * k + (outputs if bias else 0)


def conv_transpose_flops(h_in: int, w_in: int, c_in: int, c_out: int, k: int) -> int:
    r"""Forward FLOPs of one k x k transposed convolution (no bias) for one image (derived).

    :math:`F = 2\, h_\text{in} w_\text{in}\, c_\text{in}\, c_\text{out}\, k^2`: each input value
    scatters a :math:`k \times k \times c_\text{out}` patch, whatever the stride.
    """
    return conv_flops(h_in, w_in, c_in, c_out, k)


def dense_flops(d_in: int, d_out: int, *, bias: bool = True) -> int:
    """Forward FLOPs of a dense layer for one example: ``2 * d_in * d_out (+ d_out)``."""
    _int("d_in", d_in)
    _int("d_out", d_out)
    return FLOPS_PER_MAC * d_in * d_out + (d_out if bias else 0)


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer for one image: shapes without the batch axis, parameter and FLOP counts."""

    name: str
    kind: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    params: int = 0  # trained parameters
    state: int = 0  # non-trained model state (BatchNorm running statistics)
    flops: int = 0  # forward FLOPs per image

    @property
    def in_size(self) -> int:
        return math.prod(self.in_shape)

    @property
    def out_size(self) -> int:
        return math.prod(self.out_shape)


class _Builder:
    """Appends layers to a chain, tracking the current shape."""

    def __init__(self, shape: tuple[int, ...], norm: str):
        self.shape, self.norm, self.layers = tuple(shape), norm, []

    def add(self, name, kind, out_shape, params=0, state=0, flops=0, in_shape=None):
        self.layers.append(Layer(name, kind, tuple(in_shape or self.shape), tuple(out_shape),
                                 params, state, flops))
        self.shape = tuple(out_shape)

    def conv(self, name, c_out, k, stride=1, padding=None, bias=False, shape=None):
        h, w, c_in = shape or self.shape
        p = k // 2 if padding is None else padding
        ho, wo = conv_output_size(h, k, stride, p), conv_output_size(w, k, stride, p)
        self.add(name, "conv", (ho, wo, c_out), c_in * c_out * k * k + (c_out if bias else 0),
                 0, conv_flops(ho, wo, c_in, c_out, k, bias=bias), in_shape=(h, w, c_in))

    def conv_transpose(self, name, c_out, k, stride):
        h, w, c_in = self.shape
        self.add(name, "conv_transpose", (h * stride, w * stride, c_out), c_in * c_out * k * k,
                 0, conv_transpose_flops(h, w, c_in, c_out, k))

    def norm_layer(self, name, shape=None):
        c = (shape or self.shape)[-1]
        state = 2 * c if self.norm == "batch" else 0  # running mean and variance
        self.add(name, f"norm:{self.norm}", shape or self.shape, 2 * c, state, 0,
                 in_shape=shape or self.shape)

    def relu(self, name):
        self.add(name, "relu", self.shape)

    def max_pool(self, name, window):
        h, w, c = self.shape
        self.add(name, "max_pool", (h // window, w // window, c))

    def dense(self, name, d_out, bias=True):
        (d_in,) = self.shape
        self.add(name, "dense", (d_out,), d_in * d_out + (d_out if bias else 0), 0,
                 dense_flops(d_in, d_out, bias=bias))


def client_module_layers(image_hw=(32, 32), channels: int = 64,
                         norm: str = "twin") -> list[Layer]:
    """MFCL's client module for ``[H, W, 3]`` images -> ``[H/2, W/2, C]`` representations:
    conv3x3(3->C) -> norm -> ReLU -> conv3x3(C->C) -> norm -> ReLU -> max-pool 2x2."""
    h, w = _hw(image_hw)
    c = _int("channels", channels)
    b = _Builder((h, w, 3), _norm(norm))
    b.conv("conv1", c, 3)
    b.norm_layer("norm1")
    b.relu("relu1")
    b.conv("conv2", c, 3)
    b.norm_layer("norm2")
    b.relu("relu2")
    b.max_pool("pool", 2)
    return b.layers


def decoder_layers(image_hw=(32, 32), channels: int = 64, norm: str = "twin") -> list[Layer]:
    """MFCL's phase-1 decoder ``[H/2, W/2, C] -> [H, W, 3]``: conv-transpose3x3 stride 2 (C->C)
    -> norm -> ReLU -> conv3x3(C->C) -> norm -> ReLU -> conv3x3(C->3, bias)."""
    h, w = _hw(image_hw)
    c = _int("channels", channels)
    b = _Builder((h // 2, w // 2, c), _norm(norm))
    b.conv_transpose("deconv1", c, 3, 2)
    b.norm_layer("norm1")
    b.relu("relu1")
    b.conv("conv2", c, 3)
    b.norm_layer("norm2")
    b.relu("relu2")
    b.conv("conv3", 3, 3, bias=True)
    return b.layers


def resnet18_layers(image_hw=(32, 32), channels: int = 64, norm: str = "twin",
                    head: Sequence[int] = (512, 128)) -> list[Layer]:
    """CIFAR ResNet-18 (as ``fedjax_rcl.models.resnet.resnet18`` without its classifier) and an
    MLP projection head ``head`` (dense layers with bias, ReLU between them): the end-to-end
    baseline. Stem conv3x3(3->C) -> norm -> ReLU; four stages of two BasicBlocks, widths
    C, 2C, 4C, 8C, strides 1, 2, 2, 2; global mean; head."""
    h, w = _hw(image_hw)
    c = _int("channels", channels)
    head = tuple(_int("baseline_head entries", d) for d in head)
    b = _Builder((h, w, 3), _norm(norm))
    b.conv("stem_conv", c, 3)
    b.norm_layer("stem_norm")
    b.relu("stem_relu")
    for s, width in enumerate((c, 2 * c, 4 * c, 8 * c)):
        for blk in range(2):
            stride = 2 if (s > 0 and blk == 0) else 1
            p = f"stage{s + 1}_block{blk + 1}"
            x_shape = b.shape
            b.conv(f"{p}_conv1", width, 3, stride)
            b.norm_layer(f"{p}_norm1")
            b.relu(f"{p}_relu1")
            b.conv(f"{p}_conv2", width, 3)
            b.norm_layer(f"{p}_norm2")
            y_shape = b.shape
            if stride != 1 or x_shape[-1] != width:
                b.conv(f"{p}_shortcut_conv", width, 1, stride, padding=0, shape=x_shape)
                b.norm_layer(f"{p}_shortcut_norm")
            b.add(f"{p}_add", "add", y_shape, in_shape=y_shape)
            b.relu(f"{p}_relu")
    b.add("global_mean", "mean", (b.shape[-1],))
    for i, d in enumerate(head):
        if i:
            b.relu(f"head_relu{i}")
        b.dense(f"head_dense{i + 1}", d)
    return b.layers


def count_params(layers: Sequence[Layer]) -> tuple[int, int]:
    """``(trained parameters, non-trained state)``: conv/dense weights and biases plus the
    norms' scale and shift; state is BatchNorm's running mean and variance."""
    return sum(x.params for x in layers), sum(x.state for x in layers)


def forward_flops(layers: Sequence[Layer]) -> int:
    """Forward FLOPs per image: the sum over conv, transposed-conv and dense layers."""
    return sum(x.flops for x in layers)


def client_module_flops(image_hw=(32, 32), channels: int = 64) -> int:
    r"""Forward FLOPs of the client module per image (derived):

    .. math:: F_\text{cm} = 2 H W C (3 \cdot 9) + 2 H W C (C \cdot 9) = 18 H W C (C + 3).
    """
    return forward_flops(client_module_layers(image_hw, channels))


def decoder_flops(image_hw=(32, 32), channels: int = 64) -> int:
    r"""Forward FLOPs of the decoder per image (derived):

    .. math::
      F_\text{dec} = 2 \tfrac{H}{2}\tfrac{W}{2} C^2 9 + 2 H W C^2 9 + 2 H W\, 3 C\, 9 + 3 H W .
    """
    return forward_flops(decoder_layers(image_hw, channels))


def resnet18_flops(image_hw=(32, 32), channels: int = 64, head: Sequence[int] = (512, 128)) -> int:
    """Forward FLOPs per image of the end-to-end baseline (ResNet-18 + projection head)."""
    return forward_flops(resnet18_layers(image_hw, channels, head=head))


def training_activation_elements(layers: Sequence[Layer]) -> int:
    """Values stored per image for the backward pass: the input plus every layer's output."""
    return layers[0].in_size + sum(x.out_size for x in layers)


def inference_activation_elements(layers: Sequence[Layer]) -> int:
    """Values live at once per image in a forward-only pass: the largest input + output."""
    return max(x.in_size + x.out_size for x in layers)


def training_memory_bytes(layers: Sequence[Layer], images_per_batch: int, *,
                          param_bits: float = 32, activation_bits: float = 32) -> dict:
    r"""Peak memory of one training step with Adam (derived):

    .. math::
      \text{Mem}_\text{train} = (4 P + S)\,\tfrac{b_p}{8} + B\, A\, \tfrac{b_a}{8},

    P trained parameters (weights, gradients, Adam's m and v), S state, B images per batch,
    A = ``training_activation_elements``. Returns the parts and their ``total`` in bytes.
    """
    p, s = count_params(layers)
    pb, ab = param_bits / 8, activation_bits / 8
    parts = {"parameters": p * pb, "gradients": p * pb, "optimizer": ADAM_SLOTS * p * pb,
             "state": s * pb,
             "activations": images_per_batch * training_activation_elements(layers) * ab}
    parts["total"] = sum(parts.values())
    return parts


def inference_memory_bytes(layers: Sequence[Layer], images_per_batch: int, *,
                           param_bits: float = 32, activation_bits: float = 32) -> dict:
    r"""Peak memory of a forward-only pass (derived):
    :math:`(P + S)\,b_p/8 + B \max_\ell(\text{in}_\ell + \text{out}_\ell)\, b_a/8`."""
    p, s = count_params(layers)
    pb, ab = param_bits / 8, activation_bits / 8
    parts = {"parameters": p * pb, "state": s * pb,
             "activations": images_per_batch * inference_activation_elements(layers) * ab}
    parts["total"] = sum(parts.values())
    return parts


def _stat(per_client: np.ndarray) -> dict:
    return {"mean": float(per_client.mean()), "max": float(per_client.max())}


# ------------------------------------------------------------------------------------ MFCL


def mfcl_resources(*, num_samples_per_client, image_hw=(32, 32), channels: int = 64,
                   phase1_rounds: int, local_epochs: int, rho: float, delta: float,
                   bits: float = 32, norm: str = "twin", batch_size: int = 64,
                   phase1_views: int = 2, param_bits: float = 32,
                   activation_bits: float = 32, baseline_rounds: int | None = None,
                   baseline_head: Sequence[int] = (512, 128)) -> dict:
    r"""Per-client communication, FLOPs and peak memory of MFCL and of end-to-end training.

    All equations are derived here (not the paper's Eqs. 4-6). Notation: client
    k has :math:`n_k` samples; :math:`P_\text{cm}, P_\text{dec}` are the client module's and
    decoder's communicated values (trained parameters + BatchNorm state),
    :math:`D = \tfrac{H}{2}\tfrac{W}{2} C` the representation size, :math:`b` = ``bits``,
    :math:`b_p` = ``param_bits``, :math:`V_1` = ``phase1_views``, :math:`F_\cdot` forward FLOPs
    per image, :math:`K` = ``batch_size`` samples (view pairs) per batch.

    Communication (bits, per client):

    .. math::
      C^{(1)}_k &= \big(2 R_1 (P_\text{cm} + P_\text{dec}) + P_\text{cm}\big)\, b_p
        \quad\text{(down + up every round, then the final client module down)}\\
      C^{(2)}_k &= (1 - \delta)\, \rho\, n_k \cdot 2 D \cdot b
        \quad\text{(two views per draw, } \rho \text{ draws per sample)}\\
      C_k &= C^{(1)}_k + C^{(2)}_k .

    Client FLOPs (training = 3x forward):

    .. math::
      F^{(1)}_k = 3\, R_1 E\, n_k V_1 (F_\text{cm} + F_\text{dec}), \qquad
      F^{(2)}_k = (1 - \delta)\, \rho\, n_k \cdot 2\, F_\text{cm}.

    Client peak memory: ``max`` of phase-1 training (client module + decoder, Adam, activations
    of :math:`V_1 K` images) and phase-2 inference (client module on :math:`2K` images); see
    ``training_memory_bytes`` and ``inference_memory_bytes``.

    End-to-end baseline (``end_to_end``): ResNet-18 + ``baseline_head`` trained on every
    client for :math:`R_b` = ``baseline_rounds`` (default ``phase1_rounds``) rounds of E
    epochs on two views per sample:
    :math:`C_k = 2 R_b P_\text{e2e} b_p`, :math:`F_k = 3 R_b E\, n_k\, 2 F_\text{e2e}`, memory
    = ``training_memory_bytes`` on :math:`2K` images.

    Args:
      num_samples_per_client: :math:`n_k`, one int >= 0 per client (M = its length).
      image_hw: image height and width (even).
      channels: C, the client module's width (ResNet-18's 64).
      phase1_rounds: R1 >= 1.
      local_epochs: E >= 1 (phase 1 and the baseline).
      rho: draws of two augmented views per sample in phase 2 (real >= 0).
      delta: client dropout probability in phase 2, in [0, 1).
      bits: bits per representation value (32 unless quantised).
      norm: ``"twin"`` | ``"group"`` (scale and shift per channel) | ``"batch"`` (plus
        running statistics, communicated but not trained).
      batch_size: K, samples per batch (each a view pair in phase 2 and with ``norm="twin"``).
      phase1_views: images per sample per phase-1 epoch, 2 (view pairs; required by
        ``norm="twin"``) or 1.
      param_bits: bits per communicated and stored parameter.
      activation_bits: bits per stored activation.
      baseline_rounds: rounds of the end-to-end baseline (default: ``phase1_rounds``).
      baseline_head: widths of the baseline's projection-head dense layers (``()`` for none).

    Returns:
      A nested dict of plain numbers (``format_resources`` prints it): ``config``, ``sources``,
      ``mfcl`` and ``end_to_end`` (each with ``params``, ``communication_bits``, ``flops``,
      ``memory_bytes``, and ``per_client`` lists; communication and FLOPs as
      ``{"mean", "max"}`` over clients) and ``ratios`` (end-to-end / MFCL, on client means and
      on peak memory).
    """
    n = _samples(num_samples_per_client)
    h, w = _hw(image_hw)
    c = _int("channels", channels)
    r1 = _int("phase1_rounds", phase1_rounds)
    e = _int("local_epochs", local_epochs)
    rho = _real("rho", rho)
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 <= delta < 1:
        raise ValueError(f"delta (client dropout probability) must be in [0, 1); got {delta!r}")
    delta = float(delta)
    bits = _real("bits", bits, strict=True)
    norm = _norm(norm)
    k_batch = _int("batch_size", batch_size)
    v1 = _int("phase1_views", phase1_views)
    if v1 not in (1, 2):
        raise ValueError(f"phase1_views must be 1 or 2; got {phase1_views!r}")
    if norm == "twin" and v1 != 2:
        raise ValueError(f"phase1_views must be 2 with norm='twin' (Twin Normalization needs "
                         f"view pairs); got phase1_views={phase1_views!r}")
    param_bits = _real("param_bits", param_bits, strict=True)
    activation_bits = _real("activation_bits", activation_bits, strict=True)
    rb = r1 if baseline_rounds is None else _int("baseline_rounds", baseline_rounds)
    head = tuple(baseline_head)

    cm = client_module_layers((h, w), c, norm)
    dec = decoder_layers((h, w), c, norm)
    e2e = resnet18_layers((h, w), c, norm, head)
    (p_cm, s_cm), (p_dec, s_dec), (p_e2e, s_e2e) = map(count_params, (cm, dec, e2e))
    comm_cm, comm_dec, comm_e2e = p_cm + s_cm, p_dec + s_dec, p_e2e + s_e2e
    f_cm, f_dec, f_e2e = map(forward_flops, (cm, dec, e2e))
    rep = cm[-1].out_size  # H/2 * W/2 * C values per view
    keep = 1.0 - delta
    nf = n.astype(np.float64)

    c1 = np.full(n.shape, float((2 * r1 * (comm_cm + comm_dec) + comm_cm) * param_bits))
    c2 = keep * rho * nf * 2 * rep * bits
    f1 = TRAIN_FACTOR * r1 * e * nf * v1 * (f_cm + f_dec)
    f2 = keep * rho * nf * 2 * f_cm
    mem_kw = {"param_bits": param_bits, "activation_bits": activation_bits}
    mem1 = training_memory_bytes(cm + dec, v1 * k_batch, **mem_kw)
    mem2 = inference_memory_bytes(cm, 2 * k_batch, **mem_kw)
    mfcl = {
        "params": {"client_module": p_cm, "decoder": p_dec, "state": s_cm + s_dec,
                   "communicated_per_exchange": comm_cm + comm_dec,
                   "representation_values_per_view": rep},
        "communication_bits": {"phase1": _stat(c1), "phase2": _stat(c2),
                               "total": _stat(c1 + c2)},
        "flops": {"forward_per_image": {"client_module": f_cm, "decoder": f_dec},
                  "phase1": _stat(f1), "phase2": _stat(f2), "total": _stat(f1 + f2)},
        "memory_bytes": {"phase1_training": mem1, "phase2_inference": mem2,
                         "peak": max(mem1["total"], mem2["total"])},
        "per_client": {"communication_bits": (c1 + c2).tolist(), "flops": (f1 + f2).tolist()},
    }

    cb = np.full(n.shape, float(2 * rb * comm_e2e * param_bits))
    fb = TRAIN_FACTOR * rb * e * nf * 2 * f_e2e
    memb = training_memory_bytes(e2e, 2 * k_batch, **mem_kw)
    p_head = sum(x.params for x in e2e if x.name.startswith("head_"))
    end_to_end = {
        "params": {"backbone": p_e2e - p_head, "head": p_head, "state": s_e2e,
                   "communicated_per_exchange": comm_e2e},
        "communication_bits": {"total": _stat(cb)},
        "flops": {"forward_per_image": f_e2e, "total": _stat(fb)},
        "memory_bytes": {"training": memb, "peak": memb["total"]},
        "per_client": {"communication_bits": cb.tolist(), "flops": fb.tolist()},
    }

    def ratio(a, b):
        return a / b if b else math.inf

    return {
        "config": {"num_clients": int(n.size), "samples_mean": float(nf.mean()),
                   "samples_max": int(n.max()), "image_hw": (h, w), "channels": c,
                   "phase1_rounds": r1, "local_epochs": e, "rho": rho, "delta": delta,
                   "bits": bits, "norm": norm, "batch_size": k_batch, "phase1_views": v1,
                   "param_bits": param_bits, "activation_bits": activation_bits,
                   "baseline_rounds": rb, "baseline_head": head},
        "sources": {"communication": f"derived ({_PAPER})", "flops": f"derived ({_PAPER})",
                    "memory": f"derived ({_PAPER})"},
        "mfcl": mfcl,
        "end_to_end": end_to_end,
        "ratios": {
            "communication": ratio(cb.mean(), (c1 + c2).mean()),
            "flops": ratio(fb.mean(), (f1 + f2).mean()),
            "memory": ratio(memb["total"], mfcl["memory_bytes"]["peak"]),
        },
    }


def format_resources(d: dict) -> str:
    """A short multi-line summary of ``mfcl_resources``: communication in MB (1e6 bytes),
    FLOPs in GFLOP (1e9), memory in MiB (2**20 bytes); per client, mean (max) over clients."""
    cfg, m, b, r = d["config"], d["mfcl"], d["end_to_end"], d["ratios"]

    def mb(stat):
        return f"{stat['mean'] / 8e6:,.2f} MB" + (
            f" (max {stat['max'] / 8e6:,.2f})" if stat["max"] != stat["mean"] else "")

    def gf(stat):
        return f"{stat['mean'] / 1e9:,.1f} GFLOP" + (
            f" (max {stat['max'] / 1e9:,.1f})" if stat["max"] != stat["mean"] else "")

    def mib(x):
        return f"{x / 2**20:,.1f} MiB"

    mc, mf, mm = m["communication_bits"], m["flops"], m["memory_bytes"]
    m1, m2 = mm["phase1_training"], mm["phase2_inference"]
    h, w = cfg["image_hw"]
    head = "-".join(map(str, cfg["baseline_head"])) or "none"
    lines = [
        f"MFCL per client ({cfg['num_clients']} clients, {cfg['samples_mean']:,.0f} samples "
        f"mean, {h}x{w} images, C={cfg['channels']}, norm={cfg['norm']}, "
        f"R1={cfg['phase1_rounds']}, E={cfg['local_epochs']}, rho={cfg['rho']:g}, "
        f"delta={cfg['delta']:g}, {cfg['bits']:g}-bit representations)",
        f"  params: client module {m['params']['client_module']:,} + decoder "
        f"{m['params']['decoder']:,}",
        f"  communication: phase 1 {mb(mc['phase1'])} + phase 2 {mb(mc['phase2'])} = "
        f"{mb(mc['total'])}",
        f"  client FLOPs:  phase 1 {gf(mf['phase1'])} + phase 2 {gf(mf['phase2'])} = "
        f"{gf(mf['total'])}",
        f"  peak memory:   {mib(mm['peak'])} (phase 1 training {mib(m1['total'])}: weights+"
        f"grads+Adam {mib(m1['parameters'] + m1['gradients'] + m1['optimizer'])}, "
        f"activations {mib(m1['activations'])}, batch {cfg['batch_size']} samples; phase 2 "
        f"inference {mib(m2['total'])})",
        f"End-to-end ResNet-18 + head {head} ({b['params']['communicated_per_exchange']:,} "
        f"values per exchange, {cfg['baseline_rounds']} rounds)",
        f"  communication: {mb(b['communication_bits']['total'])}",
        f"  client FLOPs:  {gf(b['flops']['total'])}",
        f"  peak memory:   {mib(b['memory_bytes']['peak'])} (activations "
        f"{mib(b['memory_bytes']['training']['activations'])})",
        f"End-to-end / MFCL: communication {r['communication']:.2f}x, FLOPs "
        f"{r['flops']:.2f}x, memory {r['memory']:.2f}x",
        f"Source: {d['sources']['communication']}.",
    ]
    return "\n".join(lines)


__all__ = [
    "ADAM_SLOTS", "BACKWARD_FACTOR", "FLOPS_PER_MAC", "Layer", "NORMS", "TRAIN_FACTOR",
    "client_module_flops", "client_module_layers", "conv_flops", "conv_output_size",
    "conv_transpose_flops", "count_params", "decoder_flops", "decoder_layers", "dense_flops",
    "format_resources", "forward_flops", "inference_activation_elements",
    "inference_memory_bytes", "mfcl_resources", "resnet18_flops", "resnet18_layers",
    "training_activation_elements", "training_memory_bytes",
]

"""Which client layout a round uses when ``clients_in_parallel=0``: a cost model fitted to a
measured table.

A round trains its sampled clients either side by side (``vmap`` over the client axis: every
operation runs once for all clients, with per-client weights) or one after another inside the
same compiled program (``clients_in_parallel=1``). Which is faster depends on how much work one
client's step already gives the machine:

* a small client step (MOON's CNN: 0.196 GFLOP at batch 50) leaves a GPU mostly idle between
  operations, and side by side runs many clients for the price of one (on a CPU only the
  smallest steps gain: the threshold below);
* a large one (a ResNet, pfl-research's CNN) already keeps the machine busy; side by side then
  buys nothing and costs memory and cache, and on a GPU its per-client weights turn every
  convolution into a grouped convolution, which runs far below the dense one's speed.

The model: clients run side by side iff one client's training step (forward and backward of one
batch, ``3 x`` the forward FLOPs) costs less than ``SIDE_BY_SIDE_BELOW_GFLOP[platform]``. The
thresholds are fitted to the layout tables in BENCHMARKS.md ("Which client layout") by
``tools/fit_layout.py``: the geometric mean of the largest step measured fastest side by side and
the smallest measured fastest one at a time (``analyse_table`` reads such a table). The FLOPs
are counted from the model's own
program (its convolutions and matrix products), so a new model needs no flag.

A cost model rather than a timed probe: the choice is deterministic (the two layouts can differ
in the last bits of a result, so a run must not depend on which probe happened to win) and costs
no compile.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.extend import core as jex_core

# One client's training step below this many GFLOP: clients side by side; at or above: one at a
# time (see the module docstring).
# - cpu: fitted by tools/fit_layout.py to the CPU layout table in BENCHMARKS.md ("Which client
#   layout"), measured on an Intel Xeon (AVX-512) once the oneDNN convolutions and the pool
#   kernel took all the clients side by side in one call each: MOON's CNN without and with its
#   projection head (0.196 and 0.205 GFLOP at batch 50) fastest side by side (1.04-1.25x at
#   5-50 clients with 50 local steps), as in MOON's Table 1 setting (0.81-0.94x of one at a
#   time's round); pfl's CNN (5.05) and ResNet-10 at width 16 (4.85) fastest one at a time
#   (1.14-1.73x), ResNet-18 (167) too (an earlier table). The geometric mean of 0.205 and 4.85
#   is 1.0; no model measured lies between them.
# - gpu: fitted by tools/fit_layout.py to the GPU layout table in BENCHMARKS.md ("Clients side
#   by side on a GPU"): MOON's CNN (0.196 GFLOP) and ResNet-10 at width 16 (4.85) fastest side
#   by side at 10-50 clients; ResNet-18 (167) fastest one at a time (its per-client weights make
#   every convolution a grouped one). The geometric mean of 4.85 and 167 is 28.4. Between 4.85
#   and 167 GFLOP (pfl's CNN, 5.05, is there) the table has no model.
# - tpu: not measured; side by side.
SIDE_BY_SIDE_BELOW_GFLOP = {"cpu": 1.0, "gpu": 28.4, "tpu": math.inf}

# Forward + backward of a training step: the backward costs about twice the forward.
TRAIN_STEP_FACTOR = 3

# The extension's forward convolutions (fedjax_rcl.nn.onednn, fedjax_rcl.nn.narrow_conv).
_FFI_FORWARD = ("fedjax_onednn_conv_forward", "fedjax_narrow_conv_forward")


def _subjaxprs(value):
    """The jaxprs inside an equation's parameter (a jaxpr, a closed jaxpr, or tuples of them)."""
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def jaxpr_flops(jaxpr) -> float:
    """Multiply-adds x 2 of the convolutions and matrix products in ``jaxpr`` (a ``Jaxpr`` or
    ``ClosedJaxpr``), nested programs included (a ``scan`` body counted ``length`` times; of a
    ``cond``'s branches the costliest). Convolutions run through the project's CPU kernels
    (oneDNN's and ``nn.narrow_conv``'s) count like ``conv_general_dilated``. Elementwise work
    is not counted: it is small beside these in the models here, and the same in either
    layout."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "conv_general_dilated":
            out, rhs = eqn.outvars[0].aval, eqn.invars[1].aval
            out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += 2.0 * math.prod(out.shape) * math.prod(rhs.shape) / out_features
        elif name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            k = math.prod(lhs.shape[d] for d in lhs_contract)
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
        elif name == "ffi_call" and eqn.params.get("target_name") in _FFI_FORWARD:
            out, w = eqn.outvars[0].aval, eqn.invars[1].aval  # NHWC, HWIO
            total += 2.0 * math.prod(out.shape) * math.prod(w.shape[:3])
        elif name == "cond":
            total += max(jaxpr_flops(b) for b in eqn.params["branches"])
        else:
            inner = sum(jaxpr_flops(j) for v in eqn.params.values() for j in _subjaxprs(v))
            total += inner * (eqn.params["length"] if name == "scan" else 1)
    return total


def forward_flops(apply: Callable, params, model_state, image_shape, batch_size: int) -> float:
    """FLOPs of one forward pass of ``apply(params, model_state, images, train=False)`` on a
    batch of ``batch_size`` images of ``image_shape``, counted from its traced program (nothing
    is compiled or run)."""
    images = jax.ShapeDtypeStruct((batch_size, *image_shape), np.float32)
    jaxpr = jax.make_jaxpr(lambda p, s, x: apply(p, s, x, train=False))(
        params, model_state, images)
    return jaxpr_flops(jaxpr)


def side_by_side(step_gflop: float, platform: str) -> bool:
    """Whether clients whose training step costs ``step_gflop`` GFLOP run side by side on
    ``platform`` (``cpu``, ``gpu``, ``tpu``; others are treated as ``tpu``)."""
    return step_gflop < SIDE_BY_SIDE_BELOW_GFLOP.get(platform, math.inf)


def runs_side_by_side(runs: int, clients: int, step_gflop: float, platform: str) -> bool:
    """Whether ``runs`` runs of one program (``seeds=[...]``, a sweep) train side by side on
    ``platform``, each with ``clients`` clients side by side whose training step costs
    ``step_gflop`` GFLOP: the clients' rule applied to the step work all of them put on the
    device at once, ``runs x clients x step_gflop``. Below the threshold, one run's step leaves
    the machine idle and the runs fill it together; at or above it, the runs' work already fills
    it, and side by side only adds memory and (on a GPU) grouped convolutions over the run axis
    as well as the client axis. The threshold is the one fitted to the client layouts;
    BENCHMARKS.md keeps the table of runs side by side that can refit it."""
    return side_by_side(runs * clients * step_gflop, platform)


def fit_threshold(best: dict[float, bool]) -> float | None:
    """The threshold the cost model would use given ``{step GFLOP: fastest side by side?}``:
    the geometric mean of the largest side-by-side step and the smallest one-at-a-time step,
    or None when the table cannot separate them (a one-at-a-time step below a side-by-side
    one) or has only one kind."""
    together = [g for g, s in best.items() if s]
    apart = [g for g, s in best.items() if not s]
    if not together or not apart or max(together) >= min(apart):
        return None
    return math.sqrt(max(together) * min(apart))


# The two layouts the default chooses between, as ``tools/bench_round.py`` names its modes.
SIDE, APART = "side-by-side", "one-at-a-time"
# A compiled layout within this fraction of the faster one at every client count counts as
# fastest too ("either").
TOLERANCE = 0.95


def platform_of(machine: str) -> str:
    """The platform (``cpu``, ``gpu``, ``tpu``) of a benchmark table's ``machine`` line."""
    for p in ("gpu", "tpu", "cpu"):
        if f", {p}," in machine or f", {p} (" in machine or machine.startswith(p):
            return p
    if "NVIDIA" in machine or "H100" in machine or "H200" in machine:
        return "gpu"
    return "cpu"


def merge_tables(docs: Sequence[Mapping], stages: Sequence[int] | None = None) -> dict | None:
    """One layout table from several ``tools/bench_round.py --json`` results of one machine
    (measured in stages): the first's header, every row in order, each tagged with ``stage``,
    the stage that measured it (``stages``, one per result; default: the result's index).
    None when there is none (no stage finished)."""
    if not docs:
        return None
    stages = range(len(docs)) if stages is None else stages
    rows = [dict(r, stage=k) for k, d in zip(stages, docs, strict=True) for r in d["rows"]]
    return dict(docs[0], rows=rows)


def analyse_table(doc: Mapping, step_gflop: Callable[[str, int], float],
                  platform: str | None = None) -> dict:
    """Which layout is fastest for each model of a measured table, and the threshold fitted to
    it.

    ``doc`` is a ``tools/bench_round.py --json`` result (``machine`` and ``rows`` of ``model``,
    ``clients``, ``mode``, ``batch``, ``client_steps_per_s``; float32 rows only are read);
    ``step_gflop(model, batch)`` is one client's training-step GFLOP. Per model: the speeds by
    client count and mode, ``gflop``, the layout the cost model picks (``default``), its speed
    over the best measured one per client count (``ratio``), and the ``verdict``: the compiled
    layout within ``TOLERANCE`` of the faster one at every client count above 1 (``"either"``
    when both are, None when the two were not both measured). ``fitted`` is ``fit_threshold``
    over the models with a verdict; ``threshold`` the package's for the platform.
    """
    platform = platform or platform_of(doc.get("machine", ""))
    rows = [r for r in doc["rows"] if r.get("precision", "fp32") == "fp32"
            and r["mode"] != "torch" and r.get("round_s")]
    models: dict[str, dict] = {}
    for r in rows:
        m = models.setdefault(r["model"], {"batch": r["batch"], "speed": {}})
        m["speed"].setdefault(r["clients"], {})[r["mode"]] = r["client_steps_per_s"]
    for spec, m in models.items():
        m["gflop"] = step_gflop(spec, m["batch"])
        default = SIDE if side_by_side(m["gflop"], platform) else APART
        m["default"] = default
        m["ratio"], worst = {}, {SIDE: math.inf, APART: math.inf}
        for k, speeds in sorted(m["speed"].items()):
            best = max(speeds.values())
            # With "vmap" rows (the default of the code that ran) standing for a layout: skip.
            if default in speeds:
                m["ratio"][k] = speeds[default] / best
            if k > 1 and SIDE in speeds and APART in speeds:
                for lay in (SIDE, APART):
                    worst[lay] = min(worst[lay], speeds[lay] / max(speeds[SIDE], speeds[APART]))
        if math.isinf(worst[SIDE]):
            m["verdict"] = None
        elif worst[SIDE] >= TOLERANCE and worst[APART] >= TOLERANCE:
            m["verdict"] = "either"
        else:
            m["verdict"] = SIDE if worst[SIDE] >= worst[APART] else APART
    fitted = fit_threshold({m["gflop"]: m["verdict"] == SIDE for m in models.values()
                            if m["verdict"] in (SIDE, APART)})
    return {"platform": platform, "machine": doc.get("machine", ""), "models": models,
            "fitted": fitted, "threshold": SIDE_BY_SIDE_BELOW_GFLOP.get(platform)}

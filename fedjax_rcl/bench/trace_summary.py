"""Where a compiled program's device time goes: a JAX profiler trace summarised as shares of
kernel categories (convolutions, matrix products, element-wise work and other fusions, copies,
other) and of idle time between kernels.

    import jax
    from fedjax_rcl.bench import trace_summary
    compiled = jax.jit(f).lower(*args).compile()
    summary = trace_summary.profile(lambda: compiled(*args), compiled.as_text(), "/tmp/trace")

``profile`` runs the call once under ``jax.profiler.trace(..., create_perfetto_trace=True)``
and reads the ``perfetto_trace.json.gz`` it writes (Chrome trace-event JSON; the ``.xplane.pb``
beside it needs xprof to read and is not used). Which events are the program's operations:

* on a GPU or TPU, every event on the device's own tracks (``/device:GPU:0``: the kernels and
  memory copies of each stream; derived tracks such as ``XLA Ops``, which repeat the kernels
  under the operations' names, are skipped);
* on a CPU, the events that name an HLO operation (``args.hlo_op``) on the host's threads.

Each event is put in a category by its HLO operation, looked up in the optimised HLO of the
program (``compiled.as_text()``): a ``convolution`` (or a custom call to cuDNN's or oneDNN's
convolution), a ``dot`` (or a cuBLAS custom call), a fusion by what it fuses (one holding a
convolution or a dot counts as that; one of only slicing, transposing and copying as a copy),
the data-movement operations as copies. Control flow (``while``, ``conditional``, ``call``)
is left out: on a CPU its event spans its body's events. An event whose operation is not in
the HLO (a memory copy, a kernel inside a CUDA graph that carries no operation name) is
classified by its own name. ``top_ops`` lists the costliest operations with their category,
so that a wrong category can be seen and fixed from the file; a kernel inside a CUDA graph is
listed under its own fusion where its name gives one, not under the graph's command buffer
(which would sum the whole round's element-wise kernels into one line).

Work and traffic: each operation's FLOPs (2 per multiply-add of a convolution, an XLA or
oneDNN one, and of a dot, also inside a fusion) and bytes (its operands read and its results
written, whole: an upper bound for a fusion that reads part of an operand) are read from the
same HLO (``hlo_costs``), so that each of ``top_ops`` and each category carries its achieved
GFLOP/s and GB/s, to set beside the machine's matmul peak and memory bandwidth.

Idle: the span from the first operation's start to the last one's end, less the time covered
by at least one operation: launch gaps and host waits inside the call (on a CPU, where
operations run on several threads at once, the category times can add up to more than the
span). Overlapped: per category, the time its operations ran while another thread's (or
stream's) operation ran too; on a CPU the time they did not have the cores to themselves.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

CATEGORIES = ("convolution", "matmul", "elementwise", "copy", "other")
CONTROL = {"while", "conditional", "call", "tuple", "get-tuple-element", "parameter",
           "constant", "bitcast", "after-all", "opt-barrier", "async-start", "async-done",
           "async-update", "add-dependency", "partition-id", "replica-id"}
MOVES = {"copy", "copy-start", "copy-done", "transpose", "slice", "dynamic-slice",
         "dynamic-update-slice", "concatenate", "pad", "gather", "scatter", "reshape",
         "broadcast", "reverse", "iota"}
# Derived tracks of a device in the trace viewer: they repeat the kernels of the streams.
DERIVED_TRACKS = ("xla modules", "xla ops", "framework ops", "tensorflow ops", "source code",
                  "steps", "launch stats", "xla traceme", "framework name scope",
                  "tensorflow name scope", "host threads")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_ANNOTATED = re.compile(r"hlo_op=([\w.\-]+)")
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*?)\s([a-z][a-z0-9\-_]*)\((.*)$")
_SHAPE = re.compile(r"\b(pred|bf16|c64|c128|f8\w*|[fsu]\d+)\[([\d,]*)\]")
_HEADER_PARAM = re.compile(r"([\w.\-]+):\s+((?:\([^)]*\))|(?:[\w]+\[[\d,]*\]))")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# The extension's convolutions (fedjax_rcl.nn.onednn, fedjax_rcl.nn.narrow_conv; NHWC
# activations, HWIO kernels): where the output-side tensor (y, or dy) and the kernel are, as an
# operand index or "result".
_ONEDNN_CONV = {"fedjax_onednn_conv_forward": ("result", 1),
                "fedjax_onednn_conv_backward_data": (0, 1),
                "fedjax_onednn_conv_backward_weights": (1, "result"),
                "fedjax_narrow_conv_forward": ("result", 1),
                "fedjax_narrow_conv_backward_data": (0, 1)}


def _by_name(text: str) -> str:
    """The category of an operation or kernel known only by its name."""
    t = text.lower()
    if re.search(r"conv(?!ert)|fprop|dgrad|wgrad|winograd|convolve|implicit_gemm|cudnn", t):
        return "convolution"
    if re.search(r"gemm|gemv|matmul|cublas|nvjet|\bdot\b|dot[._]", t):
        return "matmul"
    if re.search(r"memcpy|memset|copy|transpose|slice|concatenate|gather|scatter|\bpad", t):
        return "copy"
    if re.search(r"fusion|reduce|add|mul|sub|div|exp|log|tanh|max|min|select|compare|"
                 r"convert|broadcast|negate|rsqrt|sqrt|power", t):
        return "elementwise"
    return "other"


def _custom_call(target: str) -> str:
    t = target.lower()
    if "conv" in t:
        return "convolution"
    if re.search(r"gemm|matmul|cublas", t):
        return "matmul"
    if "norm" in t or "pool" in t or "augment" in t:
        # the normalization, pool and augmentation kernels (fedjax_group_norm_*,
        # fedjax_bias_relu_max_pool_*, fedjax_augment_images): the work XLA fuses otherwise
        return "elementwise"
    return "other"


def hlo_categories(hlo_text: str) -> dict[str, str]:
    """``{instruction name: category}`` (``CATEGORIES`` or ``"control"``) for every instruction
    of an optimised HLO module's text (``compiled.as_text()``)."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = comps.setdefault(m.group(1), [])
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _DEFINITION.match(line)
        if m and current is not None:
            current.append((m.group(1), m.group(3), line))

    memo: dict[str, set[str]] = {}

    def contents(comp: str, seen: frozenset = frozenset()) -> set[str]:
        """The kinds of work inside a computation and the computations it calls."""
        if comp in memo:
            return memo[comp]
        kinds: set[str] = set()
        for _, op, line in comps.get(comp, ()):
            if op == "convolution":
                kinds.add("convolution")
            elif op == "dot":
                kinds.add("matmul")
            elif op == "custom-call":
                t = _TARGET.search(line)
                kinds.add(_custom_call(t.group(1)) if t else "other")
            elif op in MOVES:
                kinds.add("copy")
            elif op not in CONTROL:
                kinds.add("elementwise")
            for callee in _CALLS.findall(line):
                if callee in comps and callee not in seen:
                    kinds |= contents(callee, seen | {comp})
        memo[comp] = kinds
        return kinds

    out: dict[str, str] = {}
    for instrs in comps.values():
        for name, op, line in instrs:
            if op == "convolution":
                out[name] = "convolution"
            elif op == "dot":
                out[name] = "matmul"
            elif op == "custom-call":
                t = _TARGET.search(line)
                out[name] = _custom_call(t.group(1)) if t else "other"
            elif op == "fusion":
                called = _CALLS.findall(line)
                kinds = set().union(*(contents(c) for c in called)) if called else set()
                for k in ("convolution", "matmul", "elementwise", "copy"):
                    if k in kinds:
                        out[name] = k
                        break
                else:
                    out[name] = "elementwise"
            elif op in CONTROL:
                out[name] = "control"
            elif op in MOVES:
                out[name] = "copy"
            elif op in ("rng-bit-generator", "rng", "sort", "rng-get-and-update-state"):
                out[name] = "other"
            else:
                out[name] = "elementwise"
    return out


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(text)]


def _nbytes(shapes) -> int:
    return sum(_BYTES.get(dt, 4) * int(np.prod(dims, dtype=np.int64)) for dt, dims in shapes)


def _operands(text: str) -> tuple[list[str], str]:
    """The operand texts of an instruction (``text`` starts after its opening parenthesis)
    and what follows the closing one (its attributes)."""
    depth, start, out = 0, 0, []
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                last = text[start:i].strip()
                return ([*out, last] if last else out), text[i + 1:]
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    return out, ""


def _labels_out_dim(attrs: str, rank: int) -> int:
    """The output-feature dimension of a convolution's kernel (``dim_labels=..._01io->...``)."""
    m = re.search(r"dim_labels=\w+_(\w+)->", attrs)
    return m.group(1).index("o") if m and "o" in m.group(1) else rank - 1


def hlo_costs(hlo_text: str) -> dict[str, dict]:
    """``{instruction name: {"flops": ..., "bytes": ..., "what": ...}}`` per run of every
    operation of an optimised HLO module's text (module docstring): FLOPs of its convolutions
    and dots (those of the computations a fusion calls included), bytes of its operands and
    results, and ``what``: the operation (a custom call's target) with its shapes."""
    shapes: dict[str, list] = {}
    defs: list[tuple[str, str, str, list[str], str, str]] = []  # name, op, result, ops, attrs, comp
    comp = ""
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            comp = m.group(1)
            for pname, ptext in _HEADER_PARAM.findall(line.split("->")[0]):
                shapes.setdefault(pname, _shapes(ptext))
            continue
        m = _DEFINITION.match(line)
        if not m:
            continue
        name, result, op, rest = m.groups()
        operands, attrs = _operands(rest)
        shapes[name] = _shapes(result)
        defs.append((name, op, result, operands, attrs, comp))

    def operand_shapes(operands: list[str]) -> list:
        out = []
        for o in operands:
            own = _shapes(o.rsplit("%", 1)[0]) if "[" in o else []
            out.append(own or shapes.get(o.split()[-1].lstrip("%"), []))
        return out

    def flops(op: str, result: str, operands: list[str], attrs: str) -> int:
        ins = operand_shapes(operands)
        res = _shapes(result)
        if op == "dot" and ins and res:
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
            dims = [int(d) for d in m.group(1).split(",") if d] if m else []
            k = int(np.prod([ins[0][0][1][d] for d in dims], dtype=np.int64)) if ins[0] else 1
            return 2 * int(np.prod(res[0][1], dtype=np.int64)) * k
        if op == "convolution" and len(ins) > 1 and ins[1] and res:
            kernel = ins[1][0][1]
            per_out = int(np.prod(kernel, dtype=np.int64)) // max(
                kernel[_labels_out_dim(attrs, len(kernel))], 1)
            return 2 * int(np.prod(res[0][1], dtype=np.int64)) * per_out
        if op == "custom-call":
            t = _TARGET.search(attrs)
            where = _ONEDNN_CONV.get(t.group(1) if t else "")
            if where:
                y, w = ((res[0][1] if i == "result" else ins[i][0][1]) for i in where)
                # 2 x outputs x (kh kw cin); under vmap both carry the clients' leading axes,
                # and the kernel's (1 where shared) are not multiply-adds of an output
                return 2 * int(np.prod(y, dtype=np.int64)) * int(
                    np.prod(w[-4:-1], dtype=np.int64))
        return 0

    own = {name: flops(op, result, operands, attrs)
           for name, op, result, operands, attrs, _ in defs}
    by_comp: dict[str, int] = defaultdict(int)
    calls: dict[str, list[str]] = defaultdict(list)
    for name, _, _, _, attrs, comp in defs:
        by_comp[comp] += own[name]
        calls[comp] += _CALLS.findall(attrs)

    def inner(c: str, seen: frozenset = frozenset()) -> int:
        return by_comp.get(c, 0) + sum(inner(k, seen | {c}) for k in calls.get(c, ())
                                       if k not in seen)

    # Instructions inside a fusion or a reduction's scalar function run as part of their
    # caller: only the caller is an operation of the trace.
    inlined = {c for _, op, _, _, attrs, _ in defs for c in re.findall(
        r"(?:calls|to_apply)=%?([\w.\-]+)" if op == "fusion" else r"to_apply=%?([\w.\-]+)",
        attrs)}
    out = {}
    for name, op, result, operands, attrs, comp in defs:
        if op in CONTROL or comp in inlined:
            continue
        f = sum(inner(c) for c in _CALLS.findall(attrs)) if op == "fusion" else own[name]
        ins = [s for o in operand_shapes(operands) for s in o]
        target = _TARGET.search(attrs) if op == "custom-call" else None
        what = (target.group(1).removeprefix("fedjax_onednn_").removeprefix("fedjax_")
                if target else op)
        out[name] = {"flops": f, "bytes": _nbytes(_shapes(result)) + _nbytes(ins),
                     "what": f"{what}({', '.join(_shape_text(s) for s in ins)}) -> "
                             + ", ".join(_shape_text(s) for s in _shapes(result))}
    return out


def _shape_text(shape) -> str:
    return f"{shape[0]}[{','.join(map(str, shape[1]))}]"


def trace_file(log_dir: str | Path) -> Path:
    """The newest trace-event JSON ``jax.profiler.trace`` wrote under ``log_dir``."""
    found = sorted(Path(log_dir).glob("plugins/profile/*/perfetto_trace.json.gz")) or sorted(
        Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no trace-event JSON under {log_dir}/plugins/profile")
    return found[-1]


def load_events(path: str | Path) -> tuple[list[dict], dict]:
    """The complete events (``ph == "X"``) of a trace-event JSON file, and the names of its
    processes and threads (``{"pid": {pid: name}, "tid": {(pid, tid): name}}``)."""
    with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    names: dict = {"pid": {}, "tid": {}}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names["pid"][e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            names["tid"][(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    return [e for e in events if e.get("ph") == "X" and "dur" in e], names


def op_events(events: list[dict], names: dict) -> tuple[list[dict], str]:
    """The events that are the program's operations (module docstring), and where they ran:
    ``"device"`` (an accelerator's tracks) or ``"host"`` (a CPU's threads)."""
    devices = {pid for pid, n in names["pid"].items() if n.startswith("/device:")}
    if devices:
        def kept(e):
            track = names["tid"].get((e.get("pid"), e.get("tid")), "").lower()
            return e.get("pid") in devices and not track.startswith(DERIVED_TRACKS)

        return [e for e in events if kept(e)], "device"
    return [e for e in events if "hlo_op" in e.get("args", {})
            and not e.get("name", "").startswith("end: ")], "host"


def _hlo_op(args: dict) -> str:
    """The HLO operation an event ran: its ``hlo_op`` argument, else the innermost one named
    in an annotation argument (a GPU kernel's ``kernel_annotation``, e.g.
    ``while.2:#hlo_op=while.2#::fusion.3:#hlo_op=fusion.3,hlo_module=...#``), else ``""``."""
    if args.get("hlo_op"):
        return str(args["hlo_op"])
    for v in args.values():
        found = _ANNOTATED.findall(v) if isinstance(v, str) else []
        if found:
            return found[-1]
    return ""


def _category(hlo_op: str, name: str, categories: dict[str, str]) -> tuple[str, str]:
    """(category, the HLO operation that named it or ``""``): by the operation, else by a
    kernel named after its fusion (``loop_add_fusion_3`` for ``loop_add_fusion.3``: a kernel of
    a CUDA graph, whose annotation names only the graph's command buffer), else by the
    names."""
    for key in (hlo_op, name, re.sub(r"_(\d+)$", r".\1", name)):
        if key and key in categories:
            return categories[key], key
    return _by_name(f"{hlo_op} {name}"), ""


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def overlapped(placed: list[tuple[float, float, str, object]]) -> dict[str, float]:
    """Per category, the time its operations ran while an operation on another track (a CPU
    thread, a GPU stream) ran too: on a CPU, the time they shared the cores with another
    operation of the same program instead of having them to themselves (a oneDNN convolution
    sized for every core, say, beside an element-wise fusion). ``placed``: ``(start, end,
    category, track)`` in the trace's units."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    if not placed:
        return out
    starts = np.array([p[0] for p in placed], float)
    ends = np.array([p[1] for p in placed], float)
    tracks = {t: i for i, t in enumerate(dict.fromkeys(p[3] for p in placed))}
    track = np.array([tracks[p[3]] for p in placed])
    order = np.argsort(starts, kind="stable")
    starts_sorted, longest = starts[order], float(np.max(ends - starts))
    for a, b, cat, t in placed:
        # Operations that may overlap [a, b): those starting in [a - longest, b).
        near = order[np.searchsorted(starts_sorted, a - longest):
                     np.searchsorted(starts_sorted, b)]
        near = near[(ends[near] > a) & (starts[near] < b) & (track[near] != tracks[t])]
        out[cat] += _union(list(zip(np.maximum(starts[near], a), np.minimum(ends[near], b),
                                    strict=True)))
    return out


def summarise(events: list[dict], names: dict, categories: dict[str, str],
              top: int = 30, costs: dict[str, dict[str, int]] | None = None) -> dict:
    """Per-category time (seconds), shares of the summed operation time, the idle share of the
    span, the time each category shared with another track's operations (``overlapped``),
    and the ``top`` costliest operations (trace times are microseconds); with ``costs``
    (``hlo_costs``), each category's and each listed operation's FLOPs and bytes over the
    call, and the GFLOP/s and GB/s they ran at."""
    costs = costs or {}
    ops, where = op_events(events, names)
    per = dict.fromkeys(CATEGORIES, 0.0)
    count = dict.fromkeys(CATEGORIES, 0)
    by_op: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    intervals, named, placed = [], 0.0, []
    for e in ops:
        hlo_op = _hlo_op(e.get("args", {}))
        cat, hlo_name = _category(hlo_op, str(e.get("name", "")), categories)
        if cat == "control":
            continue
        placed.append((e["ts"], e["ts"] + e["dur"], cat, (e.get("pid"), e.get("tid"))))
        named += e["dur"] if hlo_name else 0.0
        per[cat] += e["dur"]
        count[cat] += 1
        key = (hlo_name or hlo_op or e.get("name", "?"), cat)
        by_op[key][0] += e["dur"]
        by_op[key][1] += 1
        intervals.append((e["ts"], e["ts"] + e["dur"]))
    work = {k: {"flops": 0, "bytes": 0} for k in CATEGORIES}
    for (op, cat), (_, n) in by_op.items():
        for key in ("flops", "bytes"):
            work[cat][key] += costs.get(op, {}).get(key, 0) * n
    total = sum(per.values())
    busy = _union(intervals)
    span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) if intervals else 0.0
    worst = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "where": where, "events": len(intervals),
        "op_s": total / 1e6, "span_s": span / 1e6, "busy_s": busy / 1e6,
        "idle_s": (span - busy) / 1e6, "idle_share_of_span": (span - busy) / span if span else 0,
        "seconds": {k: v / 1e6 for k, v in per.items()}, "counts": count,
        "overlapped_s": {k: v / 1e6 for k, v in overlapped(placed).items()},
        "shares": {k: (v / total if total else 0.0) for k, v in per.items()},
        "share_named_by_hlo": named / total if total else 0.0,
        "flops": {k: w["flops"] for k, w in work.items()},
        "gflop_s": {k: _rate(w["flops"], per[k]) for k, w in work.items()},
        "gb_s": {k: _rate(w["bytes"], per[k]) for k, w in work.items()},
        "top_ops": [{"op": k[0], "category": k[1], "s": v[0] / 1e6, "count": v[1],
                     **_op_rates(costs.get(k[0]), v)} for k, v in worst],
    }


def _rate(amount: float, microseconds: float) -> float:
    """Giga-units per second (``amount`` over ``microseconds`` of trace time)."""
    return amount / microseconds / 1e3 if microseconds else 0.0


def _op_rates(cost: dict | None, time_count: list) -> dict:
    if cost is None:
        return {}
    seconds, n = time_count
    return {"flops": cost["flops"], "bytes": cost["bytes"], "what": cost.get("what", ""),
            "gflop_s": _rate(cost["flops"] * n, seconds),
            "gb_s": _rate(cost["bytes"] * n, seconds)}


def profile(call: Callable[[], object], hlo_text: str, log_dir: str | Path,
            top: int = 30) -> dict:
    """Runs ``call`` (which must wait for its results) once under the JAX profiler and
    summarises the trace (``summarise``); adds the call's wall seconds and the trace's path
    and size."""
    import jax

    log_dir = Path(log_dir)
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
        t = time.perf_counter()
        call()
        wall = time.perf_counter() - t
    path = trace_file(log_dir)
    events, names = load_events(path)
    out = summarise(events, names, hlo_categories(hlo_text), top, hlo_costs(hlo_text))
    return {**out, "wall_s": wall, "trace": str(path), "trace_bytes": path.stat().st_size}

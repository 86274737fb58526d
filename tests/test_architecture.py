"""The package's import graph: no import cycle, and no arrow from a lower layer to a higher one.

Every ``import`` in the package, at module level or inside a function, is an arrow from the
importing module to the module it names (``from fedjax_rcl.x import y`` names the module
``fedjax_rcl.x.y`` when that is one, else ``fedjax_rcl.x``). Each module belongs to one layer
of ``LAYERS``; an arrow may point within its layer or down, never up. A new module must be given
a layer here, which is the moment to decide where it belongs.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fedjax_rcl"

# Lowest first. A prefix names a module or a whole subpackage.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("types", "validation", "registry", "interrupts", "console", "rundir",
                    "provenance")),
    ("data and numerics", ("data", "datasets", "nn", "losses", "metrics", "plots")),
    ("models", ("models",)),
    ("server", ("server",)),
    ("engine", ("engine", "checkpoint")),
    ("algorithms", ("algorithms",)),
    ("config", ("tracking", "config")),
    ("experiment", ("experiment", "mfcl", "report", "reference")),
    ("loop", ("loop",)),
    ("programs", ("training", "mfcl.run", "grid")),
    ("entry points", ("api", "suite", "cli", "__main__", "")),
    # The benchmark kit (tools/bench_*.py): above the simulator, which it may import; nothing
    # outside it imports it (test_the_simulator_never_imports_the_benchmark_kit).
    ("benchmark kit", ("bench",)),
]


def module_names() -> dict[str, Path]:
    """``{dotted name without 'fedjax_rcl.': path}``; a package's ``__init__`` is the package
    (the root package is ``""``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    if name != "fedjax_rcl" and not name.startswith("fedjax_rcl."):
        return None
    name = name[len("fedjax_rcl."):] if name != "fedjax_rcl" else ""
    while name not in modules:  # fedjax_rcl.x.attr -> fedjax_rcl.x
        if not name:
            return None
        name = name.rpartition(".")[0]
    return name


def import_graph() -> dict[str, set[str]]:
    """Every module's arrows to other modules of the package."""
    modules = module_names()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                resolved = _resolve(t, modules)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of the longest prefix naming ``module``."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            hit = module == p or (p and module.startswith(p + ".")) or (p == "" and module == "")
            if hit and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise AssertionError(f"fedjax_rcl.{module} has no layer: add it to LAYERS")
    return best


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for module in module_names():
        layer_of(module)


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_arrow_from_a_lower_layer_to_a_higher_one():
    back = sorted(f"fedjax_rcl.{a} ({LAYERS[layer_of(a)][0]}) -> fedjax_rcl.{b} "
                  f"({LAYERS[layer_of(b)][0]})"
                  for a, targets in import_graph().items() for b in targets
                  if layer_of(b) > layer_of(a))
    assert back == []


def test_the_simulator_never_imports_the_benchmark_kit():
    """``fedjax_rcl.bench`` (the PyTorch reference, the trace summary, the benchmark's FLOP
    counts) serves the benchmark tools; no module outside it imports it, the root package
    included: the simulator never depends on the benchmark."""
    def inside(module):
        return module == "bench" or module.startswith("bench.")

    arrows = sorted(f"fedjax_rcl.{a} -> fedjax_rcl.{b}" for a, targets in import_graph().items()
                    if not inside(a) for b in targets if inside(b))
    assert arrows == []


def test_the_checks_see_a_cycle_and_a_back_arrow():
    """The checks themselves: a planted cycle and a planted back-arrow are found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert layer_of("engine.round") > layer_of("models.resnet")
    assert layer_of("mfcl.run") > layer_of("mfcl.phase2")
    modules = module_names()
    assert _resolve("fedjax_rcl.engine.round.make_round", modules) == "engine.round"
    assert _resolve("fedjax_rcl.data.ImageDataset", modules) == "data"
    assert _resolve("numpy", modules) is None

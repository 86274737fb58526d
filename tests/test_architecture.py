"""The package's import graph: no import cycle, and no arrow from a lower layer to a higher one.

Every ``import`` in the package, at module level or inside a function, is an arrow from the
importing module to the module it names (``from fedjax_rcl.x import y`` names the module
``fedjax_rcl.x.y`` when that is one, else ``fedjax_rcl.x``). Each module belongs to one layer
of ``LAYERS``; an arrow may point within its layer or down, never up. A new module must be given
a layer here, which is the moment to decide where it belongs.

An import by a computed name (``importlib.import_module``, ``__import__``) is no import
statement, so the graph would not see it: only the modules of ``DYNAMIC_IMPORTS`` make one, and
none names a module of the package by a literal or an f-string, which an import statement says
where the graph sees it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fedjax_rcl"

# Lowest first. A prefix names a module or a whole subpackage.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("types", "validation", "fields", "registry", "interrupts", "console",
                    "rundir", "provenance")),
    ("data and numerics", ("data", "datasets", "nn", "losses", "metrics", "plots")),
    ("models", ("models",)),
    ("server", ("server",)),
    ("engine", ("engine", "checkpoint")),
    ("algorithms", ("algorithms",)),
    # Imports every package that registers what the config can name (the registry, at the
    # bottom, imports none of them).
    ("built-ins", ("builtins",)),
    ("config", ("tracking", "config")),
    ("experiment", ("experiment", "mfcl", "report", "reference")),
    ("loop", ("loop",)),
    ("programs", ("training", "mfcl.run", "grid", "programs")),
    ("entry points", ("api", "suite", "cli", "__main__", "")),
    # The benchmark kit (tools/bench_*.py): above the simulator, which it may import; nothing
    # outside it imports it (test_the_simulator_never_imports_the_benchmark_kit).
    ("benchmark kit", ("bench",)),
]


# The modules that import by a computed name, and what they import so. In these, each string that
# is exactly the dotted name of a module of the package is an arrow too.
DYNAMIC_IMPORTS = {
    "": "the lazy names of ``import fedjax_rcl`` (``_EXPORTS``, module names as strings)",
    "builtins": "the user's plugin modules that a config names (never one of the package)",
}
# The calls that import by a computed name.
IMPORT_CALLS = ("import_module", "__import__")
# The calls that register what the config can name (``fedjax_rcl.registry``).
REGISTER_CALLS = ("register_algorithm", "register_model", "register_server_optimizer",
                  "register_dataset", "register_choices")


def _called(node: ast.AST) -> str | None:
    """The name of the function a call calls (``f`` of ``f(...)`` and of ``m.f(...)``)."""
    if not isinstance(node, ast.Call):
        return None
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return node.func.id if isinstance(node.func, ast.Name) else None


def dynamic_imports(tree: ast.AST) -> list[tuple[int, str | None]]:
    """Each import by a computed name in ``tree``: its line and the literal start of the name
    (the whole literal, or an f-string's leading text; None: nothing literal)."""
    out = []
    for node in ast.walk(tree):
        if _called(node) not in IMPORT_CALLS:
            continue
        args = [*node.args, *(k.value for k in node.keywords if k.arg == "name")]
        arg = args[0] if args else None
        text = None
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            text = arg.value
        elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(
                arg.values[0], ast.Constant):
            text = arg.values[0].value
        out.append((node.lineno, text))
    return out


def _names_the_package(text: str | None) -> bool:
    """Whether the literal start of an imported name is (or begins) a name in the package."""
    return text is not None and (text.startswith("fedjax_rcl") or (
        bool(text) and "fedjax_rcl.".startswith(text)))


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
            if name in DYNAMIC_IMPORTS and isinstance(node, ast.Constant) and isinstance(
                    node.value, str) and node.value.startswith("fedjax_rcl."):
                if node.value[len("fedjax_rcl."):] in modules:
                    targets = [node.value]
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


def test_no_import_by_a_computed_name_but_where_sanctioned():
    """An import the graph cannot see: by a literal or an f-string naming a module of the
    package nowhere (an import statement says it), by a computed name only in the modules of
    ``DYNAMIC_IMPORTS``."""
    bad = []
    for module, path in sorted(module_names().items()):
        for line, text in dynamic_imports(ast.parse(path.read_text(), str(path))):
            if _names_the_package(text) or module not in DYNAMIC_IMPORTS:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports "
                           f"{text + '...' if text is not None else 'a computed name'}")
    assert bad == []


def test_the_built_ins_reach_every_module_that_registers():
    """``fedjax_rcl.builtins`` imports, directly or through the packages' lists, every module
    that registers something the config can name: one the lists forget would be unknown to
    the config."""
    graph = import_graph()
    registering = {m for m, path in module_names().items()
                   if any(_called(n) in REGISTER_CALLS
                          for n in ast.walk(ast.parse(path.read_text(), str(path))))}
    reached, todo = set(), ["builtins"]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo.extend(graph[m])
    assert registering and sorted(registering - reached) == []


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
    planted = ast.parse('importlib.import_module("fedjax_rcl.models.resnet")\n'
                        'import_module(f"fedjax_rcl.{name}")\n'
                        '__import__(name="fedjax_rcl")\n'
                        'importlib.import_module(f"{package}.{name}")\n'
                        'importlib.import_module("tensorboardX")\n')
    found = dynamic_imports(planted)
    assert found == [(1, "fedjax_rcl.models.resnet"), (2, "fedjax_rcl."), (3, "fedjax_rcl"),
                     (4, None), (5, "tensorboardX")]
    assert [_names_the_package(t) for _, t in found] == [True, True, True, False, False]

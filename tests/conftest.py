"""Shared fixtures: small synthetic datasets and configs that compile fast on CPU."""

import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from fedjax_rcl.data import ImageDataset


def shared_dir() -> Path:
    """The team's shared folder (``../shared`` next to the checkout), or $FEDJAX_RCL_SHARED."""
    return Path(os.environ.get("FEDJAX_RCL_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def toy_dataset(n_train=240, n_test=80, size=16, classes=4, seed=0) -> ImageDataset:
    """Learnable toy images: each class brightens its own quadrant, plus noise."""
    rng = np.random.default_rng(seed)

    def make(n):
        labels = rng.integers(0, classes, n).astype(np.int32)
        images = rng.integers(0, 90, (n, size, size, 3)).astype(np.int32)
        h = size // 2
        for c in range(classes):
            r, q = divmod(c, 2)
            images[labels == c, r * h:(r + 1) * h, q * h:(q + 1) * h, :] += 150
        return np.clip(images, 0, 255).astype(np.uint8), labels

    (xtr, ytr), (xte, yte) = make(n_train), make(n_test)
    return ImageDataset("toy", xtr, ytr, xte, yte, tuple(f"c{i}" for i in range(classes)),
                        (0.4, 0.4, 0.4), (0.3, 0.3, 0.3), True)


# Flags for XLA:CPU in the tests. They compile hundreds of small programs and run each for
# milliseconds to seconds, so LLVM's optimisation and XLA's new fusion emitters cost more than
# they save: at optimisation level 0 a FedRCL round of MOON's CNN compiles about 3x faster than
# at level 1 and 4x faster than with XLA's defaults, and both test steps take less time in all
# (BENCHMARKS.md, "Figures behind the code's choices"). Every comparison in a test compiles
# both sides under the same flags; tests that compare two programs compiled apart allow for
# float reassociation (a ReLU input at 0 can turn 1e-8 into 1e-5 a round later).
# FEDJAX_RCL_TEST_XLA_DEFAULTS=1 keeps XLA's defaults, the configuration users run.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


# Tests never use the user's cache: one fresh directory for the whole run, shared by every
# xdist worker and every process the tests start ($FEDJAX_RCL_CACHE when it is set). It holds
# the decoded datasets, the oneDNN extension (built once: its build takes a file lock) and
# JAX's persistent compilation cache, so a program one worker compiled (a fixture's run, a
# CLI call's round) is loaded, not compiled again, by the other worker and by subprocesses.
_CACHE_KEY = "fedjax_rcl_cache"
_made_cache: list[str] = []  # the directory this process made (removed when the run ends)
_prebuild: list[subprocess.Popen] = []  # the oneDNN build started for the workers


def _run_cache(config) -> str:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and _CACHE_KEY in workerinput:  # an xdist worker
        return workerinput[_CACHE_KEY]
    if not os.environ.get("FEDJAX_RCL_CACHE"):  # the controller, or a run without xdist
        _made_cache.append(tempfile.mkdtemp(prefix="fedjax-rcl-test-cache-"))
        return _made_cache[0]
    return os.environ["FEDJAX_RCL_CACHE"]


def pytest_configure(config):
    os.environ["FEDJAX_RCL_CACHE"] = _run_cache(config)
    if getattr(config, "workerinput", None) is None:
        # The oneDNN extension, which the first convolution any test traces needs, is built
        # into the fresh cache while the workers start and collect, not after (its build lock
        # makes whoever needs it meanwhile wait for this build).
        _prebuild.append(subprocess.Popen(
            [sys.executable, "-c", "from fedjax_rcl.nn import onednn; onednn.available()"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    import jax

    # Concurrent writers are safe: JAX writes an entry in place (not by a rename), zlib-
    # compressed, so a reader that meets one half written (or two writers of one entry) gets
    # a failed decompression, which JAX reports as a warning and answers by compiling.
    jax.config.update("jax_compilation_cache_dir",
                      str(Path(os.environ["FEDJAX_RCL_CACHE"]) / "jax"))
    # Every program is cached, however fast it compiled: the tests compile the same small
    # programs (evaluations, one-step rounds) again in other tests and subprocesses.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    # Read when XLA's CPU backend starts (the first device use), after this hook; subprocesses
    # that tests start inherit it.
    flags = os.environ.get("XLA_FLAGS", "")
    if (FAST_COMPILE_FLAGS not in flags
            and os.environ.get("FEDJAX_RCL_TEST_XLA_DEFAULTS") != "1"):
        os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE_FLAGS}".strip()
    # Tracing a program allocates hundreds of thousands of short-lived Python objects, and
    # with the default thresholds (700 allocations) the cyclic collector runs thousands of
    # times per test file, each time over everything the imports and earlier tests left alive.
    # The objects alive now (the imported modules) are moved out of its sight and it runs at
    # most every 100,000 allocations (BENCHMARKS.md, "Figures behind the code's choices").
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller: every worker uses the controller's cache directory."""
    node.workerinput[_CACHE_KEY] = os.environ["FEDJAX_RCL_CACHE"]


def pytest_unconfigure(config):
    for proc in _prebuild:
        proc.wait()
    for path in _made_cache:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def toy():
    return toy_dataset()


# The tests' shared tiny run: FedAvg on 4 digits clients, 2 a round, one local epoch.
TINY_RUN = ("dataset=digits", "algorithm=fedavg", "num_clients=4", "participation=0.5",
            "local_epochs=1", "partition=iid")


@pytest.fixture(scope="session")
def tiny_run(request, tmp_path_factory) -> Path:
    """``TINY_RUN`` trained to round 4, checkpoints at rounds 0, 2 and 4: one finished run
    that every test needing one reads, trained once per test session. The first worker to
    need it trains it into the session's cache directory under a file lock (the other waits
    for it); each worker then reads its own copy, so no two processes ever open one run
    directory. Tests read it or copy it; none changes it."""
    import fcntl

    import fedjax_rcl

    workerinput = getattr(request.config, "workerinput", {})
    session = workerinput.get("testrunuid") or f"pid{os.getpid()}"  # shared by the workers
    shared = Path(os.environ["FEDJAX_RCL_CACHE"]) / f"tiny_run-{session}"
    shared.mkdir(parents=True, exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not (shared / "done").exists():
            shutil.rmtree(shared / "run", ignore_errors=True)
            fedjax_rcl.train(None, *TINY_RUN, "rounds=4", "checkpoint_every=2",
                             f"run_dir={shared / 'run'}")
            (shared / "done").touch()
    run = tmp_path_factory.mktemp("tiny_run") / "run"
    shutil.copytree(shared / "run", run)
    return run


def _plugin_modules(entries) -> set[str]:
    """Top-level names of the user modules that registered ``entries`` (a plugin's entries name
    it as their origin; a model's, which has none, is its builder's module), not the package's
    own modules or the tests'."""
    import sys

    tests = Path(__file__).resolve().parent
    out = set()
    for e in entries:
        build = getattr(e, "build", None) or getattr(e, "loader", None)
        for name in (getattr(e, "origin", None), getattr(build, "__module__", None)):
            top = (name or "fedjax_rcl").split(".")[0]
            origin = getattr(sys.modules.get(top), "__file__", None)
            if top != "fedjax_rcl" and not (origin and Path(origin).resolve().is_relative_to(
                    tests)):
                out.add(top)
    return out


def _builtin(entry) -> bool:
    """Whether a fresh process has ``entry``: registered by the package itself."""
    build = getattr(entry, "build", None) or getattr(entry, "loader", None)
    return (getattr(entry, "origin", None) is None
            and getattr(build, "__module__", "").startswith("fedjax_rcl."))


@pytest.fixture
def fresh_registry():
    """Returns ``fresh()``, which puts this process in the state a freshly started
    ``fedjax-rcl`` process has: only the built-in algorithms, models, server optimizers and
    datasets registered, no plugin module imported (naming one imports and registers it
    again) and ``sys.path`` as it was when the test started (``load_plugins`` appends the
    directories it searched). Tests call it where they would otherwise start an interpreter
    only to get that state; the registry, the plugin modules and ``sys.path`` are restored
    when the test ends."""
    import importlib
    import sys

    from fedjax_rcl import builtins, registry

    builtins.load()
    tables = (registry.ALGORITHMS, registry.MODELS, registry.SERVER_OPTIMIZERS,
              registry.DATASETS)
    saved = [dict(t) for t in tables]
    saved_path, saved_modules = list(sys.path), dict(sys.modules)
    plugins = _plugin_modules(e for t in saved for e in t.values())

    def fresh() -> None:
        entries = [e for t in tables for e in t.values()]
        forget = _plugin_modules(entries)
        plugins.update(forget)
        for name in [m for m in sys.modules if m.split(".")[0] in forget]:
            del sys.modules[name]
        for t in tables:
            for name in [n for n, e in t.items() if not _builtin(e)]:
                del t[name]
        registry.version += 1  # the config schema is rebuilt from the remaining entries
        sys.path[:] = saved_path
        importlib.invalidate_caches()

    yield fresh
    plugins.update(_plugin_modules(e for t in tables for e in t.values()))
    for name in [m for m in sys.modules if m.split(".")[0] in plugins]:
        del sys.modules[name]
    sys.modules.update({m: mod for m, mod in saved_modules.items()
                        if m.split(".")[0] in plugins})
    for t, entries in zip(tables, saved, strict=True):
        t.clear()
        t.update(entries)
    registry.version += 1
    sys.path[:] = saved_path

"""Shared fixtures: small synthetic datasets and configs that compile fast on CPU."""

import os
import shutil
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
# milliseconds to seconds, so XLA's full LLVM optimisation and its new fusion emitters cost
# more than they save: a FedAvg round of MOON's CNN compiles in 1.6 s instead of 5.5 s, and
# the slow step (-m slow, long end-to-end runs) takes less time in all, though its MFCL runs,
# the most compute-bound, take longer (BENCHMARKS.md, "Figures behind the code's choices").
# Level 1, not 0: at level 0 a MOON round moved its output by 2e-4 when the global weights
# moved by 1e-8, in the engine and in the client-by-client reference alike (at levels 1 and 2
# by 4e-8). Every comparison in a test compiles both sides under the same flags.
# FEDJAX_RCL_TEST_XLA_DEFAULTS=1 keeps XLA's defaults, the configuration users run.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"


# Tests never use the user's cache: one fresh directory for the whole run, shared by every
# xdist worker and every process the tests start ($FEDJAX_RCL_CACHE when it is set). It holds
# the decoded datasets, the oneDNN extension (built once: its build takes a file lock) and
# JAX's persistent compilation cache, so a program one worker compiled (a fixture's run, a
# CLI call's round) is loaded, not compiled again, by the other worker and by subprocesses.
_CACHE_KEY = "fedjax_rcl_cache"
_made_cache: list[str] = []  # the directory this process made (removed when the run ends)


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
    import jax

    # Concurrent writers are safe: JAX writes an entry in place (not by a rename), zlib-
    # compressed, so a reader that meets one half written (or two writers of one entry) gets
    # a failed decompression, which JAX reports as a warning and answers by compiling.
    jax.config.update("jax_compilation_cache_dir",
                      str(Path(os.environ["FEDJAX_RCL_CACHE"]) / "jax"))
    # Read when XLA's CPU backend starts (the first device use), after this hook; subprocesses
    # that tests start inherit it.
    flags = os.environ.get("XLA_FLAGS", "")
    if (FAST_COMPILE_FLAGS not in flags
            and os.environ.get("FEDJAX_RCL_TEST_XLA_DEFAULTS") != "1"):
        os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE_FLAGS}".strip()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller: every worker uses the controller's cache directory."""
    node.workerinput[_CACHE_KEY] = os.environ["FEDJAX_RCL_CACHE"]


def pytest_unconfigure(config):
    for path in _made_cache:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def toy():
    return toy_dataset()

"""A pytest plugin: per test file, the wall time of its tests and what JAX spent tracing,
lowering and compiling in them (``jax.monitoring``'s duration events), and how many programs
were compiled and read from the persistent cache. Each process writes one JSON file.

    PYTHONPATH=experiments/test_step JAX_TIME_OUT=/tmp/jt \\
        python -m pytest -q -n 2 -p jax_time_per_file

Sum the files of every worker for the whole step (``jax_time_per_file_<commit>.tsv``)."""

import collections
import json
import os
import time
from pathlib import Path

import pytest

_current = ["<collect>"]
_seconds = collections.defaultdict(lambda: collections.defaultdict(float))
_counts = collections.defaultdict(collections.Counter)


def _duration(event, duration, **kwargs):
    _seconds[_current[0]][event] += duration
    _counts[_current[0]][event] += 1


def _event(event, **kwargs):
    _counts[_current[0]][event] += 1


def pytest_configure(config):
    import jax

    jax.monitoring.register_event_duration_secs_listener(_duration)
    jax.monitoring.register_event_listener(_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid.split("::")[0]
    start = time.perf_counter()
    yield
    _seconds[_current[0]]["wall"] += time.perf_counter() - start
    _counts[_current[0]]["tests"] += 1


def pytest_unconfigure(config):
    out = Path(os.environ.get("JAX_TIME_OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    files = set(_seconds) | set(_counts)
    (out / f"jax_time_{os.getpid()}.json").write_text(json.dumps(
        {f: {"t": dict(_seconds[f]), "n": dict(_counts[f])} for f in files}))

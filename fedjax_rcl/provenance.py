"""What a run ran on: the command, the machine and the package versions, one record per process.

A result is only comparable with another when both say where they came from: float results
drift between CPU classes (AVX2 against AVX-512 reassociate sums differently), speeds differ
by machine, and a dependency's new release may change a kernel. So every process that trains
in a run directory (``train``, each ``resume``, ``mfcl``) appends

* its command line to ``commands.txt`` (the first line is the command that created the run),
* one JSON line to ``environment.jsonl``: the command, the UTC start time, the round it
  started from, the working directory and where its plugins were imported from (``resume``
  and ``eval`` look there too), the processor (model name, family/model numbers, the vector
  extensions that change numerics or speed), the JAX backend and its devices, and the
  versions of Python and of the packages that compute results (with the project's git commit
  when it runs from a checkout), and the SHA-256 of a split file the run trains on.

Both files are appended, never rewritten, so a resumed run keeps the record of every process.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

from fedjax_rcl.rundir import RunDir, read_jsonl

# The packages whose versions can change a result or a speed.
PACKAGES = ("fedjax-rcl", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy",
            "onednn-devel-cpu-gomp", "jax-cuda12-plugin", "jax-cuda13-plugin")
# CPU flags worth recording: the vector widths and low-precision units XLA and oneDNN use.
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8")


def cpu() -> dict:
    """The processor: model name, vendor family/model numbers, logical cores, vector flags."""
    info: dict = {"machine": platform.machine(), "cores": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {**info, "model_name": platform.processor() or None}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {**info, "model_name": fields.get("model name"),
            "family": fields.get("cpu family"), "model": fields.get("model"),
            "flags": [f for f in _CPU_FLAGS if f in flags]}


def versions() -> dict:
    """Python's and the result-relevant packages' versions (installed ones only)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def git_commit() -> str | None:
    """The commit of the checkout this package runs from (None outside a git checkout)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def devices() -> dict:
    """JAX's backend and its devices' kinds (``NVIDIA H200``, ``cpu``)."""
    import jax

    kinds = sorted({d.device_kind for d in jax.devices()})
    return {"backend": jax.default_backend(), "device_count": jax.device_count(),
            "device_kinds": kinds}


def file_sha256(path: str | os.PathLike[str]) -> str | None:
    """The SHA-256 of a file's contents, None if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


# Environment variables of the thread runtimes under the oneDNN kernels (OpenMP) and of oneDNN
# itself: they decide how fast a CPU round runs (OMP_WAIT_POLICY, the threads' count), and some
# (a thread count) can decide how a convolution's sums are split.
THREADS_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "DNNL_", "ONEDNN_")


def threads_env() -> dict[str, str]:
    """This process's settings of the variables ``THREADS_ENV_PREFIXES`` names."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(THREADS_ENV_PREFIXES)}


def environment(command: str | None, first_round: int, plugins=(), inputs=(),
                compiler_options=None, layout=None) -> dict:
    """One ``environment.jsonl`` record for a process starting at ``first_round``: also the
    working directory, where the run's ``plugins`` were imported from, the SHA-256 of each
    input file the config names beside the dataset (``inputs``: a split file), so that a
    committed run says which file it trained on where its path alone cannot, the XLA
    settings its programs compiled with (``$XLA_FLAGS`` and the model's
    ``compiler_options``), which can move results at the rounding level, the thread runtimes'
    variables (``threads_env``), and the clients'
    ``layout`` local training ran in (``{"clients_in_parallel": n, "describe": text}``), which
    can too, and which a resumed run keeps (``recorded_layout``)."""
    from fedjax_rcl import registry

    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    out = {"command": command, "started_utc": now.isoformat(), "first_round": first_round,
           "cwd": os.getcwd(), "plugin_dirs": registry.plugin_dirs(plugins), "cpu": cpu(),
           **devices(), "versions": versions(), "git_commit": git_commit(),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "threads_env": threads_env()}
    if compiler_options is not None:
        out["compiler_options"] = dict(compiler_options)
    if layout is not None:
        out["layout"] = dict(layout)
    if inputs:
        out["input_sha256"] = {str(p): file_sha256(p) for p in inputs}
    return out


def record(run_dir: str | Path, command: str | None, first_round: int, plugins=(),
           inputs=(), compiler_options=None, layout=None) -> None:
    """Appends this process's command and environment to the run directory's records."""
    run = RunDir(run_dir)
    if command:
        with open(run.commands, "a") as f:
            f.write(command + "\n")
    with open(run.environment, "a") as f:
        f.write(json.dumps(environment(command, first_round, plugins, inputs,
                                      compiler_options, layout)) + "\n")


def recorded_layout(run_dir: str | Path, backend: str,
                    key: str = "clients_in_parallel") -> int | None:
    """The clients' layout (``clients_in_parallel``: 0 for all side by side; a grid's also
    ``runs_in_parallel``) that the first of a run's processes on ``backend`` recorded, None if
    none did (a run recorded before layouts were, or one moving to another kind of device,
    where the results change anyway): what ``resume`` keeps, so that a refit of the layout
    cost model (``fedjax_rcl.engine.layout``) does not change a run in progress."""
    for record in read_jsonl(RunDir(run_dir).environment):
        if record.get("backend") == backend and key in record.get("layout", {}):
            return int(record["layout"][key])
    return None


def recorded_plugin_dirs(run_dir: str | Path) -> tuple[str, ...]:
    """The directories a run's processes imported its plugins from, and ran in (newest
    first): where ``resume`` and ``eval`` look for the plugins a run names."""
    dirs: list[str] = []
    for record in reversed(read_jsonl(RunDir(run_dir).environment)):
        dirs += [*record.get("plugin_dirs", {}).values(), record.get("cwd")]
    return tuple(d for d in dict.fromkeys(dirs) if d)

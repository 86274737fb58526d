"""oneDNN convolutions on CPU, called from compiled JAX programs through XLA's FFI.

XLA:CPU's own convolution is fast only in its forward form; its kernel gradient inside
``lax.scan`` takes a slow generic path (jax-ml/jax#12868), and the patch formulation that
replaces it materialises ``k_h * k_w`` copies of every activation (benchmarks/HISTORY.md).
oneDNN, the library behind PyTorch's CPU convolutions, runs the forward, input-gradient and
kernel-gradient convolutions as direct JIT kernels without those copies. This module builds a
small C++ extension (``csrc/onednn_conv.cc``) against the oneDNN wheel on first use, caches it,
and registers three FFI targets; ``fedjax_rcl.nn.conv.onednn_conv_general_dilated`` composes
them into a differentiable convolution. The same library carries the GroupNorm kernels of
``csrc/group_norm.cc`` (two more targets, ``fedjax_rcl.nn.group_norm``): XLA:CPU's fused
reductions need their inputs materialised, and a differentiated GroupNorm reads and writes each
activation about ten times where a hand-written kernel needs four passes. The pool kernel of
``csrc/max_pool.cc`` (``fedjax_rcl.nn.pool``), the narrow convolutions of ``csrc/narrow_conv.cc``
(``fedjax_rcl.nn.narrow_conv``) and the training augmentation of ``csrc/augment.cc``
(``fedjax_rcl.data.augment``) are built into the same library.

The build needs a C++17 compiler (``$CXX`` or ``g++``), jaxlib's FFI headers and the
``onednn-devel-cpu-gomp`` wheel (a dependency on x86-64 Linux). When any of them is missing,
``available()`` is False, ``unavailable_reason()`` says why, and ``conv_impl=auto`` uses the
patch convolution instead. The compiled library is cached in ``$FEDJAX_RCL_CACHE/ext`` (or
``~/.cache/fedjax_rcl/ext``) under a hash of everything that shapes it; concurrent processes
build it once (a file lock) and never load it half written (an atomic rename).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.metadata
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import numpy as np

SOURCE = Path(__file__).parent / "csrc" / "onednn_conv.cc"
GROUP_NORM_SOURCE = Path(__file__).parent / "csrc" / "group_norm.cc"
MAX_POOL_SOURCE = Path(__file__).parent / "csrc" / "max_pool.cc"
NARROW_CONV_SOURCE = Path(__file__).parent / "csrc" / "narrow_conv.cc"
AUGMENT_SOURCE = Path(__file__).parent / "csrc" / "augment.cc"
# FFI target name -> exported handler symbol: the convolutions, then the GroupNorm kernels.
TARGETS = {
    "fedjax_onednn_conv_forward": "FedjaxOnednnConvForward",
    "fedjax_onednn_conv_backward_data": "FedjaxOnednnConvBackwardData",
    "fedjax_onednn_conv_backward_weights": "FedjaxOnednnConvBackwardWeights",
}
GROUP_NORM_TARGETS = {
    "fedjax_group_norm_forward": "FedjaxGroupNormForward",
    "fedjax_group_norm_backward": "FedjaxGroupNormBackward",
}
MAX_POOL_TARGETS = {
    "fedjax_bias_relu_max_pool_forward": "FedjaxBiasReluMaxPoolForward",
    "fedjax_bias_relu_max_pool_backward": "FedjaxBiasReluMaxPoolBackward",
}
NARROW_CONV_TARGETS = {
    "fedjax_narrow_conv_forward": "FedjaxNarrowConvForward",
    "fedjax_narrow_conv_backward_data": "FedjaxNarrowConvBackwardData",
}
AUGMENT_TARGETS = {"fedjax_augment_images": "FedjaxAugmentImages"}
_HEADERS_DIST, _LIBRARY_DIST = "onednn-devel-cpu-gomp", "onednn-cpu-gomp"


class OneDnnUnavailable(RuntimeError):
    """The oneDNN extension cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    # The cache root as fedjax_rcl.data.cache.default_cache_dir chooses it (nn sits below data).
    root = os.environ.get("FEDJAX_RCL_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedjax_rcl"
    return Path(root) / "ext"


def _dist_file(dist: str, suffix: str) -> Path:
    """The installed file of distribution ``dist`` whose path ends with ``suffix``."""
    try:
        files = importlib.metadata.distribution(dist).files or ()
    except importlib.metadata.PackageNotFoundError:
        raise OneDnnUnavailable(f"the {dist} package is not installed") from None
    for f in files:
        # RECORD paths are relative to site-packages ("../../libdnnl.so.3").
        path = Path(os.path.normpath(f.locate()))
        if path.as_posix().endswith(suffix) and path.exists():
            return path
    raise OneDnnUnavailable(f"{dist} is installed but has no {suffix}")


def _build_inputs() -> dict:
    """Everything the build reads: compiler, include directories, the library to link."""
    cxx = shlex.split(os.environ.get("CXX") or "g++")  # $CXX may carry flags ("ccache g++")
    compiler = shutil.which(cxx[0]) if cxx else None
    if compiler is None:
        raise OneDnnUnavailable(f"no C++ compiler ({os.environ.get('CXX') or 'g++'}) on PATH")
    dnnl_hpp = _dist_file(_HEADERS_DIST, "include/oneapi/dnnl/dnnl.hpp")
    libdnnl = _dist_file(_LIBRARY_DIST, "lib/libdnnl.so.3")
    return {
        "cxx": [compiler, *cxx[1:]],
        "dnnl_include": dnnl_hpp.parents[2],  # .../include (dnnl.hpp lives in oneapi/dnnl/)
        "ffi_include": Path(jax.ffi.include_dir()),
        "libdnnl": libdnnl,
    }


def _build(inputs: dict) -> Path:
    """Compiles the extension into the cache (once per source, jaxlib and oneDNN) and returns
    its path."""
    digest = hashlib.sha256()
    for source in _sources():
        digest.update(source.read_bytes())
    for key in ("cxx", "dnnl_include", "ffi_include", "libdnnl"):
        digest.update(str(inputs[key]).encode())
    digest.update(jax.__version__.encode())
    out = cache_dir() / f"fedjax_onednn-{digest.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):  # concurrent processes: one compiles, the others wait and load it
        if not out.exists():
            _compile(inputs, out)
    return out


@contextlib.contextmanager
def _build_lock(out: Path):
    """An exclusive ``flock`` on ``out``'s lock file (none where ``fcntl`` is missing: the
    atomic rename alone keeps concurrent builds harmless there)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(out.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed
        yield


def _compile(inputs: dict, out: Path) -> None:
    """Compiles the sources into ``out``: with OpenMP (the GroupNorm kernels run the samples
    on every core), or, where the compiler cannot link it, without (the same kernels on one
    core). Each source compiles in its own process, side by side, then one link."""
    libdir = inputs["libdnnl"].parent
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        for openmp in (["-fopenmp"], []):
            flags = [*inputs["cxx"], "-O3", "-std=c++17", "-fPIC", *openmp, "-w"]
            objects = [Path(tmp) / f"{source.stem}.o" for source in _sources()]
            compiles = [subprocess.Popen(
                [*flags, "-isystem", str(inputs["ffi_include"]), "-isystem",
                 str(inputs["dnnl_include"]), "-c", str(source), "-o", str(obj)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for source, obj in zip(_sources(), objects, strict=True)]
            errors = [err if p.returncode else "" for p in compiles
                      for _, err in [p.communicate()]]
            if not any(errors):
                proc = subprocess.run(
                    [*flags, "-shared", *map(str, objects), "-o", str(tmp_out), f"-L{libdir}",
                     f"-l:{inputs['libdnnl'].name}", f"-Wl,-rpath,{libdir}"],
                    capture_output=True, text=True)
                if proc.returncode == 0:
                    break
                errors = [proc.stderr]
        else:
            names = ", ".join(source.name for source in _sources())
            raise OneDnnUnavailable(f"building {names} failed:\n{''.join(errors)[-2000:]}")
        os.replace(tmp_out, out)  # atomic: a reader never sees a half-written library


def _sources() -> tuple[Path, ...]:
    return (SOURCE, GROUP_NORM_SOURCE, MAX_POOL_SOURCE, NARROW_CONV_SOURCE, AUGMENT_SOURCE)


def _libgomp_loaded() -> bool:
    """Whether this process has loaded the system's OpenMP runtime (it reads its environment
    once, when it loads)."""
    try:
        return "/libgomp.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def set_thread_env(env: dict[str, str]) -> dict[str, str]:
    """Sets ``env``, variables of the OpenMP runtime under the kernels, in this process's
    environment before the extension loads the runtime: not where the user set any of them, nor
    once the runtime is loaded (it has read its environment then; a process keeps the first
    model's). Returns what it set. A model's ``cpu_thread_env`` (``registry.ModelEntry``) comes
    here from ``experiment.build``; each run's process records the variables
    (``environment.jsonl``'s ``threads_env``)."""
    if not env or any(k in os.environ for k in env) or _libgomp_loaded():
        return {}
    os.environ.update(env)
    return dict(env)


@functools.lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | OneDnnUnavailable:
    """Builds (if needed), loads and registers the extension once per process; returns the
    library, or the reason it is unavailable."""
    try:
        lib = ctypes.CDLL(str(_build(_build_inputs())))
        for target, symbol in {**TARGETS, **GROUP_NORM_TARGETS, **MAX_POOL_TARGETS,
                               **NARROW_CONV_TARGETS, **AUGMENT_TARGETS}.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
        return lib
    except OneDnnUnavailable as e:
        return e
    except (OSError, AttributeError) as e:
        return OneDnnUnavailable(f"loading the oneDNN extension failed: {e}")


def available() -> bool:
    """Whether the oneDNN convolutions can run in this process (builds them on first call)."""
    return not isinstance(_load(), OneDnnUnavailable)


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    loaded = _load()
    return str(loaded) if isinstance(loaded, OneDnnUnavailable) else None


def version() -> str:
    """The oneDNN version the extension runs, e.g. ``"3.2.0"``."""
    lib = _library()
    v = lib.FedjaxOnednnVersion()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def library() -> ctypes.CDLL:
    """The loaded extension (built on first use): its C functions beside the FFI targets
    (``FedjaxOnednnVersion``, ``FedjaxNarrowConvIsa``)."""
    return _library()


def _library() -> ctypes.CDLL:
    loaded = _load()
    if isinstance(loaded, OneDnnUnavailable):
        raise loaded
    return loaded


def call(target: str, result_shapes, *operands, vmap_method: str = "sequential",
         **attributes):
    """Calls one of the extension's FFI targets; ``result_shapes`` a ``ShapeDtypeStruct`` or a
    tuple of them (the results likewise). Under vmap (clients side by side) the call runs
    once per client by default (``"sequential"``, XLA's loop over the clients); a target that
    takes leading batch axes itself says ``"broadcast_all"`` or ``"expand_dims"``
    (``jax.ffi.ffi_call``'s ``vmap_method``): the convolutions and the pool kernel do."""
    _library()  # registers the targets before the call is traced
    out = jax.ffi.ffi_call(target, result_shapes, vmap_method=vmap_method)(*operands,
                                                                          **attributes)
    # Inside shard_map an FFI result is typed device-invariant; it varies over the mesh axes
    # its operands vary over (what autodiff inside shard_map relies on).
    varying = frozenset().union(*map(_varying_axes, operands))

    def cast(r):
        extra = varying - _varying_axes(r)
        return jax.lax.pcast(r, tuple(sorted(extra)), to="varying") if extra else r

    return jax.tree.map(cast, out)


def _call(target: str, out_shape, *operands, strides, padding):
    (pt, pb), (pl, pr) = padding
    sh, sw = strides
    # Under vmap the handlers take every client in one call, looping over them on slices of
    # the stacked buffers (csrc/onednn_conv.cc); an unbatched operand comes with axes of 1.
    return call(target, jax.ShapeDtypeStruct(out_shape, operands[0].dtype), *operands,
                vmap_method="expand_dims", stride_h=np.int64(sh), stride_w=np.int64(sw),
                pad_top=np.int64(pt), pad_bottom=np.int64(pb), pad_left=np.int64(pl),
                pad_right=np.int64(pr))


def _varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # the attribute's name in other jax versions
    return frozenset(vma if vma is not None else aval.manual_axis_type.varying)


@functools.cache
def supports(dtype) -> bool:
    """Whether oneDNN runs convolutions in ``dtype`` on this CPU (float32 always; bfloat16 and
    float16 where the CPU has the instructions oneDNN needs): a tiny forward and both
    gradients are tried once, eagerly, also when first asked while a program is being traced
    (a probe staged into that program would fail at run time instead of here)."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return available()
    if not available() or dtype not in (np.dtype(jax.numpy.bfloat16), np.dtype(np.float16)):
        return False
    pad = ((1, 1), (1, 1))
    try:
        with jax.ensure_compile_time_eval():
            x = jax.numpy.ones((1, 6, 6, 8), dtype)
            w = jax.numpy.ones((3, 3, 8, 8), dtype)
            y = conv_forward(x, w, (1, 1), pad)
            jax.block_until_ready((y, conv_backward_data(y, w, x.shape, (1, 1), pad),
                                   conv_backward_weights(x, y, w.shape, (1, 1), pad)))
    except Exception:  # oneDNN has no kernel for this type on this CPU
        return False
    return True


def conv_forward(x: jax.Array, w: jax.Array, strides, padding) -> jax.Array:
    """``y = conv(x, w)``: NHWC ``x``, HWIO ``w``, explicit ``((lo, hi), (lo, hi))`` padding."""
    kh, kw, _, cout = w.shape
    (pt, pb), (pl, pr) = padding
    ho = (x.shape[1] + pt + pb - kh) // strides[0] + 1
    wo = (x.shape[2] + pl + pr - kw) // strides[1] + 1
    return _call("fedjax_onednn_conv_forward", (x.shape[0], ho, wo, cout), x, w,
                 strides=strides, padding=padding)


def conv_backward_data(dy: jax.Array, w: jax.Array, input_shape, strides, padding) -> jax.Array:
    """The input gradient of ``conv_forward`` at kernel ``w`` for output gradient ``dy``."""
    return _call("fedjax_onednn_conv_backward_data", tuple(input_shape), dy, w,
                 strides=strides, padding=padding)


def conv_backward_weights(x: jax.Array, dy: jax.Array, kernel_shape, strides,
                          padding) -> jax.Array:
    """The kernel gradient of ``conv_forward`` at input ``x`` for output gradient ``dy``."""
    return _call("fedjax_onednn_conv_backward_weights", tuple(kernel_shape), x, dy,
                 strides=strides, padding=padding)

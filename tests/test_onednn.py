"""The oneDNN convolutions: they build here, run inside the compiled programs the engine makes
(jit, scan, vmap, shard_map), are deterministic, and fall back cleanly when unavailable.

Their values and gradients against XLA's convolution on many geometries are in test_conv.py.
"""

import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fedjax_rcl.config import Config, ConfigError, validate
from fedjax_rcl.nn import conv, onednn

DN = ("NHWC", "HWIO", "NHWC")
PAD = ((1, 1), (1, 1))
MUST_BUILD = sys.platform == "linux" and platform.machine() == "x86_64"

needs_onednn = pytest.mark.skipif(
    not MUST_BUILD, reason="the oneDNN wheel (onednn-devel-cpu-gomp) is for x86-64 Linux only")


def _native(x, w, strides=(1, 1), padding=PAD):
    return lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=DN)


def _ours(x, w, strides=(1, 1), padding=PAD):
    return conv.onednn_conv_general_dilated(x, w, strides, padding)


def _data(seed=0, shape=(4, 10, 10, 8), kernel=(3, 3, 8, 6)):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, shape)
    w = jax.random.normal(kw, kernel) / np.sqrt(np.prod(kernel[:3]))
    return x, w


@needs_onednn
def test_extension_builds_here():
    """On x86-64 Linux the extension must build: a silent fallback would hide a 2x slowdown."""
    assert onednn.available(), onednn.unavailable_reason()
    assert onednn.unavailable_reason() is None
    assert onednn.version().startswith("3.")


@needs_onednn
@pytest.mark.parametrize(("model", "user"), [
    ("moon_cnn", {}), ("moon_cnn", {"GOMP_SPINCOUNT": "0"}), ("resnet10", {})])
def test_a_models_thread_env_is_set_before_the_runtime_loads_unless_the_user_set_one(model, user):
    """A fresh process building a run of MOON's CNN sets its ``cpu_thread_env`` (OpenMP's spin)
    before the OpenMP runtime loads, so the runtime runs with it; a variable the user set
    leaves them all alone, and a model without one (a ResNet) sets nothing."""
    from fedjax_rcl import registry
    from fedjax_rcl.models import get_model  # noqa: F401  (registers the models)

    names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    env = {k: v for k, v in os.environ.items() if k not in names} | user
    code = ("import json, os\nfrom fedjax_rcl.config import load_config\n"
            "from fedjax_rcl.experiment import build\nfrom fedjax_rcl.nn import onednn\n"
            f"build(load_config(None, ['model={model}', 'num_clients=2', 'rounds=1']))\n"
            "assert onednn.available() and onednn._libgomp_loaded()\n"
            f"print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    wanted = dict(registry.model(model).cpu_thread_env)
    want = {k: user.get(k) for k in names} if user else {k: wanted.get(k) for k in names}
    assert json.loads(out.splitlines()[-1]) == want
    assert (model == "moon_cnn") == bool(wanted)


@needs_onednn
def test_kernel_gradients_inside_scan_match_native():
    """The local-training shape: gradients of a two-layer net, accumulated over a lax.scan."""
    x, w1 = _data(1)
    w2 = jax.random.normal(jax.random.PRNGKey(2), (3, 3, 6, 5)) / 7.0

    def train(conv_fn):
        def loss(ws, x):
            h = jax.nn.relu(conv_fn(x, ws[0]))
            return jnp.mean(conv_fn(h, ws[1], (2, 2)) ** 2)

        def step(ws, t):
            g = jax.grad(loss)(ws, x + 0.1 * t)
            return jax.tree.map(lambda w, g: w - 0.1 * g, ws, g), loss(ws, x)

        return jax.jit(lambda ws: lax.scan(step, ws, jnp.arange(3.0)))((w1, w2))

    (got_w, got_l), (want_w, want_l) = train(_ours), train(_native)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    for a, b in zip(got_w, want_w, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@needs_onednn
def test_vmapped_gradients_match_native():
    """One kernel per client under vmap (the round's client axis): each client its own call."""
    xs = jax.random.normal(jax.random.PRNGKey(3), (3, 2, 8, 8, 4))
    ws = jax.random.normal(jax.random.PRNGKey(4), (3, 3, 3, 4, 5)) / 6.0
    grads = lambda f: jax.jit(jax.vmap(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2),
                                                argnums=(0, 1))))(xs, ws)
    for a, b in zip(grads(_ours), grads(_native), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


@needs_onednn
def test_one_call_for_all_clients_is_each_clients_own_call():
    """Under vmap the kernels take every client in one call (``expand_dims``): forward and both
    gradients are bitwise each client's own call, also with the images or the kernel shared by
    all clients (an axis of 1) and under two vmaps."""
    xs = jax.random.normal(jax.random.PRNGKey(5), (3, 2, 9, 9, 4))
    ws = jax.random.normal(jax.random.PRNGKey(6), (3, 3, 3, 4, 5)) / 6.0
    conv = lambda x, w: _ours(x, w)  # noqa: E731
    value_and_grads = jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(conv(x, w))),
                                         argnums=(0, 1))
    out = jax.jit(lambda x, w: (jax.vmap(conv)(x, w), jax.vmap(value_and_grads)(x, w)))
    alone = jax.jit(lambda x, w: (conv(x, w), value_and_grads(x, w)))
    for axes, pick in (((0, 0), lambda k: (xs[k], ws[k])), ((None, 0), lambda k: (xs[0], ws[k])),
                       ((0, None), lambda k: (xs[k], ws[0]))):
        together = jax.jit(lambda x, w, axes=axes: (
            jax.vmap(conv, in_axes=axes)(x, w),
            jax.vmap(value_and_grads, in_axes=axes)(x, w)))(
            xs if axes[0] == 0 else xs[0], ws if axes[1] == 0 else ws[0])
        for k in range(3):
            mine = alone(*pick(k))
            chex.assert_trees_all_equal(jax.tree.map(lambda a, k=k: a[k], together), mine)
    nested = jax.jit(lambda x, w: jax.vmap(jax.vmap(value_and_grads))(x, w))(
        xs.reshape(1, *xs.shape), ws.reshape(1, *ws.shape))
    flat = out(xs, ws)[1]
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[0], nested), flat)


@needs_onednn
def test_results_are_deterministic():
    """Bit-identical results call after call (resume reproduces a run exactly)."""
    x, w = _data(5, (8, 16, 16, 16), (3, 3, 16, 32))
    f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(_ours(x, w))), argnums=(0, 1)))
    first = jax.tree.map(np.asarray, f(x, w))
    for _ in range(3):
        again = jax.tree.map(np.asarray, f(x, w))
        chex.assert_trees_all_equal(again, first)


@needs_onednn
@pytest.mark.parametrize("cin", [3, 4, 5, 64])
def test_strided_1x1_gradients_stay_right_when_repeated(cin):
    """Regression: oneDNN 3.2's AVX2 kernel gradient of a strided 1x1 convolution with 4 input
    channels corrupted memory (wrong gradients in about 1 call of 30, then heap errors); the
    wrapper now subsamples and runs a stride-1 convolution. Many calls, since it was
    intermittent."""
    x, w = _data(3, shape=(1, 8, 8, cin), kernel=(1, 1, cin, 8))
    g = jax.random.normal(jax.random.PRNGKey(4), (1, 4, 4, 8))
    grad = lambda f: jax.jit(jax.grad(
        lambda x, w: jnp.sum(f(x, w, (2, 2), ((0, 0), (0, 0))) * g), argnums=(0, 1)))
    expected, ours = grad(_native)(x, w), grad(_ours)
    for _ in range(60):
        for a, b in zip(ours(x, w), expected, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_cpu_impl_compiles_to_the_ffi_calls():
    # 16 channels each way: every pass on oneDNN (nn.narrow_conv takes at most 8 outputs)
    x, w = _data(shape=(4, 10, 10, 16), kernel=(3, 3, 16, 16))
    loss = lambda x, w: jnp.sum(conv.cpu_conv_general_dilated(x, w, (1, 1), PAD) ** 2)
    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    for target in onednn.TARGETS:
        assert target in hlo


def test_refuses_what_it_does_not_compute():
    x, w = _data()
    with pytest.raises(ValueError, match="operands of one type"):
        conv.onednn_conv_general_dilated(x, w.astype(jnp.bfloat16), (1, 1), PAD)
    with pytest.raises(ValueError, match="operands of one type"):
        conv.onednn_conv_general_dilated(x.astype(jnp.int32), w.astype(jnp.int32), (1, 1), PAD)
    with pytest.raises(ValueError, match="returns its operands' type"):
        conv.onednn_conv_general_dilated(x, w, (1, 1), PAD, preferred_element_type=jnp.float16)


@needs_onednn
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_low_precision_matches_the_patch_convolution(dtype):
    """oneDNN's bfloat16 / float16 kernels (where the CPU has them) against the patch
    convolution in the same type and float32 native, forward and both gradients, within the
    type's rounding; and the CPU convolution picks them."""
    if not onednn.supports(dtype):
        pytest.skip(f"oneDNN has no {jnp.dtype(dtype).name} convolutions on this CPU")
    x, w = _data(3, shape=(4, 12, 12, 16), kernel=(3, 3, 16, 24))
    low = jnp.dtype(dtype)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x.astype(low), w.astype(low)).astype(jnp.float32) ** 2)

    ours = lambda x, w: conv.onednn_conv_general_dilated(x, w, (1, 1), PAD)
    patches = lambda x, w: conv.patch_conv_general_dilated(x, w, (1, 1), PAD)
    y = ours(x.astype(low), w.astype(low))
    assert y.dtype == low
    eps = float(jnp.finfo(low).eps)
    ref = _native(x, w)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=8 * eps * float(
        jnp.max(jnp.abs(ref))))
    for got, want in zip(jax.grad(loss(ours), (0, 1))(x, w),
                         jax.grad(loss(patches), (0, 1))(x, w), strict=True):
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(got, want, atol=8 * eps * scale)
    hlo = jax.jit(lambda x, w: conv.cpu_conv_general_dilated(x, w, (1, 1), PAD)).lower(
        x.astype(low), w.astype(low)).as_text()
    assert "fedjax_onednn_conv_forward" in hlo


@needs_onednn
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_support_probe_answers_the_same_inside_a_trace(dtype):
    """The first question may come while a model is being traced (the CPU convolution asks it):
    the probe must still run eagerly, or it would be staged into that program, answer yes, and
    fail at run time on a CPU without the type's kernels (seen: fp16 on a Zen 4)."""
    onednn.supports.cache_clear()
    eager = onednn.supports(dtype)
    onednn.supports.cache_clear()
    seen = []
    jax.jit(lambda x: seen.append(onednn.supports(dtype)) or x).lower(1.0)
    assert seen == [eager]
    y = jax.jit(lambda x, w: conv.cpu_conv_general_dilated(x, w, (1, 1), PAD))(
        *(a.astype(dtype) for a in _data(5, shape=(2, 6, 6, 4), kernel=(3, 3, 4, 8))))
    assert y.dtype == dtype and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))


@pytest.fixture
def unavailable(monkeypatch):
    """Makes the extension unavailable for the test, with a known reason."""
    monkeypatch.setattr(onednn, "_load",
                        lambda: onednn.OneDnnUnavailable("no oneDNN in this test"))


def test_cpu_impl_falls_back_to_matmul_convolutions_with_a_warning(unavailable):
    x, w = _data()
    with pytest.warns(conv.OneDnnFallbackWarning, match="no oneDNN in this test"):
        hlo = jax.jit(lambda x, w: conv.cpu_conv_general_dilated(x, w, (1, 1), PAD)).lower(
            x, w).as_text()
    assert not any(target in hlo for target in onednn.TARGETS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conv.OneDnnFallbackWarning)
        got = jax.jit(lambda x, w: conv.cpu_conv_general_dilated(x, w, (1, 1), PAD))(x, w)
    np.testing.assert_allclose(got, _native(x, w), rtol=1e-5, atol=1e-5)


def test_asking_for_onednn_when_unavailable_is_a_config_error(unavailable):
    with pytest.raises(ConfigError, match=r"conv_impl='onednn'.*no oneDNN in this test"):
        validate(Config(conv_impl="onednn"), check_data=False)


@needs_onednn
def test_asking_for_onednn_validates_here():
    validate(Config(conv_impl="onednn"), check_data=False)


def test_missing_compiler_is_reported(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-fedjax")
    with pytest.raises(onednn.OneDnnUnavailable, match="no C\\+\\+ compiler"):
        onednn._build_inputs()


@needs_onednn
def test_failed_build_is_reported_and_leaves_no_library(monkeypatch, tmp_path):
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(onednn, "SOURCE", broken)
    # The other sources trivial ones of the same names: the build fails on the broken one
    # without compiling the real kernels twice (with and without OpenMP).
    for name, attr in (("group_norm.cc", "GROUP_NORM_SOURCE"), ("max_pool.cc", "MAX_POOL_SOURCE"),
                       ("narrow_conv.cc", "NARROW_CONV_SOURCE"), ("augment.cc", "AUGMENT_SOURCE")):
        (tmp_path / name).write_text(f"int fedjax_{attr.lower()}_stand_in;\n")
        monkeypatch.setattr(onednn, attr, tmp_path / name)
    monkeypatch.setenv("FEDJAX_RCL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(onednn.OneDnnUnavailable, match="building broken.cc, group_norm.cc, "
                       "max_pool.cc, narrow_conv.cc, augment.cc failed"):
        onednn._build(onednn._build_inputs())
    assert not list(Path(tmp_path / "cache" / "ext").glob("*.so"))


@pytest.mark.slow
@needs_onednn
def test_build_is_cached_by_content(monkeypatch, tmp_path):
    """The same inputs reuse the cached library; another source builds another one."""
    monkeypatch.setenv("FEDJAX_RCL_CACHE", str(tmp_path))
    inputs = onednn._build_inputs()
    first = onednn._build(inputs)
    mtime = first.stat().st_mtime_ns
    assert onednn._build(inputs) == first and first.stat().st_mtime_ns == mtime
    edited = tmp_path / "edited.cc"
    edited.write_text(onednn.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(onednn, "SOURCE", edited)
    assert onednn._build(inputs) != first


@pytest.mark.slow
@needs_onednn
def test_a_compiler_without_openmp_still_builds_the_library(monkeypatch, tmp_path):
    """OpenMP only spreads the GroupNorm kernels over the cores: a compiler that cannot link
    it builds the same library without it."""
    real = onednn._build_inputs()["cxx"]
    calls = tmp_path / "calls"
    wrapper = tmp_path / "cxx-without-openmp"
    wrapper.write_text("#!/bin/sh\n"
                       f"echo \"$*\" >> {calls}\n"
                       "for a in \"$@\"; do [ \"$a\" = -fopenmp ] && "
                       "{ echo 'no OpenMP here' >&2; exit 1; }; done\n"
                       f"exec {' '.join(real)} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("FEDJAX_RCL_CACHE", str(tmp_path / "cache"))
    library = onednn._build(onednn._build_inputs())
    assert library.exists()
    tried = [line.split() for line in calls.read_text().splitlines()]
    # With OpenMP first (each source's compile fails), then without: each source compiled once
    # and one link.
    with_openmp = [t for t in tried if "-fopenmp" in t]
    without = tried[len(with_openmp):]
    assert with_openmp and tried[:len(with_openmp)] == with_openmp
    assert not any("-fopenmp" in t for t in without)
    assert sorted(t[t.index("-c") + 1].rsplit("/", 1)[-1] for t in without if "-c" in t) == sorted(
        source.name for source in onednn._sources())
    assert [t for t in without if "-shared" in t] == [without[-1]]

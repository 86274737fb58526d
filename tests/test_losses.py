"""``fedjax_rcl.losses`` against the brute-force float64 references of ``tests/loss_reference.py``.

Each case is one input (features and labels, or MOON's / NT-Xent's views) and the loss calls made
on it. For every call the value and the gradient w.r.t. the features of the JAX function, run in
float64 (``jax.enable_x64``) eagerly and under ``jax.jit`` (labels and auxiliary inputs are traced
arguments, hyperparameters are closed over; one compilation per call list), are compared with the
NumPy reference and its 5-point finite-difference gradient. Tolerances: values ``rtol=1e-6``;
gradients ``rtol=1e-6`` with an absolute floor of ``1e-6 * max|reference gradient|`` (entries
near zero are judged relative to the gradient's scale; the finite differences themselves are
accurate to ~1e-9).

Random inputs are redrawn until they are at least ``20 * step / ||row||`` away from every kink of
hard mining (``loss_reference.hard_mining_margin``), so the finite differences never straddle a
change of the mined positive/negatives or of a threshold gate. Inputs that sit on a kink by
construction (identical rows, ties, a similarity equal to the threshold, zero rows) are compared
on the value, and on the gradient only where it is defined (``Case.grad``).

Feature shapes are drawn from few batch sizes on purpose: eager JAX compiles each primitive once
per shape, so every new batch size costs seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import loss_reference as ref  # tests/ is on sys.path (pytest rootdir conftest)
import numpy as np
import pytest

RTOL = 1e-6
MODES = ("eager", "jit")
LOSS_NAMES = ("supcon_loss", "rcl_loss", "multilevel_rcl_loss", "moon_loss", "nt_xent_loss")


@pytest.fixture(scope="module")
def impl():
    """The JAX implementation, imported lazily: a missing one fails each test with a clear note."""
    try:
        import fedjax_rcl.losses as losses
    except Exception as e:  # any import failure is reported the same way
        pytest.fail(f"cannot import fedjax_rcl.losses: {e!r}", pytrace=False)
    missing = [name for name in LOSS_NAMES if not hasattr(losses, name)]
    if missing:
        pytest.fail(f"fedjax_rcl.losses lacks {missing} (public API)", pytrace=False)
    return losses


@pytest.fixture(autouse=True)
def _float64():
    with jax.enable_x64(True):
        yield


# ----------------------------------------------------------------------------------------------
# Case table.


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """``loss(*diff, *aux, **kwargs)``; ``loss`` names the function in both implementations."""

    loss: str
    kwargs: dict

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.loss}({args})"


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """One input and the calls compared on it.

    ``diff`` are the differentiated inputs (features; one per level for the multi-level loss),
    ``aux`` the others (labels, or z_global and z_prev for MOON). ``grad``: "numeric" compares
    with the finite-difference gradient on every non-zero feature row (zero rows, where the loss
    has a kink, are checked finite only); "zero" expects a vanishing gradient (all rows
    collinear: every similarity is at its maximum 1); "finite" only checks finiteness (the input
    sits on a tie or a gate by design).
    """

    name: str
    diff: tuple
    aux: tuple
    calls: tuple
    grad: str = "numeric"


def _bind(module, call: Call, n_diff: int) -> Callable:
    fn = getattr(module, call.loss)
    if call.loss == "multilevel_rcl_loss":
        return lambda *a: fn(list(a[:n_diff]), *a[n_diff:], **call.kwargs)
    return lambda *a: fn(*a, **call.kwargs)


def sc(mining, t):
    return Call("supcon_loss", dict(temperature=t, mining=mining))


def rc(mining, t, th, beta):
    return Call("rcl_loss", dict(temperature=t, threshold=th, beta=beta, mining=mining))


def all4(t, th, beta):
    """SCL and RCL, both minings."""
    return (sc("hard", t), rc("hard", t, th, beta), sc("none", t), rc("none", t, th, beta))


def rcl2(t, th, beta):
    return (rc("hard", t, th, beta), rc("none", t, th, beta))


def _thresholds(calls) -> set:
    """Thresholds of the calls' gates (None: the SCL kinks only)."""
    out = {None}
    for call in calls:
        if call.loss in ("rcl_loss", "multilevel_rcl_loss"):
            out.add(call.kwargs.get("threshold", 0.7))
    return out


def _nonzero_rows(x: np.ndarray) -> np.ndarray:
    """Boolean mask of x's shape: True on entries whose pooled row is not zero."""
    rows = np.linalg.norm(ref.pool(x), axis=1) > 0
    return np.broadcast_to(rows.reshape((-1,) + (1,) * (x.ndim - 1)), x.shape)


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def _shape(b: int, c: int, spatial) -> tuple:
    return (b, c) if spatial is None else (b, *spatial, c)


def _smooth(name: str, draw: Callable, labels, thresholds) -> np.ndarray:
    """Redraw ``draw(rng)`` until it is safely away from every kink of hard mining."""
    rng = _rng(name)
    for _ in range(2000):
        x = draw(rng)
        norms = np.linalg.norm(ref.pool(x), axis=1)
        norms = norms[norms > 0]
        needed = 20 * ref.FD_STEP / norms.min() if norms.size else 0.0
        margin = min(ref.hard_mining_margin(x, labels, threshold=t) for t in thresholds)
        if margin > needed:
            return x
    raise RuntimeError(f"{name}: no input away from the kinks; loosen the case")


def rand(b, c, spatial=None, zero_rows=()):
    def draw(rng):
        x = rng.normal(size=_shape(b, c, spatial))
        for r in zero_rows:
            x[r] = 0.0
        return x

    return draw


def collapsed(b, c, spread, spatial=None):
    """Rows = one common unit direction + small noise: every similarity close to 1."""

    def draw(rng):
        base = rng.normal(size=c)
        base /= np.linalg.norm(base)
        rows = base + spread * rng.normal(size=(b, c))
        if spatial is None:
            return rows
        return rows[:, None, None, :] + spread * rng.normal(size=_shape(b, c, spatial))

    return draw


def scl_case(name, labels, draw, calls):
    labels = np.asarray(labels, np.int32)
    x = _smooth(name, draw, labels, _thresholds(calls))
    return Case(name, (x,), (labels,), tuple(calls))


def fixed_case(name, x, labels, calls, grad):
    x = np.asarray(x, np.float64)
    return Case(name, (x,), (np.asarray(labels, np.int32),), tuple(calls), grad)


def multilevel_case(name, labels, level_shapes, calls):
    labels = np.asarray(labels, np.int32)
    levels = tuple(
        _smooth(f"{name}/{n}", lambda rng, s=s: rng.normal(size=s), labels, _thresholds(calls))
        for n, s in enumerate(level_shapes)
    )
    return Case(name, levels, (labels,), tuple(calls))


def moon_case(name, b, c, spatial, kwargs, zero=None):
    rng = _rng(name)
    z, zg, zp = (rng.normal(size=_shape(b, c, spatial)) for _ in range(3))
    if zero is not None:
        z[zero[0]] = 0.0
        zg[zero[1]] = 0.0
    return Case(name, (z,), (zg, zp), (Call("moon_loss", kwargs),))


def nt_xent_case(name, k, c, spatial, kwargs, zero_row=None):
    rng = _rng(name)
    z1, z2 = (rng.normal(size=_shape(k, c, spatial)) for _ in range(2))
    if zero_row is not None:
        z1[zero_row] = 0.0
    return Case(name, (z1, z2), (), (Call("nt_xent_loss", kwargs),))


LABELS5 = np.array([0, 1, 0, 2, 1], np.int32)
LABELS16 = np.array([2, 0, 1, 3, 1, 2, 0, 0, 3, 1, 2, 3, 0, 1, 3, 2], np.int32)
IDENTICAL = np.tile(np.array([[0.3, -1.2, 0.7]]), (5, 1))
TIED = [[1.0, 0.0, 0.0], [1.0, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
DEFAULTS = (  # rcl_loss's defaults (t 0.05, threshold 0.7, beta 1, hard) and supcon's mining
    Call("supcon_loss", dict(temperature=0.05)),
    Call("rcl_loss", {}),
    sc("none", 0.05),
    rc("none", 0.05, 0.7, 1.0),
)
ML_DEFAULTS = Call("multilevel_rcl_loss", {})


def ml(mining, t, th, beta):
    return Call("multilevel_rcl_loss", dict(temperature=t, threshold=th, beta=beta, mining=mining))


# fmt: off
# Cases with the same feature shape share their calls where the point of the case allows it
# (B2_CALLS, B5_C3_CALLS, B1_CALLS, B5_C8_CALLS): the compiled runner is then reused (see _runner).
B2_CALLS = all4(0.2, 0.0, 1.0)
B5_C3_CALLS = all4(0.5, 0.7, 1.0)
B1_CALLS = all4(0.5, 0.7, 1.0)
B5_C8_CALLS = all4(0.05, 0.7, 1.0)
CASES = [
    # --- random inputs (B 2/5/16, C 3/8, 2-D and 4-D NHWC) ------------------------------------
    scl_case("random-B16-C3-defaults", LABELS16, rand(16, 3), DEFAULTS),
    scl_case("random-B16-C8", LABELS16, rand(16, 8), rcl2(0.1, 0.0, 0.5)),
    scl_case("random-B5-C8-4d", LABELS5, rand(5, 8, (2, 3)), rcl2(0.5, -1.0, 2.0)),
    scl_case("random-B5-C3-beta0", LABELS5, rand(5, 3),
             (sc("hard", 1.0), sc("none", 1.0), rc("hard", 1.0, 0.3, 0.0))),
    scl_case("random-B16-C3-4d", LABELS16, rand(16, 3, (2, 2)), rcl2(0.2, -0.2, 1.0)),
    scl_case("random-B2-C3-one-class", [1, 1], rand(2, 3), B2_CALLS),
    # --- anchors without classmates / without (two) other-class samples ------------------------
    scl_case("no-classmate-B5", [0, 1, 2, 3, 4], rand(5, 3), B5_C3_CALLS),
    scl_case("single-class-B5", [1] * 5, rand(5, 8), B5_C8_CALLS),
    scl_case("B2-different-labels", [0, 1], rand(2, 3), B2_CALLS),
    scl_case("B3-one-odd-sample", [0, 0, 1], rand(3, 8), rcl2(0.2, -0.5, 1.5)),
    scl_case("B1", [3], rand(1, 8), B1_CALLS),
    # --- collapsed features: the hard penalty's gate is open -------------------------------------
    scl_case("collapsed-B5", [0, 0, 1, 1, 0], collapsed(5, 8, 0.1), B5_C8_CALLS),
    scl_case("collapsed-B5-4d", [0, 0, 1, 1, 0], collapsed(5, 3, 0.1, (2, 2)),
             rcl2(0.1, 0.7, 2.0)),
    fixed_case("identical-rows", IDENTICAL, LABELS5, B5_C3_CALLS, "zero"),
    # --- zero feature vectors (s_ii = 0 for them) ----------------------------------------------
    scl_case("zero-row-B5", [0, 1, 0, 1, 1], rand(5, 3, zero_rows=(2,)), B5_C3_CALLS),
    fixed_case("zero-row-B1", np.zeros((1, 8)), [0], B1_CALLS, "finite"),
    fixed_case("all-zero-B5", np.zeros((5, 3)), [0, 0, 1, 1, 2], B5_C3_CALLS, "finite"),
    # --- sitting on a gate or a tie: values, finite gradients ----------------------------------
    # s_01 = 0 exactly = threshold: the hard gate keeps m_i (>=), the paper's gate drops it (>).
    fixed_case("gate-equality", [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], [0, 0], B2_CALLS, "finite"),
    # Three identical other-class rows: anchors 0 and 1 have tied top-2 negatives.
    fixed_case("tied-negatives", TIED, [0, 0, 1, 1, 1], B5_C3_CALLS, "finite"),
    # --- multi-level ------------------------------------------------------------------------------
    multilevel_case("multilevel-B5", LABELS5, [(5, 2, 2, 3), (5, 2, 2, 8), (5, 3)],
                    (ML_DEFAULTS, ml("none", 0.1, 0.3, 0.5))),
    multilevel_case("multilevel-B16-one-level", LABELS16, [(16, 8)], (ml("hard", 0.05, 0.0, 1.0),)),
    # --- MOON -------------------------------------------------------------------------------------
    moon_case("moon-B5-C8-default-t", 5, 8, None, {}),
    moon_case("moon-B16-C3-zero-rows", 16, 3, None, dict(temperature=0.1), zero=(1, 2)),
    moon_case("moon-B5-C3-4d", 5, 3, (2, 2), dict(temperature=0.2)),
    moon_case("moon-B1-C8", 1, 8, None, dict(temperature=0.5)),
    # --- NT-Xent ----------------------------------------------------------------------------------
    nt_xent_case("nt-xent-K1-C3", 1, 3, None, dict(temperature=0.5)),
    nt_xent_case("nt-xent-K5-C8", 5, 8, None, dict(temperature=0.1)),
    nt_xent_case("nt-xent-K8-C3-4d-zero-row", 8, 3, (2, 2), dict(temperature=0.5), zero_row=0),
]
# fmt: on
CASES_BY_NAME = {case.name: case for case in CASES}
assert len(CASES_BY_NAME) == len(CASES), "duplicate case names"


@functools.cache
def _reference(name: str):
    """Per call: (value, [gradient per diff input] or None) of the NumPy reference; computed once
    per case."""
    case = CASES_BY_NAME[name]
    n_diff = len(case.diff)
    out = []
    for call in case.calls:
        fn = _bind(ref, call, n_diff)
        value = fn(*case.diff, *case.aux)
        grads = None
        if case.grad == "numeric":
            grads = []
            for a, x in enumerate(case.diff):

                def f(v, a=a, fn=fn):
                    args = list(case.diff)
                    args[a] = v
                    return fn(*args, *case.aux)

                grads.append(ref.numeric_grad(f, x, where=_nonzero_rows(x)))
        out.append((value, grads))
    return out


# ----------------------------------------------------------------------------------------------
# Comparison helpers.


def _assert_value(actual, expected: float, what: str) -> None:
    assert jnp.asarray(actual).dtype == jnp.float64, f"{what}: computed in {actual.dtype}"
    np.testing.assert_allclose(float(actual), expected, rtol=RTOL, atol=1e-12, err_msg=what)


def _assert_grad(actual, expected: np.ndarray | None, mode: str, what: str) -> None:
    actual = np.asarray(actual)
    assert np.all(np.isfinite(actual)), f"{what}: non-finite gradient\n{actual}"
    if mode == "finite":
        return
    if mode == "zero":
        np.testing.assert_allclose(actual, 0.0, atol=1e-9, err_msg=f"{what}: expected 0")
        return
    mask = np.isfinite(expected)
    scale = float(np.max(np.abs(expected[mask]), initial=0.0))
    np.testing.assert_allclose(
        actual[mask], expected[mask], rtol=RTOL, atol=max(RTOL * scale, 1e-10), err_msg=what
    )


# ----------------------------------------------------------------------------------------------
# Tests.


_RUNNERS: dict = {}


def _runner(impl, calls, n_diff: int, mode: str) -> Callable:
    """``(*diff, *aux) -> [(value, grads) per call]``; one jitted runner per distinct call list,
    so cases that share calls and shapes share one compilation."""
    key = (tuple(str(c) for c in calls), n_diff, mode)
    if key not in _RUNNERS:
        argnums = tuple(range(n_diff))
        vgs = [jax.value_and_grad(_bind(impl, c, n_diff), argnums=argnums) for c in calls]

        def run(*args):
            return [vg(*args) for vg in vgs]

        _RUNNERS[key] = jax.jit(run) if mode == "jit" else run
    return _RUNNERS[key]


# Called eagerly, every operation of a loss compiles on its own for each new shape (about a
# second a case): the default step runs MOON's and NT-Xent's eagerly and the cases jitted but
# for three more random shapes; the slow step runs every case both ways.
EAGER_DEFAULT = ("moon-B5-C8-default-t", "nt-xent-K5-C8")
JIT_SLOW = ("random-B16-C3-4d", "random-B16-C8", "random-B5-C8-4d")


def _loss_cases():
    for name in CASES_BY_NAME:
        for mode in MODES:
            slow = name in JIT_SLOW if mode == "jit" else name not in EAGER_DEFAULT
            yield pytest.param(name, mode, id=f"{name}-{mode}",
                               marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("name,mode", list(_loss_cases()))
def test_loss_matches_reference(impl, name, mode):
    case = CASES_BY_NAME[name]
    run = _runner(impl, case.calls, len(case.diff), mode)
    results = run(*(jnp.asarray(a) for a in case.diff + case.aux))
    for call, (value, grads), (ref_value, ref_grads) in zip(
        case.calls, results, _reference(name), strict=True
    ):
        what = f"{name} [{mode}] {call}"
        _assert_value(value, ref_value, f"{what} value")
        for a, g in enumerate(grads):
            assert g.shape == case.diff[a].shape
            expected = None if ref_grads is None else ref_grads[a]
            _assert_grad(g, expected, case.grad, f"{what} gradient w.r.t. input {a}")


PAIR_LABELS = np.repeat(np.arange(8, dtype=np.int32), 2)  # 8 classes of 2: classmate of i is i^1


def _gate_inputs(threshold: float):
    """Random features whose hard gate is closed for every anchor, and collapsed ones where it is
    open for every anchor."""
    rng = _rng("gate")
    for _ in range(1000):
        x = rng.normal(size=(16, 8))
        s = ref.cosine_matrix(x)
        if all(s[i, i ^ 1] < threshold - 1e-3 for i in range(16)):
            break
    else:
        raise RuntimeError("no random input with a closed gate")
    opened = collapsed(16, 8, 0.1)(rng)
    s = ref.cosine_matrix(opened)
    assert all(s[i, i ^ 1] > threshold for i in range(16))
    return x, opened


GATE_SETTINGS = ((0.05, 1.0), (0.5, 2.0))  # (temperature, beta)


@pytest.mark.parametrize("mode", [pytest.param("eager", marks=pytest.mark.slow), "jit"])
def test_penalty_gates(impl, mode):
    """Hard: closed gate -> penalty = beta * softplus((-1 - s_ii)/t) = beta * softplus(-2/t);
    open gate (collapsed rows) -> beta * mean softplus((m_i - 1)/t), clearly larger.
    Paper Eq. 5: no classmate above the threshold -> exactly 0; collapsed -> > 0.
    rcl_loss with beta = 0 equals supcon_loss."""
    threshold = 0.7

    def penalties(f, y):
        out = []
        for t, beta in GATE_SETTINGS:
            for mining in ("hard", "none"):
                scl = impl.supcon_loss(f, y, temperature=t, mining=mining)
                kw = dict(temperature=t, threshold=threshold, mining=mining)
                out.append(impl.rcl_loss(f, y, beta=beta, **kw) - scl)
                out.append(impl.rcl_loss(f, y, beta=0.0, **kw) - scl)
        return jnp.stack(out)

    if mode == "jit":
        penalties = jax.jit(penalties)
    closed, opened = _gate_inputs(threshold)
    got_closed = np.asarray(penalties(jnp.asarray(closed), jnp.asarray(PAIR_LABELS)))
    got_opened = np.asarray(penalties(jnp.asarray(opened), jnp.asarray(PAIR_LABELS)))
    n = 0
    for t, beta in GATE_SETTINGS:
        for mining in ("hard", "none"):
            what = f"t={t} beta={beta} {mining}"
            gated = beta * ref.softplus(-2.0 / t) if mining == "hard" else 0.0
            np.testing.assert_allclose(
                got_closed[n], gated, rtol=RTOL, atol=1e-12, err_msg=f"{what}: closed gate"
            )
            expected = beta * ref.rcl_penalty(
                opened, PAIR_LABELS, temperature=t, threshold=threshold, mining=mining
            )
            np.testing.assert_allclose(
                got_opened[n], expected, rtol=RTOL, atol=1e-12, err_msg=f"{what}: open gate"
            )
            assert got_opened[n] - gated > 0.1 * beta, (what, got_opened[n], gated)
            assert abs(got_closed[n + 1]) < 1e-12 and abs(got_opened[n + 1]) < 1e-12, what
            n += 2


def test_rcl_loss_vmap(impl):
    """jit(vmap) over a leading axis of (features, labels) equals the per-slice reference."""
    kw = dict(temperature=0.1, threshold=0.0, beta=1.0)
    label_sets = np.array([[0, 1, 0, 2, 1], [0, 0, 0, 0, 0], [0, 1, 2, 3, 4]], np.int32)
    feats = np.stack(
        [
            _smooth(f"vmap-{n}", rand(5, 3), y, {None, kw["threshold"]})
            for n, y in enumerate(label_sets)
        ]
    )

    def both(f, y):
        return [
            jax.value_and_grad(lambda v, m=m: impl.rcl_loss(v, y, mining=m, **kw))(f)
            for m in ("hard", "none")
        ]

    results = jax.jit(jax.vmap(both))(jnp.asarray(feats), jnp.asarray(label_sets))
    for (values, grads), mining in zip(results, ("hard", "none"), strict=True):
        for n, (f, y) in enumerate(zip(feats, label_sets, strict=True)):
            fn = functools.partial(ref.rcl_loss, labels=y, mining=mining, **kw)
            what = f"{mining} slice {n}"
            _assert_value(values[n], fn(f), f"{what} value")
            _assert_grad(grads[n], ref.numeric_grad(fn, f), "numeric", f"{what} gradient")


def test_reference_closed_forms():
    """Sanity of the reference itself on inputs with a closed form."""
    t = 0.1
    # Identical rows, labels [0, 1, 0, 1, 2]: every s = 1; hard SCL: l_i = log 3.
    assert math.isclose(ref.supcon_loss(IDENTICAL, LABELS5, temperature=t), math.log(3.0))
    # Hard penalty: 4 anchors with a classmate at s = 1 >= 0.7 -> softplus(0) = log 2; the
    # fifth anchor has none -> softplus(-2/t).
    expected = (4 * math.log(2.0) + ref.softplus(-2.0 / t)) / 5
    got = ref.rcl_penalty(IDENTICAL, LABELS5, temperature=t, threshold=0.7)
    assert math.isclose(got, expected)
    # B = 1 zero row: s_11 = 0 -> softplus(-1/t).
    assert math.isclose(ref.rcl_loss(np.zeros((1, 3)), [0], temperature=t), ref.softplus(-1 / t))
    # NT-Xent with K = 1: the twin is the whole denominator -> 0.
    assert abs(ref.nt_xent_loss(np.ones((1, 3)), -np.ones((1, 3)), temperature=t)) < 1e-15
    # MOON with z = z_global orthogonal to z_prev: -log(e^{1/t} / (e^{1/t} + 1)).
    z, zp = np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]])
    assert math.isclose(ref.moon_loss(z, z, zp, temperature=t), ref.softplus(-1.0 / t))
    # Finite differences on a cubic.
    x = np.array([[1.0, -2.0], [0.5, 3.0]])
    np.testing.assert_allclose(
        ref.numeric_grad(lambda v: float(np.sum(v**3)), x), 3 * x**2, rtol=1e-9
    )


# ----------------------------------------------------------------------------------------------
# Float32 under jit, the API's own edges. (Formerly a separate smoke file; its value checks
# against per-anchor loops are the reference comparisons above.)

F32_CASES = ("collapsed-B5", "single-class-B5", "identical-rows", "all-zero-B5",
             "no-classmate-B5", "B3-one-odd-sample", "zero-row-B1", "random-B5-C8-4d",
             "random-B2-C3-one-class")
F32_SETTINGS = tuple((t, mining) for t in (0.5, 0.05) for mining in ("hard", "none"))


@functools.cache
def _f32_runner(impl):
    def run(x, y):
        return [jax.value_and_grad(lambda v, t=t, m=m: impl.rcl_loss(v, y, temperature=t,
                                                                     mining=m))(x)
                for t, m in F32_SETTINGS]

    return jax.jit(run)  # one compilation per feature shape


@pytest.mark.parametrize("name", F32_CASES)
def test_float32_compiled_values_and_gradients_are_finite(impl, name):
    """In float32 (how clients train) under jit, at temperature 0.5 and the paper's 0.05, both
    minings: finite value and gradient on collapsed, zero, single-class and one-sample inputs."""
    case = CASES_BY_NAME[name]
    x = jnp.asarray(case.diff[0], jnp.float32)
    for (t, mining), (value, grad) in zip(F32_SETTINGS, _f32_runner(impl)(x, case.aux[0]),
                                          strict=True):
        assert value.dtype == grad.dtype == jnp.float32
        assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad))), \
            (name, t, mining)


def test_exact_zeros_terms_and_argument_checks(impl):
    """SupCon is exactly 0 where no anchor has a classmate (paper mining), for one class under
    hard mining and for one sample; ``rcl_loss_terms`` returns (SupCon, penalty) with the
    collapsed closed form; misspelled options and an unknown mining are refused. (Compiled:
    eagerly, each operation compiles on its own for every shape.)"""
    supcon = jax.jit(impl.supcon_loss, static_argnames=("temperature", "mining"))
    for name, mining in (("no-classmate-B5", "none"), ("single-class-B5", "hard"),
                         ("B1", "hard")):
        x, y = CASES_BY_NAME[name].diff[0], CASES_BY_NAME[name].aux[0]
        assert float(supcon(x, y, temperature=0.1, mining=mining)) == 0.0, name
    # Six identical rows, labels [0, 0, 0, 1, 1, 2]: five anchors have a classmate at s = 1
    # (gate open, q = s_ii = 1: softplus(0) = log 2), the sixth none (softplus(-2/t)).
    x, y = np.tile(IDENTICAL[:1], (6, 1)), np.array([0, 0, 0, 1, 1, 2], np.int32)
    scl, pen = jax.jit(impl.rcl_loss_terms, static_argnames=("temperature",))(
        x, y, temperature=0.05)
    np.testing.assert_allclose(float(pen), (5 * math.log(2) + math.log1p(math.exp(-40))) / 6,
                               rtol=1e-12)
    _assert_value(scl, ref.supcon_loss(x, y, temperature=0.05), "rcl_loss_terms scl")
    _assert_value(pen, ref.rcl_penalty(x, y, temperature=0.05, threshold=0.7), "penalty")
    with pytest.raises(TypeError):
        impl.multilevel_rcl_loss([x], y, temprature=0.1)  # misspelled option
    with pytest.raises(ValueError, match="mining"):
        impl.supcon_loss(jnp.zeros((2, 3)), jnp.zeros(2, int), temperature=1.0, mining="x")


def test_multilevel_rcl_loss_vmap(impl):
    """jit(vmap) over a leading axis of (levels of NHWC features, labels) equals the per-slice
    reference."""
    rng = _rng("multilevel-vmap")
    levels = [rng.normal(size=(3, 6, 4, 4, c)) for c in (2, 5, 7)]
    y = rng.integers(0, 3, size=(3, 6)).astype(np.int32)
    fn = jax.jit(jax.vmap(lambda fs, y: impl.multilevel_rcl_loss(fs, y, temperature=0.1)))
    got = fn([jnp.asarray(lv) for lv in levels], jnp.asarray(y))
    for c in range(3):
        want = ref.multilevel_rcl_loss([lv[c] for lv in levels], y[c], temperature=0.1)
        _assert_value(got[c], want, f"slice {c}")


def test_moon_and_nt_xent_gradients_at_zero_are_finite(impl):
    zero = jnp.zeros((2, 6))
    grad = jax.jit(jax.grad(lambda z: impl.moon_loss(z, zero + 1, zero)
                            + impl.nt_xent_loss(z, zero, temperature=0.1)))(zero)
    assert np.all(np.isfinite(np.asarray(grad)))

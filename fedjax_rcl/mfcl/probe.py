"""Linear probe: top-1 accuracy of a linear classifier on frozen features (the standard
evaluation of self-supervised representations; SimCLR §4, MFCL's tables).

Two probes, ``mfcl.probe``:

- ``lbfgs`` (the default): multinomial logistic regression solved to convergence. On
  standardised features ``x`` (training-set mean and standard deviation per dimension, a fixed
  affine map, so the probe stays linear in the frozen features) it minimises

  .. math::
      J(W, b) = \\frac{1}{\\sum_i s_i} \\sum_i s_i \\,
        \\mathrm{CE}\\big(\\mathrm{softmax}(W^\\top x_i + b),\\, y_i\\big)
        + \\frac{\\lambda}{2} \\lVert W \\rVert^2

  (the bias is not penalised; ``s_i`` in {0, 1} selects the rows being fitted) with full-batch
  L-BFGS (``optax.lbfgs`` and its zoom line search) in one compiled ``lax.while_loop`` that
  stops when the gradient's largest entry is below ``tol`` or after ``max_iter`` iterations.
  L-BFGS searches a whitened parametrisation of W (``_lbfgs``), which changes the path, not
  the objective: J is strictly convex in W for lambda > 0, so the result does not depend on
  how it was reached. ``lambda`` is chosen from a grid by the accuracy on a held-out part of
  the training set, then the probe is refitted on the whole training set with it: the linear
  classifier of SimCLR's transfer experiments (after Kornblith et al., 2019, "Do Better
  ImageNet Models Transfer Better?"), L-BFGS with the penalty chosen on a validation split.
- ``adam``: the same classifier without a penalty, Adam for a fixed number of epochs of
  mini-batches (cheap, but not converged: its accuracy depends on the epochs and the rate).

Both are deterministic: the held-out split and Adam's batch order come from a key of the run.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree_utils as otu

# Full float32 matrix products (no TF32 or bf16 passes on accelerators): the stopping test
# compares gradient entries with tolerances near 1e-5.
_HI = jax.lax.Precision.HIGHEST


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=_HI)


@jax.jit
def _moments(x: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    """Per-dimension mean and standard deviation (+ 1e-6, so that a constant feature maps to
    0) of ``x [N, D] * scale`` in float32, whatever the dtype of ``x``."""
    x = x.astype(jnp.float32) * scale
    mean = x.mean(0)
    return mean, jnp.sqrt(jnp.mean(jnp.square(x - mean), 0)) + 1e-6


@jax.jit
def _standardise(x: jax.Array, mean: jax.Array, std: jax.Array, scale: float) -> jax.Array:
    """``(x * scale - mean) / std`` as float32 in one fused pass (one output array, no
    intermediate copies of ``x``)."""
    return (x.astype(jnp.float32) * scale - mean) / std


def standardise(train_x, test_x, *, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """``train_x`` and ``test_x`` (``[N, D]``, any real dtype; multiplied by ``scale`` first)
    standardised by the training set's per-dimension mean and standard deviation."""
    train_x, test_x = jnp.asarray(train_x), jnp.asarray(test_x)
    mean, std = _moments(train_x, scale)
    return (_standardise(train_x, mean, std, scale), _standardise(test_x, mean, std, scale))


def _accuracy(params: dict, x: jax.Array, y: jax.Array) -> float:
    return float(jnp.mean(jnp.argmax(_mm(x, params["w"]) + params["b"], -1) == y))


def _objective(params: dict, x: jax.Array, y: jax.Array, rows: jax.Array, lam: jax.Array
               ) -> jax.Array:
    """J(W, b) above: the mean cross-entropy over the rows with ``rows`` 1, plus
    ``lam / 2 * ||W||^2``."""
    ce = optax.softmax_cross_entropy_with_integer_labels(_mm(x, params["w"]) + params["b"], y)
    return (jnp.sum(rows * ce) / jnp.sum(rows)
            + 0.5 * lam * jnp.sum(jnp.square(params["w"])))


@jax.jit
def preconditioner(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(U [D, D], s [D])``: the eigendecomposition ``U diag(s) U^T`` of the second-moment
    matrix ``x^T x / N`` of standardised features ``x [N, D]`` (eigenvalues clipped at 0), from
    which ``fit_logistic`` whitens its search space."""
    s, u = jnp.linalg.eigh(_mm(x.T, x) / x.shape[0])
    return u, jnp.maximum(s, 0.0)


def _subsample(x: jax.Array, max_rows: int) -> jax.Array:
    """Every k-th row of ``x``, at most ``max_rows`` of them (a preconditioner needs only an
    estimate of the second moments)."""
    return x[::-(-x.shape[0] // max_rows)]


@jax.jit
def _lbfgs(x, y, rows, lam, params, u, s, max_iter, tol):
    """L-BFGS on ``_objective`` from ``params`` until ``max|grad| < tol`` or ``max_iter``
    iterations (at least one): ``(params, iterations, max|grad|, objective)``.

    With a ``preconditioner`` ``(u, s)`` the search runs over ``V`` with ``W = U diag(d) V``,
    ``d = (s + lam)^(-1/2)``: an exact change of variables (the objective and its minimiser
    in W are unchanged) that turns the penalised data term's curvature ``x^T x / N + lam I``
    into about the identity, so correlated features (raw pixels) take tens to hundreds of
    iterations, not thousands. Without (``u`` None) it runs over W itself."""
    identity = u is None
    d = None if identity else jax.lax.rsqrt(s + lam)[:, None]

    def to_w(v):
        return v if identity else _mm(u, d * v)

    def value_fn(p):
        return _objective({"w": to_w(p["v"]), "b": p["b"]}, x, y, rows, lam)

    solver = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(value_fn)

    def grad_max(state):  # of the gradient in (W, b): dJ/dV = d U^T dJ/dW, U orthogonal
        g = otu.tree_get(state, "grad")
        gw = g["v"] if identity else _mm(u, g["v"] / d)
        return jnp.maximum(jnp.max(jnp.abs(gw)), jnp.max(jnp.abs(g["b"])))

    def step(carry):
        p, state = carry
        value, grad = value_and_grad(p, state=state)
        updates, state = solver.update(grad, state, p, value=value, grad=grad,
                                       value_fn=value_fn)
        return optax.apply_updates(p, updates), state

    def going(carry):
        _, state = carry
        n = otu.tree_get(state, "count")
        return (n == 0) | ((n < max_iter) & (grad_max(state) >= tol))

    start = {"v": params["w"] if identity else _mm(u.T, params["w"]) / d, "b": params["b"]}
    p, state = jax.lax.while_loop(going, step, (start, solver.init(start)))
    params = {"w": to_w(p["v"]), "b": p["b"]}
    # The reported gradient is computed afresh in (W, b).
    value, grad = jax.value_and_grad(_objective)(params, x, y, rows, lam)
    g = jnp.maximum(jnp.max(jnp.abs(grad["w"])), jnp.max(jnp.abs(grad["b"])))
    return params, otu.tree_get(state, "count"), g, value


def whitening(x: jax.Array, precondition: bool | None = None) -> tuple | None:
    """The ``preconditioner`` of standardised features ``x [N, D]`` from at most 10,000 of
    their rows, or None (no preconditioning). ``precondition`` None: when ``N >= D`` -- with
    fewer rows than features its O(D^3) eigendecomposition costs more than the iterations it
    saves."""
    if precondition is None:
        precondition = x.shape[0] >= x.shape[1]
    return preconditioner(_subsample(x, 10_000)) if precondition else None


def fit_logistic(x: jax.Array, y: jax.Array, lam: float, *, num_classes: int,
                 rows: jax.Array | None = None, max_iter: int = 1000, tol: float = 1e-5,
                 init: dict | None = None, basis: tuple | None | str = "auto"
                 ) -> tuple[dict, dict]:
    """Minimises J(W, b) (module docstring) on features ``x [N, D]`` (float32, already
    standardised) and labels ``y [N]`` over the rows where ``rows`` is 1 (None: all), from
    ``init`` (None: zeros). ``basis``: ``whitening``'s output for ``x``, the preconditioner
    (``"auto"``: ``whitening(x)``; None: none).

    Returns:
      ``(params, info)``: ``params = {"w": [D, C], "b": [C]}``; ``info`` holds
      ``iterations``, ``grad_max_abs`` (the largest entry of the gradient of J in (W, b) at
      the result), ``objective`` and ``converged`` (``grad_max_abs < tol``).
    """
    x = jnp.asarray(x, jnp.float32)
    y = jnp.asarray(y, jnp.int32)
    rows = (jnp.ones(x.shape[0], jnp.float32) if rows is None
            else jnp.asarray(rows, jnp.float32))
    if init is None:
        init = {"w": jnp.zeros((x.shape[1], num_classes), jnp.float32),
                "b": jnp.zeros((num_classes,), jnp.float32)}
    if isinstance(basis, str):
        basis = whitening(x)
    u, s = (None, None) if basis is None else basis
    params, n, g, value = _lbfgs(x, y, rows, jnp.float32(lam), init, u, s,
                                 jnp.int32(max_iter), jnp.float32(tol))
    g = float(g)
    return params, {"iterations": int(n), "grad_max_abs": g, "objective": float(value),
                    "converged": g < tol}


def heldout_rows(n: int, fraction: float, key: jax.Array) -> np.ndarray:
    """``bool [n]``: a random ``fraction`` of ``n`` rows (rounded, at least 1 and at most
    n - 1 when fraction > 0) held out to choose the penalty; from ``key``."""
    out = np.zeros(n, bool)
    m = min(max(int(round(fraction * n)), 1), n - 1) if fraction > 0 and n > 1 else 0
    out[np.asarray(jax.random.permutation(key, n))[:m]] = True
    return out


def lbfgs_probe(train_x, train_y, test_x, test_y, *, num_classes: int,
                l2_grid: Sequence[float], holdout: float, max_iter: int, tol: float,
                key: jax.Array, scale: float = 1.0, prefix: str = "linear_probe_") -> dict:
    """The converged probe: standardise, choose lambda on held-out rows, refit on all rows.

    Each lambda of ``l2_grid`` is fitted on the training rows not held out (a fraction
    ``holdout``, drawn from ``key``), largest first, each fit starting from the previous
    solution; the lambda with the best held-out accuracy wins (ties: the largest, the most
    regularised). The probe is then refitted on every training row with it. A grid of one
    value, or ``holdout=0``, skips the selection. ``scale`` multiplies the inputs before the
    standardisation (1/255 for raw pixels), whose mean and standard deviation are those of
    all the training rows, the held-out ones included (no labels enter it).

    Returns (keys after ``prefix``): ``accuracy`` (test top-1), ``train_accuracy``, ``loss``
    (training cross-entropy, without the penalty), ``l2`` (the chosen lambda), ``l2_grid``,
    ``heldout_accuracy`` and ``heldout_iterations`` (per lambda of the grid; empty without a
    selection), ``iterations``, ``grad_max_abs`` and ``converged`` of the final fit.
    """
    train_x, test_x = standardise(train_x, test_x, scale=scale)
    train_y = jnp.asarray(train_y, jnp.int32)
    test_y = jnp.asarray(test_y, jnp.int32)
    grid = sorted((float(v) for v in l2_grid), reverse=True)
    n = train_x.shape[0]
    held = heldout_rows(n, holdout, key) if len(grid) > 1 else np.zeros(n, bool)
    fit = dict(num_classes=num_classes, max_iter=max_iter, tol=tol, basis=whitening(train_x))
    accuracies, iterations = {}, {}
    params, chosen = None, grid[0]
    if held.any():
        fit_rows = jnp.asarray(~held, jnp.float32)
        held_x, held_y = train_x[held], train_y[held]
        solutions = {}
        for lam in grid:
            params, info = fit_logistic(train_x, train_y, lam, rows=fit_rows, init=params,
                                        **fit)
            solutions[lam] = params
            accuracies[lam] = _accuracy(params, held_x, held_y)
            iterations[lam] = info["iterations"]
        del held_x, held_y
        chosen = max(grid, key=lambda lam: (accuracies[lam], lam))
        params = solutions[chosen]
    params, info = fit_logistic(train_x, train_y, chosen, init=params, **fit)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        _mm(train_x, params["w"]) + params["b"], train_y).mean()
    order = [float(v) for v in l2_grid]
    out = {"accuracy": _accuracy(params, test_x, test_y),
           "train_accuracy": _accuracy(params, train_x, train_y),
           "loss": float(ce), "l2": chosen, "l2_grid": order,
           "heldout_accuracy": [accuracies[v] for v in order] if accuracies else [],
           "heldout_iterations": [iterations[v] for v in order] if iterations else [],
           "iterations": info["iterations"], "grad_max_abs": info["grad_max_abs"],
           "converged": info["converged"]}
    return {f"{prefix}{k}": v for k, v in out.items()}


def adam_probe(train_x, train_y, test_x, test_y, *, num_classes: int, epochs: int, lr: float,
               batch_size: int, key: jax.Array, scale: float = 1.0,
               prefix: str = "linear_probe_") -> dict:
    """Trains ``softmax(W x + b)`` (no penalty) with Adam for ``epochs`` epochs of
    ``batch_size`` rows in one compiled program and reports test top-1.

    Features are standardised as for ``lbfgs_probe`` (so that one learning rate works across
    models and normalisations). The last partial batch of each epoch is dropped.

    Returns (keys after ``prefix``): ``accuracy`` (test top-1), ``train_accuracy``, ``loss``
    (the last epoch's mean training loss).
    """
    train_x, test_x = standardise(train_x, test_x, scale=scale)
    train_y, test_y = jnp.asarray(train_y, jnp.int32), jnp.asarray(test_y, jnp.int32)
    n, d = train_x.shape
    batch_size = min(batch_size, n)
    steps = n // batch_size
    tx = optax.adam(lr)
    params = {"w": jnp.zeros((d, num_classes)), "b": jnp.zeros((num_classes,))}

    def loss_fn(p, x, y):
        logits = x @ p["w"] + p["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def fit(params, key, train_x, train_y):
        def epoch(carry, e):
            def step(carry, t):
                params, opt_state = carry
                rows = jax.lax.dynamic_slice_in_dim(order, t * batch_size, batch_size)
                loss, grads = jax.value_and_grad(loss_fn)(params, train_x[rows], train_y[rows])
                updates, opt_state = tx.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), loss

            order = jax.random.permutation(jax.random.fold_in(key, e), n)
            carry, losses = jax.lax.scan(step, carry, jnp.arange(steps))
            return carry, jnp.mean(losses)

        (params, _), losses = jax.lax.scan(epoch, (params, tx.init(params)), jnp.arange(epochs))
        return params, losses[-1]

    params, last_loss = fit(params, key, train_x, train_y)
    out = {"accuracy": _accuracy(params, test_x, test_y),
           "train_accuracy": _accuracy(params, train_x, train_y),
           "loss": float(last_loss)}
    return {f"{prefix}{k}": v for k, v in out.items()}

"""Max-pooling formulations with a hand-written gradient against the package's reshape and max
(``fedjax_rcl.nn.pool.max_pool``), each after bias + ReLU as in the CNNs, timed alone (jitted,
300 calls each) at the two pool shapes of MOON's CNN at batch 50; each one's gradients are
checked bitwise against the reference's. Run with the CNNs' XLA option:

    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= \
        python experiments/small_model_speed/pool_vjp.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_rcl.nn.pool import max_pool


def seconds_per_call(fn, *args, n=300) -> float:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(n):
        r = fn(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n


def reference(y):
    return max_pool(y, 2)


def slices(y):
    """The maximum of the window's four strided slices."""
    return jnp.maximum(jnp.maximum(y[:, 0::2, 0::2], y[:, 0::2, 1::2]),
                       jnp.maximum(y[:, 1::2, 0::2], y[:, 1::2, 1::2]))


def with_vjp(forward, backward):
    """``forward`` with its gradient written out: ``backward(y, out, g) -> dy``."""

    @jax.custom_vjp
    def pool(y):
        return forward(y)

    def fwd(y):
        out = forward(y)
        return out, (y, out)

    def bwd(res, g):
        return (backward(*res, g),)

    pool.defvjp(fwd, bwd)
    return pool


def by_reshape(split_ties=True):
    """``dy`` to the window's maxima through a reshape of the input: split equally among ties
    as JAX's own rule does, or to every maximum."""

    def backward(y, out, g):
        b, h, w, c = y.shape
        mask = y.reshape(b, h // 2, 2, w // 2, 2, c) == out[:, :, None, :, None, :]
        gg = g[:, :, None, :, None, :]
        if split_ties:
            gg = gg / mask.sum(axis=(2, 4), keepdims=True).astype(y.dtype)
        return jnp.where(mask, gg, 0).reshape(b, h, w, c)

    return backward


def by_repeat(y, out, g):
    """``dy`` to every maximum, through the output repeated to the input's size."""
    up = jnp.repeat(jnp.repeat(out, 2, 1), 2, 2)
    return jnp.where(y == up, jnp.repeat(jnp.repeat(g, 2, 1), 2, 2), 0)


def to_first_maximum(y, out, g):
    """``dy`` to the first maximum of each window in row-major order (``torch.nn.MaxPool2d``'s
    rule): a subgradient, and after a ReLU the same gradient as the model's (the only ties are
    all-zero windows, whose gradient the ReLU zeroes)."""
    parts = (y[:, 0::2, 0::2], y[:, 0::2, 1::2], y[:, 1::2, 0::2], y[:, 1::2, 1::2])
    taken = jnp.zeros(out.shape, bool)
    grads = []
    for p in parts:
        hit = (p == out) & ~taken
        taken = taken | hit
        grads.append(jnp.where(hit, g, 0))
    top = jnp.stack(grads[:2], axis=3)  # [B, Ho, Wo, 2, C]: window row 0, columns 0, 1
    bottom = jnp.stack(grads[2:], axis=3)
    b, ho, wo, c = out.shape
    rows = jnp.stack([top.reshape(b, ho, 2 * wo, c), bottom.reshape(b, ho, 2 * wo, c)], 2)
    return rows.reshape(b, 2 * ho, 2 * wo, c)


def main() -> None:
    rng = np.random.default_rng(0)
    variants = {"reshape-and-max (the model's)": reference,
                "reshape-and-max, gradient written out": with_vjp(reference, by_reshape()),
                "slices, gradient written out": with_vjp(slices, by_reshape()),
                "slices, every maximum": with_vjp(slices, by_reshape(split_ties=False)),
                "slices, repeated output": with_vjp(slices, by_repeat),
                "slices, first maximum (PyTorch's rule)": with_vjp(slices, to_first_maximum)}
    # MOON's CNN's two pools at batch 50; pfl's CNN's (batch 10); MFCL's stem (batch 64).
    for shape in [(50, 28, 28, 6), (50, 10, 10, 16), (10, 28, 28, 64), (64, 32, 32, 64)]:
        b, h, w, c = shape
        x = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
        bias = jnp.asarray(rng.standard_normal(c, dtype=np.float32))
        dy = jnp.asarray(rng.standard_normal((b, h // 2, w // 2, c), dtype=np.float32))

        def grads(pool):
            return jax.jit(lambda x_, b_, g_: jax.vjp(
                lambda u, v: pool(jax.nn.relu(u + v)), x_, b_)[1](g_))

        want = grads(reference)(x, bias, dy)
        print(shape)
        for name, pool in variants.items():
            forward = jax.jit(lambda x, bias, pool=pool: pool(jax.nn.relu(x + bias)))
            backward = grads(pool)
            same = all(bool(jnp.array_equal(a, e))
                       for a, e in zip(backward(x, bias, dy), want, strict=True))
            print(f"  {name:40s} forward {seconds_per_call(forward, x, bias) * 1e6:7.1f} us"
                  f"  forward+gradient {seconds_per_call(backward, x, bias, dy) * 1e6:7.1f} us"
                  f"  gradients bitwise the reshape's: {same}")


if __name__ == "__main__":
    main()

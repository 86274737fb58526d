"""Does a model learn at all? Central (non-federated) SGD on the embedded digits, a few
settings of learning rate and momentum from one initialisation, with the clipping and weight
decay of the federated runs (clip 10, weight decay 1e-3), batch 50.

    python experiments/backbones/central_probe.py MODEL STEPS LR,MOMENTUM [LR,MOMENTUM ...]
    python experiments/backbones/central_probe.py shufflenet 60 0.003,0 0.01,0.9 0.001,0.9

Prints the training loss every 10 steps, the mean of the last 10, and the accuracy on the last
400 training images (a sanity check, not a result). Used to tell a model that cannot learn
(a bug) from a learning rate that does not suit it (experiments/backbones/README.md).
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fedjax_rcl.data.embedded import load_digits
    from fedjax_rcl.models import get_model
    from fedjax_rcl.models.base import model_fns

    name, steps = argv[0], int(argv[1])
    settings = [tuple(map(float, s.split(","))) for s in argv[2:]]
    ds = load_digits()
    x = ((np.asarray(ds.train_images) / 255.0 - np.asarray(ds.mean)) / np.asarray(ds.std)
         ).astype(np.float32)
    y = np.asarray(ds.train_labels)
    fns = model_fns(get_model(name, num_classes=10))
    p0, st = fns.init(jax.random.PRNGKey(0), x[:2])
    tx = optax.inject_hyperparams(lambda lr, mom: optax.chain(
        optax.clip_by_global_norm(10.0), optax.add_decayed_weights(1e-3),
        optax.sgd(lr, momentum=mom)))(lr=0.1, mom=0.9)

    def loss_fn(p, xb, yb):
        logits = fns.apply(p, st, xb, train=True)[0].logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    @jax.jit
    def step(p, o, xb, yb):
        loss, g = jax.value_and_grad(loss_fn)(p, xb, yb)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    predict = jax.jit(lambda p, xb: fns.apply(p, st, xb, train=False)[0].logits.argmax(-1))
    for lr, mom in settings:
        p, o = p0, tx.init(p0)
        o.hyperparams["lr"], o.hyperparams["mom"] = jnp.float32(lr), jnp.float32(mom)
        rng, losses, t = np.random.default_rng(0), [], time.time()
        for _ in range(steps):
            idx = rng.choice(len(x), 50, replace=False)
            p, o, loss = step(p, o, x[idx], y[idx])
            losses.append(float(loss))
        acc = float((np.asarray(predict(p, x[-400:])) == y[-400:]).mean())
        print(f"{name} lr={lr} momentum={mom} loss every 10 steps "
              f"{[round(v, 2) for v in losses[::10]]} last 10 {np.mean(losses[-10:]):.2f} "
              f"accuracy {acc:.3f} ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

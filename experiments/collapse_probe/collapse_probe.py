"""How collapsed are a run's features? Diagnostics of the newest checkpoint's global model.

On ``--images`` test images (a fixed random subset of the test set), with the global model in
eval mode:

* per feature level (FedRCL's levels, pooled, pre-ReLU) and for the embedding: the mean
  pairwise cosine similarity over distinct pairs (1.0 = every image maps to one direction);
* for the embedding: effective rank, within/between-class covariance traces and the
  variability collapse index (``fedjax_rcl.metrics``);
* the fraction of predictions that fall in the most predicted class (1.0 = one class);
* the stem normalisation's scale and shift (GroupNorm's gamma and beta): the mean |gamma| and
  the mean |beta|, since one way to collapse the stem level is a shift that swamps the signal.

    python experiments/collapse_probe/collapse_probe.py \\
        experiments/runs/fidelity_cpu/fedrcl-a0.3 [RUN_DIR ...]

Prints one JSON object per run (and ``--out FILE`` writes them as a JSON list).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def probe(run_dir: str, images: int) -> dict:
    import jax

    from fedjax_rcl.data.augment import normalize
    from fedjax_rcl.metrics import (
        class_covariance_traces,
        effective_rank,
        mean_pairwise_cosine,
        variability_collapse_index,
    )
    from fedjax_rcl.training import restore_run, state_from_checkpoint

    exp, restored = restore_run(run_dir)
    state = state_from_checkpoint(exp, restored.state)
    ds = exp.dataset
    # A fixed random subset: image folders list the test set class by class.
    pick = np.sort(np.random.default_rng(0).permutation(len(ds.test_labels))[:images])
    x = normalize(ds.test_images[pick], ds.mean, ds.std)
    y = np.asarray(ds.test_labels[pick])
    apply = jax.jit(lambda p, s, x: exp.model.apply(p, s, x, train=False)[0]._replace(blocks=()))
    outs = [apply(state.params, state.model_state, x[i:i + 250])
            for i in range(0, len(x), 250)]
    levels = [np.concatenate([np.asarray(o.features[k]) for o in outs])
              for k in range(len(outs[0].features))]
    emb = np.concatenate([np.asarray(o.embedding) for o in outs])
    pred = np.concatenate([np.asarray(o.logits).argmax(-1) for o in outs])
    within, between = class_covariance_traces(emb, y)
    result = {
        "run_dir": str(run_dir), "round": int(restored.step), "images": int(len(y)),
        "accuracy": float((pred == y).mean()),
        "top_class_fraction": float(np.bincount(pred).max() / len(pred)),
        "level_mean_cosine": [round(mean_pairwise_cosine(f), 4) for f in levels],
        "embedding_mean_cosine": round(mean_pairwise_cosine(emb), 4),
        "embedding_effective_rank": round(effective_rank(emb), 3),
        "embedding_trace_within": within, "embedding_trace_between": between,
        "embedding_vci": variability_collapse_index(emb, y),
    }
    stem = state.params.get("stem_norm", {})
    stem = stem.get("gn", stem)
    if "scale" in stem:
        result["stem_mean_abs_scale"] = float(np.abs(np.asarray(stem["scale"])).mean())
        result["stem_mean_abs_shift"] = float(np.abs(np.asarray(stem["bias"])).mean())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = []
    for run_dir in args.run_dirs:
        results.append(probe(run_dir, args.images))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

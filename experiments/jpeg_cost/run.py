"""The JPEG's cost measured: the same model trained centrally on lossless and on JPEG CIFAR-10.

6,102 images of the binary CIFAR-10 release can be had lossless (the first 1,017 of each python
batch, in 3 MiB prefixes of the batch files). ``build`` writes them twice as image folders the
package reads (``dataset=imagefolder:PATH``): ``lossless/`` (PNG of the release's pixels) and
``jpeg/`` (the archive's quality-75 JPEG file of each image, its bytes copied), the same names in
the same layout, so the loader (sorted paths) gives image k the same picture and label in both.
``train`` trains one model centrally (one client holding the whole training set) on each
folder with the same seed, and evaluates each trained model on both folders' test images.
``table`` writes ``results.json`` and ``table.md`` from the runs. ``--commit C`` imports the
package as committed at ``C`` rather than the working tree. README.md: the commands run.

    python experiments/jpeg_cost/run.py build --batches BATCHES_DIR --archive cifar10-jpeg.zip
    python experiments/jpeg_cost/run.py --commit 3966652 train --model moon_cnn \
        --seeds 0 1 2 3 4 --rounds 12 --local-epochs 5
    python experiments/jpeg_cost/run.py table

Image folders and runs live under ``~/.cache/fedjax-rcl/jpeg_cost`` ($JPEG_COST_ROOT); only
small records (config, metrics, commands, environment, the crossed evaluations) are copied into
``experiments/jpeg_cost/records``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tools"))

import authors_split as asp  # noqa: E402  (tools/authors_split.py)

ROOT = Path(os.environ.get("JPEG_COST_ROOT", "~/.cache/fedjax-rcl/jpeg_cost")).expanduser()
VERSIONS = ("lossless", "jpeg")
RECORDS = HERE / "records"
RECORD_FILES = ("config.yaml", "metrics.jsonl", "commands.txt", "environment.jsonl")

# MOON's CIFAR-10 training (experiments/paper/moon_cifar10_cnn.yaml), centrally: one client
# holding the whole training set, every round.
COMMON = ("algorithm=fedavg", "num_clients=1", "participation=1", "partition=iid",
          "batch_size=64", "drop_last=true", "lr=0.01", "lr_decay=1", "momentum=0.9",
          "weight_decay=1e-5", "clip_norm=0", "augment=true", "transforms=moon",
          "eval_every=1", "checkpoint_every=0", "keep_checkpoints=3")
MODELS = {"moon_cnn": ("model=moon_cnn",), "resnet10": ("model=resnet10", "width=16")}


def folder(version: str) -> Path:
    return ROOT / version


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --------------------------------------------------------------------------------------------
# build


def build(args) -> int:
    """Writes ``lossless/`` and ``jpeg/``: each release image whose pixels the batch prefixes
    hold, as ``<split>/<class>/<release index>.png`` (lossless) and ``.jpg`` (the archive file
    ``tools/authors_split.py`` maps it to), then checks both folders as the package loads them."""
    from PIL import Image

    batches, archive = Path(args.batches), Path(args.archive)
    train_y = asp.release_labels(batches)
    members = {s: asp.archive_members(archive, s) for s in ("train", "test")}
    index = {"train": asp.release_to_archive(train_y, members["train"])}
    for v in VERSIONS:
        if folder(v).exists():
            shutil.rmtree(folder(v))
    pixels: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    labels: dict[str, list[int]] = {"train": [], "test": []}
    errors: dict[str, list[float]] = {"train": [], "test": []}
    sources = {}
    with zipfile.ZipFile(archive) as z:
        prefix = asp._top_folder(asp._images(z))
        for name in (*asp.TRAIN_BATCHES, "test_batch"):
            raw = (batches / name).read_bytes()
            sources[name] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
            y, images = asp.read_batch(raw)
            split = "test" if name == "test_batch" else "train"
            if split == "train":
                offset = 10000 * (int(name[-1]) - 1)
                if not np.array_equal(y, train_y[offset:offset + y.size]):
                    raise SystemExit(f"{name}: labels differ from the training labels")
                at = index["train"]
            else:
                offset = 0
                at = asp.release_to_archive(y, members["test"], "test")
            labels_all = train_y if split == "train" else y
            for k in range(images.shape[0]):
                i = offset + k
                cls = asp.CLASSES[labels_all[i]]
                member = members[split][at[i]]
                if member.split("/")[1] != cls:
                    raise SystemExit(f"release {split} image {i} maps to {member}, not {cls}")
                stem = f"{i:05d}"
                for v in VERSIONS:
                    (folder(v) / split / cls).mkdir(parents=True, exist_ok=True)
                Image.fromarray(images[k]).save(folder("lossless") / split / cls / f"{stem}.png")
                blob = z.read(prefix + member)
                (folder("jpeg") / split / cls / f"{stem}.jpg").write_bytes(blob)
                with Image.open(io.BytesIO(blob)) as im:
                    jpeg = np.asarray(im.convert("RGB"))
                errors[split].append(float(np.abs(jpeg.astype(np.int16) - images[k]).mean()))
                pixels[split].append((f"{cls}/{stem}", images[k]))
                labels[split].append(int(labels_all[i]))
            print(f"{name}: {images.shape[0]} images written", flush=True)
    # The loader reads sorted paths: the release's pixels in that order, to compare exactly.
    checks = check_folders({s: np.stack([x for _, x in sorted(pixels[s], key=lambda t: t[0])])
                            for s in pixels})
    summary = {
        "batches": sources, "archive": str(archive),
        "archive_bytes": archive.stat().st_size,
        "images": {s: len(labels[s]) for s in labels},
        "matched_mean_abs_error": {s: {"median": float(np.median(e)), "max": float(np.max(e))}
                                   for s, e in errors.items()},
        "checks": checks,
    }
    (HERE / "build.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["checks"], indent=1))
    return 0


def check_folders(release: dict[str, np.ndarray]) -> dict:
    """Both folders as the package loads them: the same labels in the same order, the lossless
    pixels equal to the release's (``release``: each split's images in the loader's order),
    image k of one the same picture as image k of the other."""
    from fedjax_rcl.data import load_dataset

    ds = {v: load_dataset(f"imagefolder:{folder(v)}") for v in VERSIONS}
    a, b = ds["lossless"], ds["jpeg"]
    out = {}
    for split in ("train", "test"):
        xa, xb = getattr(a, f"{split}_images"), getattr(b, f"{split}_images")
        ya, yb = getattr(a, f"{split}_labels"), getattr(b, f"{split}_labels")
        if not np.array_equal(ya, yb):
            raise SystemExit(f"{split}: the two folders' labels differ in the loader's order")
        if not np.array_equal(xa, release[split]):
            raise SystemExit(f"{split}: the lossless folder's pixels are not the release's")
        d = np.abs(xa.astype(np.int16) - xb.astype(np.int16)).mean(axis=(1, 2, 3))
        # The same picture: the JPEG error (<= 13 levels on these images) against another
        # image of the same class (>= 21.9; experiments/authors_split/mapping/README.md).
        shifted = np.abs(xa.astype(np.int16) - np.roll(xb, 1, axis=0).astype(np.int16)).mean(
            axis=(1, 2, 3))
        if d.max() >= 20:
            raise SystemExit(f"{split}: image {int(d.argmax())} differs by {d.max():.1f} levels "
                             "between the folders: not the same picture")
        out[split] = {"images": int(ya.size), "labels_equal": True,
                      "lossless_pixels_equal_release": True,
                      "class_counts": np.bincount(ya, minlength=10).tolist(),
                      "mean_abs_diff_same_position": {"median": float(np.median(d)),
                                                      "max": float(d.max())},
                      "mean_abs_diff_next_position": {"median": float(np.median(shifted)),
                                                      "min": float(shifted.min())}}
    out["class_names_equal"] = a.class_names == b.class_names
    out["normalisation"] = {v: {"mean": list(ds[v].mean), "std": list(ds[v].std)}
                            for v in VERSIONS}
    return out


# --------------------------------------------------------------------------------------------
# train


def run_name(model: str, version: str, seed: int) -> str:
    return f"{model}-{version}-s{seed}"


def overrides(model: str, version: str, seed: int, rounds: int, epochs: int) -> list[str]:
    return [f"dataset=imagefolder:{folder(version)}", *MODELS[model], *COMMON,
            f"rounds={rounds}", f"local_epochs={epochs}", f"seed={seed}",
            f"run_dir={ROOT / 'runs' / run_name(model, version, seed)}"]


def _initial_fingerprint(run_dir: Path) -> list:
    """The round-0 checkpoint's fingerprint: per leaf of the whole state (weights, server
    optimizer, root key), its sum and sum of squares (``fedjax_rcl.checkpoint.fingerprint``)."""
    from fedjax_rcl.rundir import RunDir

    meta = RunDir(run_dir).checkpoint_dir() / "0" / "meta" / "metadata"
    return json.loads(meta.read_text())["fingerprint"]


def first_batch(seed: int, n: int, epochs: int, batch: int = 64) -> list[int]:
    """The training indices of round 0's first step, as the engine draws them
    (``engine.round.client_keys``, ``engine.client.epoch_permutations``): from the seed and the
    client's size alone (one client, ``partition=iid``: all ``n`` samples in order)."""
    import jax

    from fedjax_rcl.data import partition
    from fedjax_rcl.engine.client import epoch_permutations
    from fedjax_rcl.engine.round import client_keys

    (part,) = partition(np.zeros(n, np.int64), 1, method="iid", seed=seed)
    key = client_keys(jax.random.PRNGKey(seed), np.int32(0), np.zeros(1, np.int32))[0]
    perm_key, _ = jax.random.split(key)
    perms = np.asarray(epoch_permutations(perm_key, np.int32(n), n, epochs))
    return part[perms[0, :batch]].tolist()


def _git(*a: str) -> str:
    return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout


def pin_package(commit: str) -> Path:
    """Imports the package as committed at ``commit`` (``git archive`` of ``fedjax_rcl/`` under
    the cache, first on ``sys.path``), not the working tree, which others may be editing."""
    full = _git("rev-parse", "--verify", f"{commit}^{{commit}}").strip()
    where = ROOT / "package" / full[:12]
    if not (where / "fedjax_rcl" / "__init__.py").exists():
        where.mkdir(parents=True, exist_ok=True)
        tar = subprocess.run(["git", "archive", full, "fedjax_rcl"], cwd=REPO,
                             capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            t.extractall(where, filter="data")
    sys.path.insert(0, str(where))
    return where


def package_state() -> dict:
    """Where the imported package came from: a pinned commit, or the working tree (its commit
    and the files with uncommitted changes)."""
    import fedjax_rcl

    where = Path(fedjax_rcl.__file__).resolve().parent
    if where.parent.parent == ROOT / "package":
        return {"pinned_commit": _git("rev-parse", where.parent.name).strip(),
                "path": str(where)}
    return {"working_tree_commit": _git("rev-parse", "HEAD").strip(),
            "uncommitted_files": _git("diff", "HEAD", "--name-only", "--",
                                      "fedjax_rcl").split(), "path": str(where)}


def train(args) -> int:
    import fedjax_rcl
    from fedjax_rcl.data import load_dataset

    package = package_state()
    ds = {v: load_dataset(f"imagefolder:{folder(v)}") for v in VERSIONS}
    timing_path = ROOT / "runs" / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    for seed in args.seeds:
        for version in VERSIONS:
            name = run_name(args.model, version, seed)
            run_dir = ROOT / "runs" / name
            done = (run_dir / "evals.json").exists()
            if done and not args.force:
                print(f"{name}: done", flush=True)
                continue
            if run_dir.exists():
                shutil.rmtree(run_dir)
            t0, c0 = time.time(), _cpu_seconds()
            run = fedjax_rcl.train(None, *overrides(args.model, version, seed, args.rounds,
                                                    args.local_epochs),
                                   dataset=ds[version], progress=args.progress)
            t1, c1 = time.time(), _cpu_seconds()
            evals = {}
            for test in VERSIONS:  # the last checkpoint on both folders' test images
                e = fedjax_rcl.evaluate(run_dir, dataset=ds[test])
                evals[test] = {"test_accuracy": e["test_accuracy"], "test_loss": e["test_loss"],
                               "round": e["round"]}
            # The run's own last evaluation is of its own test split: the same number again.
            own = run.metrics[-1]["test_accuracy"]
            if abs(own - evals[version]["test_accuracy"]) > 1e-6:
                raise SystemExit(f"{name}: evaluate gives {evals[version]} but the run's last "
                                 f"evaluation was {own}")
            record = {"run": name, "model": args.model, "train": version, "seed": seed,
                      "rounds": args.rounds, "local_epochs": args.local_epochs,
                      "test": evals, "initial_fingerprint": _initial_fingerprint(run_dir),
                      "first_batch": first_batch(seed, ds[version].train_labels.size,
                                                 args.local_epochs),
                      "package": package, "train_wall_s": round(t1 - t0, 1),
                      "train_cpu_s": round(c1 - c0, 1),
                      "eval_wall_s": round(time.time() - t1, 1)}
            (run_dir / "evals.json").write_text(json.dumps(record, indent=1) + "\n")
            timing[name] = {k: record[k] for k in ("train_wall_s", "train_cpu_s", "eval_wall_s")}
            timing_path.write_text(json.dumps(timing, indent=1) + "\n")
            copy_records(run_dir)
            print(f"{name}: {json.dumps(evals)} ({record['train_wall_s']} s wall, "
                  f"{record['train_cpu_s']} s CPU)", flush=True)
    return 0


def copy_records(run_dir: Path) -> None:
    out = RECORDS / run_dir.name
    out.mkdir(parents=True, exist_ok=True)
    for f in (*RECORD_FILES, "evals.json"):
        if (run_dir / f).exists():
            shutil.copy2(run_dir / f, out / f)


# --------------------------------------------------------------------------------------------
# table


def _mean_sd(x: list[float]) -> dict:
    a = np.asarray(x, np.float64)
    return {"mean": float(a.mean()), "sd": float(a.std(ddof=1)) if a.size > 1 else None,
            "n": int(a.size)}


def _last_mean(metrics: Path, k: int = 3) -> float:
    accs = [json.loads(line)["test_accuracy"] for line in metrics.read_text().splitlines()
            if line.strip()]
    return float(np.mean(accs[-k:]))


def _cell(m: dict, sign: str = "") -> str:
    sd = f" ± {m['sd']:.4f}" if m["sd"] is not None else ""
    return f"{m['mean']:{sign}.4f}{sd}"


def table(args) -> int:
    del args
    records = [json.loads(p.read_text()) for p in sorted(RECORDS.glob("*/evals.json"))]
    results, lines = {}, []
    for model in MODELS:
        mine = {(r["train"], r["seed"]): r for r in records if r["model"] == model}
        seeds = sorted({s for v, s in mine if all((w, s) in mine for w in VERSIONS)})
        if not seeds:
            continue
        rows = []
        for s in seeds:
            a, b = mine[("lossless", s)], mine[("jpeg", s)]
            same_start = (np.allclose(a["initial_fingerprint"], b["initial_fingerprint"],
                                      rtol=0, atol=0)
                          and a["first_batch"] == b["first_batch"])
            ll, lj = a["test"]["lossless"]["test_accuracy"], a["test"]["jpeg"]["test_accuracy"]
            jl, jj = b["test"]["lossless"]["test_accuracy"], b["test"]["jpeg"]["test_accuracy"]
            # Each run's own test split was evaluated after every round: the mean of the last
            # three rounds' evaluations, less tied to one round's end.
            last = {v: _last_mean(RECORDS / run_name(model, v, s) / "metrics.jsonl")
                    for v in VERSIONS}
            rows.append({"seed": s, "lossless/lossless": ll, "jpeg/jpeg": jj,
                         "lossless/jpeg": lj, "jpeg/lossless": jl, "paired_diff": ll - jj,
                         "last3_lossless": last["lossless"], "last3_jpeg": last["jpeg"],
                         "last3_paired_diff": last["lossless"] - last["jpeg"],
                         # the test images' version alone, for each trained model
                         "lossless_model_lossless_minus_jpeg_test": ll - lj,
                         "jpeg_model_lossless_minus_jpeg_test": jl - jj,
                         "same_start": bool(same_start),
                         "rounds": a["rounds"], "local_epochs": a["local_epochs"],
                         "train_wall_s": [a["train_wall_s"], b["train_wall_s"]],
                         "train_cpu_s": [a["train_cpu_s"], b["train_cpu_s"]]})
        summary = {k: _mean_sd([r[k] for r in rows])
                   for k in ("lossless/lossless", "jpeg/jpeg", "lossless/jpeg", "jpeg/lossless",
                             "paired_diff", "last3_lossless", "last3_jpeg", "last3_paired_diff",
                             "lossless_model_lossless_minus_jpeg_test",
                             "jpeg_model_lossless_minus_jpeg_test")}
        results[model] = {"rows": rows, "summary": summary}
        epochs = rows[0]["rounds"] * rows[0]["local_epochs"]
        lines += [f"### {model} ({rows[0]['rounds']} rounds x {rows[0]['local_epochs']} epochs"
                  f" = {epochs} epochs)", "",
                  "Test accuracy on the 1,017 test images, train version / test version.", "",
                  "| seed | lossless/lossless | jpeg/jpeg | difference | lossless/jpeg "
                  "| jpeg/lossless | same start |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['seed']} | {r['lossless/lossless']:.4f} | {r['jpeg/jpeg']:.4f} "
                         f"| {r['paired_diff']:+.4f} | {r['lossless/jpeg']:.4f} "
                         f"| {r['jpeg/lossless']:.4f} | {'yes' if r['same_start'] else 'NO'} |")

        c = {k: _cell(m, "+" if ("diff" in k or "minus" in k) else "")
             for k, m in summary.items()}
        lines += [f"| mean ± sd | {c['lossless/lossless']} | {c['jpeg/jpeg']} "
                  f"| {c['paired_diff']} | {c['lossless/jpeg']} | {c['jpeg/lossless']} | |", "",
                  "The test images' version alone (lossless minus JPEG test images): "
                  f"lossless-trained {c['lossless_model_lossless_minus_jpeg_test']}, "
                  f"JPEG-trained {c['jpeg_model_lossless_minus_jpeg_test']}.", ""]
        if rows[0]["rounds"] >= 10:  # the last three rounds on a plateau, not on the rise
            lines += ["The mean of each run's last three evaluations (own test split):", "",
                      "| seed | lossless/lossless | jpeg/jpeg | difference |",
                      "|---|---|---|---|"]
            lines += [f"| {r['seed']} | {r['last3_lossless']:.4f} | {r['last3_jpeg']:.4f} "
                      f"| {r['last3_paired_diff']:+.4f} |" for r in rows]
            lines += [f"| mean ± sd | {c['last3_lossless']} | {c['last3_jpeg']} "
                      f"| {c['last3_paired_diff']} |", ""]
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (HERE / "table.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit", help="import the package as committed at this commit (git "
                   "archive under the cache), not the working tree")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="the lossless and JPEG image folders")
    b.add_argument("--batches", required=True,
                   help="a folder of the release's python batches (prefixes will do)")
    b.add_argument("--archive", required=True, help="cifar10-jpeg.zip")
    t = sub.add_parser("train", help="train on both folders and evaluate crossed")
    t.add_argument("--model", choices=sorted(MODELS), required=True)
    t.add_argument("--seeds", type=int, nargs="+", required=True)
    t.add_argument("--rounds", type=int, required=True)
    t.add_argument("--local-epochs", type=int, required=True)
    t.add_argument("--force", action="store_true", help="retrain runs already done")
    t.add_argument("--progress", action="store_true")
    sub.add_parser("table", help="results.json and table.md from the records")
    args = p.parse_args(argv)
    if args.commit:
        pin_package(args.commit)
    return {"build": build, "train": train, "table": table}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

"""One round of MOON's Table 1 setting at one local epoch, theirs and ours, on the same machine.

Alternates, in fresh processes: our round (``experiments/small_model_speed/moon_setting.py``'s
worker: the suite's config at ``local_epochs=1``, compiled once, two rounds timed, the second
reported) and the authors' (``harness.py``, two rounds of one epoch, their client-side
accuracy evaluations skipped, the second round reported: the first has no MOON term in their
code, its pool of previous models being empty). Their round is given whole and without the
global model's evaluation on the training and test sets that their loop runs every round; ours
is training alone (our test-set evaluation is a separate program).

    CIFAR10_JPEG_ZIP=... AUTHORS_MOON=... AUTHORS_PYTHON=.../bin/python \\
        python experiments/moon_table1/authors/round_time.py --data NPZ --json round_time.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def ours(algorithm: str) -> float:
    spec = json.dumps({"algorithm": algorithm, "rounds": 2})
    out = subprocess.run([sys.executable, str(ROOT / "experiments/small_model_speed/"
                                              "moon_setting.py"), "--worker", spec],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["round_s"][-1]


def theirs(algorithm: str, data: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([os.environ["AUTHORS_PYTHON"], str(HERE / "harness.py"), "--data",
                        str(data), "--alg", algorithm, "--rounds", "2", "--epochs", "1",
                        "--skip-client-evals", "--workdir", tmp], check=True,
                       capture_output=True)
        last = json.loads((Path(tmp) / "metrics.jsonl").read_text().splitlines()[-1])
    return {"round_s": last["round_s"], "global_eval_s": last["global_eval_s"],
            "training_s": round(last["round_s"] - last["global_eval_s"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--algorithms", nargs="+", default=["moon", "fedavg"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_round import machine

    out = {"machine": machine(), "passes": []}
    for p in range(args.passes):
        for algorithm in args.algorithms:
            row = {"pass": p, "algorithm": algorithm, "ours_s": ours(algorithm),
                   "theirs": theirs(algorithm, args.data)}
            row["theirs_training_over_ours"] = row["theirs"]["training_s"] / row["ours_s"]
            row["theirs_round_over_ours"] = row["theirs"]["round_s"] / row["ours_s"]
            out["passes"].append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

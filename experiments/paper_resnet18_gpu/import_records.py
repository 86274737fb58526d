"""Files what device_paper_resnet18.sh brought back from a lent GPU as the study's run records.

    python experiments/paper_resnet18_gpu/import_records.py CALL_DIR [CALL_DIR ...] \
        [--dest experiments/runs/paper_gpu_h200_every_round] [--suffix _precision=bf16_rounds=500]

Each CALL_DIR is one device call's returned files (the device tool's ``files_at``):
``records.tar.gz`` (the run directories without checkpoints) and ``<run>.log``. Give the calls
of one run in the order they ran. A run directory ``fedrcl_precision=bf16_rounds=500_seed=1``
becomes ``DEST/fedrcl_seed=1`` (the default EXTRA's suffix dropped): its ``config.yaml``,
``commands.txt``, ``environment.jsonl`` and ``metrics.jsonl`` from the last call that had it
(a resumed run's directory holds every call's records), and ``train.log``, every call's log of
it joined in order. Nothing else is copied; checkpoints never travel.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

RECORDS = ("config.yaml", "commands.txt", "environment.jsonl", "metrics.jsonl")


def import_calls(calls: list[Path], dest: Path, suffix: str) -> dict[str, Path]:
    """``{run directory name: where it was filed}``; raises ``SystemExit`` naming a call that
    has no records."""
    filed: dict[str, Path] = {}
    logs: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, call in enumerate(calls):
            archive = call / "records.tar.gz"
            if not archive.is_file():
                raise SystemExit(f"{call}: no records.tar.gz (not a call of "
                                 "device_paper_resnet18.sh, or it was stopped before the end)")
            into = Path(tmp) / str(i)
            with tarfile.open(archive) as tar:
                tar.extractall(into, filter="data")
            for run in sorted(p for p in into.iterdir() if p.is_dir()):
                target = dest / run.name.replace(suffix, "")
                target.mkdir(parents=True, exist_ok=True)
                for name in RECORDS:
                    if (run / name).is_file():
                        shutil.copyfile(run / name, target / name)
                filed[run.name] = target
                log = call / f"{run.name.split('_', 1)[0]}.log"  # named by ONLY's run name
                if log.is_file():
                    logs.setdefault(run.name, []).append(log.read_text())
    for run, parts in logs.items():
        (filed[run] / "train.log").write_text("".join(parts))
    return filed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("calls", nargs="+", type=Path)
    ap.add_argument("--dest", type=Path,
                    default=Path("experiments/runs/paper_gpu_h200_every_round"))
    ap.add_argument("--suffix", default="_precision=bf16_rounds=500")
    args = ap.parse_args(argv)
    for run, target in import_calls(args.calls, args.dest, args.suffix).items():
        print(f"{run} -> {target}: {', '.join(sorted(p.name for p in target.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

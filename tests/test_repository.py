"""What the repository tracks: never a checkpoint.

A checkpoint is large (an Orbax run state: megabytes to hundreds of megabytes) and, once
committed, stays in every clone's history forever. Runs keep their checkpoints in an ignored
``checkpoints/`` folder (``.gitignore``, docs/reproducing.md); this test is the check that fails
when one is added anyway (``git add -f``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_FOLDERS = {"checkpoints", "checkpoints-damaged", "client_table"}


def _tracked_files() -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not a git checkout (an unpacked archive?)")
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                         check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def test_no_checkpoint_is_tracked():
    files = _tracked_files()
    assert files, "git ls-files listed nothing"
    tracked = [p for p in files if CHECKPOINT_FOLDERS & set(Path(p).parts[:-1])]
    assert not tracked, (
        f"{len(tracked)} tracked file(s) under a checkpoints/ folder, e.g. {tracked[:3]}: "
        "checkpoints stay out of git (docs/reproducing.md); "
        "`git rm -r --cached` the folder")

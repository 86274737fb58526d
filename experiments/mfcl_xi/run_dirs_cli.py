"""The command line shared by the tools that measure finished run directories: ``TOOL
RUN_DIR... [--out FILE.json]`` measures each run, optionally writes the results as JSON, and
prints their table; a bad run config exits with status 2 and one line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path


def main_over_run_dirs(prog: str, description: str, measure: Callable[[Path], dict],
                       table: Callable[[list[dict]], str], argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    from fedjax_rcl.validation import ConfigError

    try:
        results = [measure(p) for p in args.run_dirs]
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0

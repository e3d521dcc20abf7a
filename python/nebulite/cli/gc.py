"""``nebulite gc PATH [--dry-run]``: removes what runs that died left uncommitted in a
store, with the rules a starting trainer applies (nebulite/runs.h): a version directory
without a commit marker goes only when its run's lock is free and nothing in it changed
for the grace period (``dead_run_grace``, as init() resolves it). Committed checkpoints
are never touched (retention is the library's). Prints what it removes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .. import _core
from .._config import Config
from . import store
from .command import subcommand


def add_parser(sub: Any) -> None:
    p = subcommand(sub, "gc", help="remove uncommitted leftovers of runs that died", doc=__doc__,
                   run=run, examples=["nebulite gc /mnt/ckpt/run1 --dry-run",
                                      "nebulite gc /mnt/ckpt/run1"])
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--grace", metavar="SECONDS", default=None,
                   help="seconds a leftover must be unchanged (default: as init() resolves "
                        "dead_run_grace, $NEBULITE_DEAD_RUN_GRACE included)")


def run(args: argparse.Namespace) -> int:
    root = store.root_of(args.path)
    grace = Config.resolve(root, None, None, {"dead_run_grace": args.grace}).dead_run_grace
    removed, problems = _core.remove_dead_runs(root, "", grace, args.dry_run)
    for p in problems:
        print(f"nebulite gc: {p}", file=sys.stderr)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    if not removed:
        print(f"nothing to remove (leftovers unchanged for {grace:g} s of runs that died)")
    return 0

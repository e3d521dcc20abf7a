"""``nebulite history PATH [--plot FILE.png]``: checkpointHistories.csv as one row per
checkpoint: when it was saved, how long saving blocked training, how long persisting
took (from the first data file write to the commit marker), bytes, throughput to the
store, and the outcome. PATH is a store, or a history CSV (of a finished job, copied
anywhere)."""

from __future__ import annotations

import argparse
import csv
import io
import os
from dataclasses import asdict
from typing import Any

from .. import _core
from .._history import summarise
from . import output, store
from .command import subcommand

HISTORY_FILE = "checkpointHistories.csv"
MAX_HISTORY_BYTES = 1 << 30


def add_parser(sub: Any) -> None:
    p = subcommand(sub, "history",
                   help="per checkpoint: blocking time, persistence time, bytes, throughput",
                   doc=__doc__, run=run, path="a store, or a checkpointHistories.csv file",
                   examples=["nebulite history /mnt/ckpt/run1",
                             "nebulite history /mnt/ckpt/run1/checkpointHistories.csv --plot run1.png"])
    p.add_argument("--plot", metavar="FILE.png", help="also draw the history into this PNG")
    p.add_argument("--json", action="store_true", help="print JSON, for scripts")


def read_rows(path: str) -> list[dict[str, str]]:
    """The rows of a store's history (through its driver), or of a CSV file."""
    if path.endswith(".csv") and os.path.isfile(path):
        with open(path, newline="") as f:
            text = f.read()
    else:
        text = _core.read_store_file(store.root_of(path), HISTORY_FILE,
                                     MAX_HISTORY_BYTES).decode("utf-8", "replace")
    return list(csv.DictReader(io.StringIO(text)))


def run(args: argparse.Namespace) -> int:
    checkpoints = summarise(read_rows(args.path))
    if args.json:
        output.print_json([asdict(c) for c in checkpoints])
    else:
        output.table(
            ["SAVED (UTC)", "TAG", "VERSION", "BLOCKING", "PERSIST", "SIZE", "MB/S", "OUTCOME"],
            [[c.saved_utc.replace("T", " ").rstrip("Z"), c.tag, c.version,
              output.duration(c.blocking_seconds), output.duration(c.persist_seconds),
              output.size(c.bytes),
              f"{c.throughput_mb_s:.1f}" if c.throughput_mb_s is not None else None, c.outcome]
             for c in checkpoints])
    if args.plot:
        from .plot import plot_history

        plot_history(checkpoints, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0

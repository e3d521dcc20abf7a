"""``nebulite history PATH [--plot FILE.png]``: checkpointHistories.csv as one row per
checkpoint: when it was saved, how long saving blocked training, how long persisting
took (from the first data file write to the commit marker), bytes, throughput to the
store, and the outcome. PATH is a store, or a history CSV (of a finished job, copied
anywhere)."""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import os
from dataclasses import asdict, dataclass
from typing import Any

from .. import _core
from . import output, store

HISTORY_FILE = "checkpointHistories.csv"
MAX_HISTORY_BYTES = 1 << 30


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "history", help="per checkpoint: blocking time, persistence time, bytes, throughput",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__,
        epilog="examples:\n  nebulite history /mnt/ckpt/run1\n"
               "  nebulite history /mnt/ckpt/run1/checkpointHistories.csv --plot run1.png")
    p.add_argument("path", metavar="PATH", help="a store, or a checkpointHistories.csv file")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the history into this PNG")
    p.add_argument("--json", action="store_true", help="print JSON, for scripts")
    p.set_defaults(run=run)


@dataclass
class Checkpoint:
    tag: str
    version: str
    saved_utc: str          # the time of its first row
    blocking_seconds: float  # training stalled by its saves (the slowest rank)
    persist_seconds: float | None  # first data file write -> commit marker (None: not persisted)
    bytes: int
    throughput_mb_s: float | None
    outcome: str  # committed, in_memory, persisted, failed..., plus ", retired" once deleted


def _time(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def summarise(rows: list[dict[str, str]]) -> list[Checkpoint]:
    """Groups rows by (tag, version), in the order of their first row."""
    groups: dict[tuple[str, str], list[dict[str, str]]] = {}
    for r in rows:
        groups.setdefault((r["tag"], r["version"]), []).append(r)
    out = []
    for (tag, version), rs in groups.items():
        objects = [r for r in rs if r["name"]]
        blocking: dict[str, float] = {}  # rank -> seconds; one row per object and outcome
        seen = set()
        for r in objects:
            if (r["rank"], r["name"]) not in seen:
                seen.add((r["rank"], r["name"]))
                blocking[r["rank"]] = blocking.get(r["rank"], 0.0) + float(r["blocking_seconds"])
        writes = [_time(r["time_utc"]) - float(r["persist_seconds"])
                  for r in objects if r["outcome"] == "persisted"]
        commit = next((r for r in rs if r["outcome"] == "committed"), None)
        failed = next((r["outcome"] for r in rs if r["outcome"].startswith("failed")), None)
        nbytes = int(commit["bytes"]) if commit else sum(
            int(r["bytes"]) for r in objects if r["outcome"] in ("in_memory", "persisted"))
        persist = None
        if commit and writes:
            persist = max(float(commit["persist_seconds"]), _time(commit["time_utc"]) - min(writes))
        outcome = failed or ("committed" if commit else objects[-1]["outcome"] if objects
                             else rs[-1]["outcome"])
        if any(r["outcome"] == "deleted_by_retention" for r in rs):
            outcome += ", retired"
        out.append(Checkpoint(
            tag, version, rs[0]["time_utc"], max(blocking.values(), default=0.0), persist,
            nbytes, nbytes / persist / 1e6 if persist else None, outcome))
    return [c for c in out if c.outcome != "deleted_by_retention, retired"]


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

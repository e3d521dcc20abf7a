"""``nebulite ls PATH``: the checkpoints of a store, newest first: committed ones, those
this node's agent holds in memory only, and uncommitted leftovers."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..agent import control
from . import output, store
from .command import subcommand


def add_parser(sub: Any) -> None:
    p = subcommand(sub, "ls", help="list the checkpoints of a store", doc=__doc__, run=run,
                   examples=["nebulite ls /mnt/ckpt/run1", "nebulite ls /mnt/ckpt/run1 --json"])
    p.add_argument("--json", action="store_true", help="print JSON, for scripts")


def rows(root: str) -> list[dict[str, Any]]:
    """One dict per checkpoint version, newest first."""
    out: list[dict[str, Any]] = []
    seen = set()
    for v in store.committed(root):
        seen.add((v.tag, v.version))
        out.append({"tag": v.tag, "version": v.version, "seq": v.seq,
                    "committed_unix_ns": v.time_unix_ns, "bytes": v.bytes,
                    "objects": v.names, "world_size": v.world_size, "state": "committed",
                    "damaged": v.damaged})
    agent = control.status_for_root(root)
    held: dict[tuple[str, str], dict[str, Any]] = {}
    for v in agent["versions"] if agent else []:
        if v["seq"] and v["in_memory"] and not v["failed"] and not v["store_committed"]:
            held.setdefault((v["tag"], v["version"]), v)
    for (tag, version), v in held.items():
        if (tag, version) not in seen:
            seen.add((tag, version))
            out.append({"tag": tag, "version": version, "seq": int(v["seq"]),
                        "committed_unix_ns": None, "bytes": None, "objects": None,
                        "world_size": int(v["world_size"]), "state": "in memory only",
                        "damaged": None})
    out.sort(key=lambda r: r["seq"], reverse=True)
    for tag, version in store.uncommitted(root):
        if (tag, version) not in seen:
            out.append({"tag": tag, "version": version, "seq": None, "committed_unix_ns": None,
                        "bytes": None, "objects": None, "world_size": None,
                        "state": "uncommitted", "damaged": None})
    return out


def run(args: argparse.Namespace) -> int:
    found = rows(store.root_of(args.path))
    if args.json:
        output.print_json(found)
        return 0
    if not found:
        print(f"no checkpoints in {args.path}")
        return 0
    now = time.time_ns()
    table = []
    for r in found:
        t = r["committed_unix_ns"]
        state = r["state"] + (" (manifest damaged)" if r["damaged"] else "")
        table.append([r["tag"], r["version"], output.utc(t),
                      output.duration((now - t) / 1e9) if t else None,
                      output.size(r["bytes"]),
                      len(r["objects"]) if r["objects"] is not None else None, state])
    output.table(["TAG", "VERSION", "COMMITTED (UTC)", "AGE", "SIZE", "OBJECTS", "STATE"], table)
    return 0

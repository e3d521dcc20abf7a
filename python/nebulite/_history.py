"""The history of checkpoints, one entry per checkpoint, from the rows of
checkpointHistories.csv (or of ``history()``): what ``nebulite history`` prints and plots
and what ``NebulaCallback`` logs to the trainer's loggers."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass
class CheckpointHistory:
    tag: str
    version: str
    saved_utc: str           # the time of its first row
    blocking_seconds: float  # training stalled by its saves (the slowest rank)
    persist_seconds: float | None  # first data file write -> commit marker (None: not persisted)
    bytes: int
    throughput_mb_s: float | None  # bytes / persist_seconds
    outcome: str  # committed, in_memory, persisted, failed...; ", retired" once retention deleted it


def _seconds(r: Mapping[str, Any]) -> float:
    """When a row was added, in seconds since the epoch."""
    if r.get("time_unix_ns"):
        return int(r["time_unix_ns"]) / 1e9
    return datetime.datetime.fromisoformat(str(r["time_utc"]).replace("Z", "+00:00")).timestamp()


def _utc(r: Mapping[str, Any]) -> str:
    if r.get("time_utc"):
        return str(r["time_utc"])
    t = datetime.datetime.fromtimestamp(_seconds(r), tz=datetime.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def summarise(rows: list[Mapping[str, Any]]) -> list[CheckpointHistory]:
    """One entry per (tag, version), in the order of their first row. Versions that appear
    only as deleted by retention (saved before these rows began) are left out."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((str(r["tag"]), str(r["version"])), []).append(r)
    out = []
    for (tag, version), rs in groups.items():
        objects = [r for r in rs if r["name"]]
        if not objects and all(r["outcome"] == "deleted_by_retention" for r in rs):
            continue
        blocking: dict[str, float] = {}  # rank -> seconds, each object counted once
        seen = set()
        for r in objects:
            if (str(r["rank"]), r["name"]) not in seen:
                seen.add((str(r["rank"]), r["name"]))
                blocking[str(r["rank"])] = (blocking.get(str(r["rank"]), 0.0)
                                            + float(r["blocking_seconds"]))
        writes = [_seconds(r) - float(r["persist_seconds"])
                  for r in objects if r["outcome"] == "persisted"]
        commit = next((r for r in rs if r["outcome"] == "committed"), None)
        failed = next((str(r["outcome"]) for r in rs if str(r["outcome"]).startswith("failed")),
                      None)
        nbytes = int(commit["bytes"]) if commit else sum(
            int(r["bytes"]) for r in objects if r["outcome"] in ("in_memory", "persisted"))
        persist = None
        if commit is not None:
            persist = float(commit["persist_seconds"])
            if writes:
                persist = max(persist, _seconds(commit) - min(writes))
        outcome = failed or ("committed" if commit else str(objects[-1]["outcome"]) if objects
                             else str(rs[-1]["outcome"]))
        if any(r["outcome"] == "deleted_by_retention" for r in rs):
            outcome += ", retired"
        out.append(CheckpointHistory(
            tag, version, _utc(rs[0]), max(blocking.values(), default=0.0), persist, nbytes,
            nbytes / persist / 1e6 if persist else None, outcome))
    return out

"""Checks a store of the kill campaign (tests/kill_campaign.py) after a kill, from a process
that never called nebulite.init() (it sees the store only, no memory tier).

Usage: kill_verify.py --store S --journal-dir J --world W --out RESULT.json [--live]

What it checks (docs/reliability.md, "Kill campaign"):
- whole: every committed version (a decodable COMMITTED marker) has a manifest per rank
  whose CRC is the one its marker names, the objects a checkpoint of this world size
  holds, and data files of the size and CRC its manifest names; every object loads
  through get_checkpoint(tag, version, persist_path) bit for bit as saved at its step
  (the tag's, or for the tag "last" the one its model names);
- nothing else visible: list_checkpoints(persist_path) lists exactly the versions with a
  marker, in commit order (unique seq, steps never going back), and no reader warns of a
  damaged checkpoint;
- found again: get_latest_checkpoint(persist_path) is the newest of them, and it is at
  least as new as the newest step any rank's journal holds (flush_persistence() returned
  for it); that step is still listed unless RETENTION newer checkpoints were committed.

With --live an agent may still be persisting and applying retention while this runs: a
version whose marker retention deleted during the check (with RETENTION newer committed
ones) is not held against the store.

Writes {"listed", "verified", "latest", "journal", "excused", "problems"} as JSON to RESULT.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
import warnings
import zlib
from typing import Any

import nebulite as nm
from nebulite import _core

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kill_worker  # noqa: E402  (the expected content)

RETENTION = kill_worker.RETENTION


def marked_versions(store: str) -> set[tuple[str, str]]:
    """(tag, version) of every version directory holding a COMMITTED file."""
    out = set()
    try:
        tags = os.listdir(store)
    except FileNotFoundError:
        return out
    for tag in tags:
        if tag.startswith("."):
            continue
        try:
            versions = os.listdir(os.path.join(store, tag))
        except (NotADirectoryError, FileNotFoundError):
            continue
        for version in versions:
            if os.path.exists(os.path.join(store, tag, version, "COMMITTED")):
                out.add((tag, version))
    return out


def marker_manifest_crcs(path: str) -> dict[int, int]:
    """The `manifest <rank> <crc>` lines of a commit marker (docs/format.md)."""
    with open(path, "rb") as f:
        text = f.read().decode("ascii")
    out = {}
    for line in text.split("\n"):
        if line.startswith("manifest "):
            _, rank, crc = line.split(" ")
            out[int(rank)] = int(crc, 16)
    return out


class Check:
    def __init__(self, store: str, world: int, journal_dir: str, live: bool) -> None:
        self.store, self.world, self.journal_dir, self.live = store, world, journal_dir, live
        self.problems: list[dict[str, str]] = []
        self.excused = 0
        self.steps: dict[tuple[str, str], int] = {}  # (tag, version) -> the step it holds

    def problem(self, kind: str, detail: str) -> None:
        self.problems.append({"kind": kind, "detail": detail})

    def retired_meanwhile(self, tag: str, version: str, seq: int | None) -> bool:
        """With a live agent: the version lost its marker during the check, and enough newer
        versions are committed for retention to have deleted it legitimately."""
        if not self.live or os.path.exists(os.path.join(self.store, tag, version, "COMMITTED")):
            return False
        entries, _ = _core.read_catalog(self.store)
        if seq is None:
            return len(entries) >= RETENTION
        return sum(1 for e in entries if int(e["seq"]) > seq) >= RETENTION

    def nebulite_warnings(self, caught: list[warnings.WarningMessage], what: str) -> None:
        for w in caught:
            text = str(w.message)
            m = re.search(r"\((/[^()]*)\)", text)
            if m:
                rel = os.path.relpath(m.group(1), self.store).split(os.sep)
                if len(rel) == 2 and self.retired_meanwhile(rel[0], rel[1], None):
                    self.excused += 1
                    continue
            self.problem("torn", f"{what} warned: {text}")

    def step_of(self, tag: str, version: str) -> int | None:
        """The step version (tag, version) holds (None: it cannot tell)."""
        if (tag, version) not in self.steps:
            try:
                self.steps[(tag, version)] = kill_worker.step_of_checkpoint(
                    nm.get_checkpoint(tag=tag, version=version, persist_path=self.store))
            except Exception:  # noqa: BLE001 - reported by version_errors()
                return None
        return self.steps[(tag, version)]

    def version_errors(self, e: dict[str, Any]) -> list[str]:
        """What is wrong with committed version `e` (empty: whole and bit-exact)."""
        tag, version = e["tag"], e["version"]
        errors: list[str] = []
        if tag != "last" and not re.fullmatch(r"step\d+", tag):
            return [f"not a tag of the kill campaign: {tag!r}"]
        if int(e["world_size"]) != self.world:
            return [f"world_size {e['world_size']} in its marker, the run has {self.world}"]
        vdir = os.path.join(self.store, tag, version)
        try:
            crcs = marker_manifest_crcs(os.path.join(vdir, "COMMITTED"))
            if sorted(crcs) != list(range(self.world)):
                errors.append(f"its marker names the manifests of ranks {sorted(crcs)}")
            for rank in range(self.world):
                with open(os.path.join(vdir, f"rank{rank}.manifest"), "rb") as f:
                    data = f.read()
                if zlib.crc32(data) != crcs.get(rank):
                    errors.append(f"rank{rank}.manifest does not have the CRC its marker names")
                m = _core.read_manifest(self.store, tag, version, rank)
                if (m["tag"], m["version"], m["rank"], m["world_size"]) != (tag, version, rank, self.world):
                    errors.append(f"rank{rank}.manifest names {m['tag']}/{m['version']} rank {m['rank']}")
                want = sorted(n for r, n in kill_worker.names(self.world) if r == rank)
                if sorted(f[0] for f in m["files"]) != want:
                    errors.append(f"rank{rank}.manifest lists {sorted(f[0] for f in m['files'])}, not {want}")
                for name, size, crc in m["files"]:
                    _core.verify_data_file(self.store, _core.data_file_path(tag, version, rank, name),
                                           name, size, crc)
        except Exception as ex:  # noqa: BLE001 - a missing or damaged file
            errors.append(f"{type(ex).__name__}: {ex}")
            return errors
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ck = nm.get_checkpoint(tag=tag, version=version, persist_path=self.store)
                if ck.version != version:
                    errors.append(f"get_checkpoint(tag, version) found {ck.tag!r}/{ck.version}")
                else:
                    step = kill_worker.step_of_checkpoint(ck)
                    self.steps[(tag, version)] = step
                    for rank, name in kill_worker.names(self.world):
                        if not kill_worker.same(ck.load(name, map_location="cpu"),
                                                kill_worker.expected(step, rank, name)):
                            errors.append(f"{name} does not hold the content saved at step {step}")
            except Exception as ex:  # noqa: BLE001
                errors.append(f"loading: {type(ex).__name__}: {ex}")
        errors += [f"warned: {w.message}" for w in caught]
        return errors

    def run(self) -> dict[str, Any]:
        store = self.store
        marked_before = marked_versions(store)
        listed: list[dict[str, Any]] = []
        if os.path.isdir(store):
            for attempt in range(20):  # a live agent's retention may delete what is being listed
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        listed = nm.list_checkpoints(persist_path=store)
                        entries, catalog_warnings = _core.read_catalog(store)
                        break
                    except Exception as ex:  # noqa: BLE001
                        if not self.live or attempt == 19:
                            raise
                        del ex
            self.nebulite_warnings(caught, "list_checkpoints")
            for text in catalog_warnings:
                self.problem("torn", f"the catalog skipped a commit marker: {text}")
        else:
            entries = []
        marked_after = marked_versions(store)
        seen = {(e["tag"], e["version"]) for e in listed}
        if self.live:
            extra = seen - (marked_before | marked_after)
            missing = (marked_before & marked_after) - seen
        else:
            extra, missing = seen - marked_before, marked_before - seen
        for tag, version in sorted(extra):
            self.problem("visible", f"{tag}/{version} is listed but has no commit marker")
        for tag, version in sorted(missing):
            self.problem("torn", f"{tag}/{version} has a commit marker but is not listed")
        by_key = {(e["tag"], e["version"]): e for e in entries}

        verified = []
        for e in listed:
            tag, version = e["tag"], e["version"]
            full = by_key.get((tag, version), {"tag": tag, "version": version, "world_size": -1})
            errors = self.version_errors(full)
            if not errors:
                verified.append(f"{tag}/{version}")
            elif self.retired_meanwhile(tag, version, int(e["seq"])):
                self.excused += 1
            else:
                self.problem("torn", f"{tag}/{version} (seq {e['seq']}): " + "; ".join(errors))

        # Commit order: unique sequence numbers; a later commit never holds an older step.
        seqs = [int(e["seq"]) for e in listed]
        if len(set(seqs)) != len(seqs):
            self.problem("order", "sequence numbers repeat: "
                         + ", ".join(f"{e['tag']}/{e['version']}={e['seq']}" for e in listed))
        steps = [self.steps[k] for e in listed if (k := (e["tag"], e["version"])) in self.steps]
        if steps != sorted(steps, reverse=True):
            self.problem("order", "commit order does not follow the steps: " + ", ".join(
                f"{e['tag']}/{e['version']} (seq {e['seq']}, step {self.steps.get((e['tag'], e['version']))})"
                for e in listed))

        # The latest checkpoint, and the journal's promise.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            latest = nm.get_latest_checkpoint(persist_path=store) if os.path.isdir(store) else None
        self.nebulite_warnings(caught, "get_latest_checkpoint")
        latest_step = None
        if latest is not None and latest.tag:
            latest_step = self.step_of(latest.tag, latest.version)
            if latest_step is None:
                self.problem("torn", f"get_latest_checkpoint() is {latest.tag}/{latest.version}, "
                             "whose step cannot be read")
            newest = listed[0] if listed else None
            if newest is not None and (latest.tag, latest.version) != (newest["tag"], newest["version"]):
                seq = int(latest._committed["seq"])
                if not (self.live and seq >= int(newest["seq"])):
                    self.problem("torn", f"get_latest_checkpoint() is {latest.tag}/{latest.version}, "
                                 f"the newest committed is {newest['tag']}/{newest['version']}")
        elif listed:
            self.problem("torn", "get_latest_checkpoint() found nothing, the store lists "
                         + ", ".join(e["tag"] for e in listed))
        journal = None
        for rank in range(self.world):
            steps_r = kill_worker.read_journal(os.path.join(self.journal_dir, f"rank{rank}.journal"))
            if steps_r:
                journal = max(journal if journal is not None else -1, max(steps_r))
        if journal is not None:
            if latest_step is None or latest_step < journal:
                self.problem("lost", f"flush_persistence() returned for step{journal}, but the latest "
                             f"checkpoint is {'step%d' % latest_step if latest_step is not None else 'none'}")
            else:
                now = [self.step_of(e["tag"], e["version"]) for e in nm.list_checkpoints(persist_path=store)] \
                    if self.live else steps
                now = [x for x in now if x is not None]
                if journal not in steps and journal not in now and sum(s > journal for s in now) < RETENTION:
                    self.problem("lost", f"step{journal} (flushed) is gone although only "
                                 f"{sum(s > journal for s in now)} newer checkpoints were committed: {now}")
        return {
            "listed": [{"tag": e["tag"], "version": e["version"], "seq": int(e["seq"])} for e in listed],
            "verified": verified,
            "latest": latest_step,
            "journal": journal,
            "excused": self.excused,
            "problems": self.problems,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--journal-dir", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--live", action="store_true")
    a = p.parse_args(argv)
    try:
        result = Check(os.path.abspath(a.store), a.world, a.journal_dir, a.live).run()
    except Exception:  # noqa: BLE001 - the verifier itself failed: reported, not hidden
        result = {"problems": [{"kind": "error", "detail": "the verifier failed:\n" + traceback.format_exc()}]}
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

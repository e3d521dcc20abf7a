"""``nebulite verify PATH [TAG | --all]``: reads every data file of a committed
checkpoint (the newest one by default) and checks it against its manifest (size, CRC-32
of the whole file) and each record against its own CRC-32. Exit status 0 when every
file is intact, 1 when one is damaged (each damaged file is named)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .. import _core
from .._config import read_threads
from ..errors import CorruptCheckpointError, NotFoundError
from . import output, store
from .command import subcommand
from .progress import Progress

DAMAGED = 1


def add_parser(sub: Any) -> None:
    p = subcommand(sub, "verify", help="check a checkpoint's files against their checksums",
                   doc=__doc__, run=run,
                   examples=["nebulite verify /mnt/ckpt/run1               # the newest",
                             "nebulite verify /mnt/ckpt/run1 global_step500",
                             "nebulite verify /mnt/ckpt/run1 --all"])
    which = p.add_mutually_exclusive_group()
    which.add_argument("tag", metavar="TAG", nargs="?", help="the newest version of this tag")
    which.add_argument("--all", action="store_true", help="every committed version")


def check_file(root: str, f: store.DataFile) -> None:
    """Reads `f` once: its size and whole-file CRC against the manifest, and each record's
    bytes against the CRC-32 in the file's index. CorruptCheckpointError otherwise."""
    try:
        records = _core.StoredArchive.open(root, f.path).records()
    except CorruptCheckpointError:
        _core.verify_data_file(root, f.path, f.name, f.size, f.crc32)  # names what is wrong
        raise
    spans, expected, pos = [], {}, 0
    for name, offset, size, crc in sorted(records, key=lambda r: r[1]):
        if offset < pos or offset + size > f.size:
            raise CorruptCheckpointError(f"{f.path}: record {name!r} lies outside the file")
        if offset > pos:
            spans.append((pos, offset - pos, 0))
        expected[len(spans)] = (name, crc)
        spans.append((offset, size, 0))
        pos = offset + size
    if pos < f.size:
        spans.append((pos, f.size - pos, 0))
    got = _core.read_data_file(root, f.path, f.name, f.size, f.crc32, spans, read_threads(root))
    for i, (name, crc) in expected.items():
        if got[i] != crc:
            raise CorruptCheckpointError(f"{f.path}: record {name!r} fails its CRC-32")


def run(args: argparse.Namespace) -> int:
    root = store.root_of(args.path)
    if args.tag:
        versions = [store.find(root, args.tag)]
    else:
        versions = store.committed(root)
        if not versions:
            raise NotFoundError(f"no committed checkpoint in {root}")
        if not args.all:
            versions = versions[:1]
    damaged = 0
    total = sum(v.bytes for v in versions)
    with Progress("verify", total) as progress:
        for v in versions:
            bad = [v.damaged] if v.damaged else []
            for f in v.files:
                try:
                    check_file(root, f)
                except (CorruptCheckpointError, NotFoundError) as e:
                    bad.append(f"{os.path.join(root, f.path)}: {e}")
                progress.advance(f.size)
            progress.close()
            if bad:
                damaged += 1
                print(f"{v.tag} ({v.version}): DAMAGED")
                for b in bad:
                    print(f"  {b}")
            else:
                print(f"{v.tag} ({v.version}): intact, {len(v.files)} files, "
                      f"{output.size(v.bytes)}")
    return DAMAGED if damaged else 0

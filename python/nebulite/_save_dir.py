"""DeepSpeed's save_dir made of real checkpoints.

DeepSpeed's Nebula engine writes an empty placeholder (``torch.save("", path)``) in its
``save_dir`` for each object it hands to nebulite. Some of DeepSpeed's readers open those
files themselves (ZeRO-3 load paths, ``zero_to_fp32.py``, ``enable_nebula_load: false``).
Once a version holding such objects is committed in the store, each placeholder is replaced,
atomically, by a copy of the committed data file (a ``torch.save`` archive):

1. the data file is read through the store's driver, its size and CRC-32 checked;
2. the bytes are written to a temporary name beside the placeholder and synced;
3. the temporary file is renamed over the placeholder, and the directory synced.

A reader thus sees either the placeholder or the whole file. A version that retention removes
before its commit in the store was seen (or one never persisted) keeps its placeholders.
Copies, not links: save_dir keeps what DeepSpeed's own engine would have kept, whatever
retention later removes from the store. Not thread-safe: the caller holds nebulite's lock.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from . import _core
from .errors import NebuliteError

log = logging.getLogger("nebulite")


@dataclass(frozen=True)
class Placeholder:
    tag: str
    version: str
    rank: int
    name: str
    path: str  # the file DeepSpeed wrote in its save_dir


class Placeholders:
    """The placeholders of this rank waiting for their version's commit in the store."""

    def __init__(self) -> None:
        self._saved: dict[tuple[str, str], str] = {}  # (tag, name) -> path, until committed
        self._waiting: list[Placeholder] = []

    @property
    def waiting(self) -> bool:
        return bool(self._waiting)

    def saved(self, tag: str, name: str, path: str) -> None:
        self._saved[(tag, name)] = path

    def committed(self, tag: str, version: str, rank: int, persist: bool) -> None:
        """The version was committed (in the store later, when `persist`)."""
        for key in [k for k in self._saved if k[0] == tag]:
            path = self._saved.pop(key)
            if persist:
                self._waiting.append(Placeholder(tag, version, rank, key[1], path))

    def abandoned(self, tag: str) -> None:
        for key in [k for k in self._saved if k[0] == tag]:
            del self._saved[key]

    def replace_committed(self, root: str, committed: set[tuple[str, str]], gone: bool) -> None:
        """Replaces each waiting placeholder whose (tag, version) is in `committed`; with
        `gone`, forgets the others (nothing more will be committed)."""
        still = []
        for p in self._waiting:
            if (p.tag, p.version) in committed:
                _replace(root, p)
            elif not gone:
                still.append(p)
        self._waiting = still


def _replace(root: str, p: Placeholder) -> None:
    try:
        manifest = _core.read_manifest(root, p.tag, p.version, p.rank)
        entry = next((f for f in manifest["files"] if f[0] == p.name), None)
        if entry is None:
            return
        size, crc = int(entry[1]), int(entry[2])
        data = torch.empty(size, dtype=torch.uint8)
        rel = _core.data_file_path(p.tag, p.version, p.rank, p.name)
        _core.read_data_file(root, rel, p.name, size, crc, [(0, size, data.data_ptr())])
        tmp = f"{p.path}.nebulite-tmp"
        with open(tmp, "wb") as f:
            f.write(memoryview(data.numpy()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p.path)
        fd = os.open(os.path.dirname(p.path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except (NebuliteError, OSError) as e:
        log.warning("nebulite: %s stays DeepSpeed's placeholder: %s", p.path, e)

"""DeepSpeed's save_dir made of real checkpoints.

DeepSpeed's Nebula engine writes an empty placeholder (``torch.save("", path)``) in its
``save_dir`` for each object it hands to nebulite. Some of DeepSpeed's readers open those
files themselves (ZeRO-3 load paths, ``zero_to_fp32.py``, ``enable_nebula_load: false``).
Each placeholder is replaced, atomically, by a real ``torch.save`` archive:

- once its version is committed in the store, by a copy of the committed data file (read
  through the store's driver, its size and CRC-32 checked);
- when DeepSpeed loads a tag whose files are still placeholders (a load straight after the
  save, from the memory tier), at once: with a store, the version is persisted now and
  every rank's files of the tag are copied from it as soon as it is committed there (so
  each rank's load finds all of them, without waiting for the other ranks); without a
  store, each rank writes its own objects from memory (``torch.save``), and the ranks wait
  for each other before DeepSpeed reads any of them.

A copy is written to a temporary name beside the placeholder, synced, and renamed over it,
then the directory is synced: a reader sees either the placeholder or the whole file.
Copies, not links: save_dir keeps what DeepSpeed's own engine would have kept, whatever
retention later removes from the store. A version that leaves memory without reaching the
store keeps its placeholders. Not thread-safe: the caller holds nebulite's lock.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

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
    """This rank's placeholders: saved (version not committed yet), then waiting until they
    are replaced or their version is gone."""

    def __init__(self) -> None:
        self._saved: dict[tuple[str, str], str] = {}  # (tag, name) -> path, until committed
        self._waiting: list[Placeholder] = []

    @property
    def waiting(self) -> bool:
        return bool(self._waiting)

    def versions(self) -> set[tuple[str, str]]:
        """The (tag, version) pairs that waiting placeholders belong to."""
        return {(p.tag, p.version) for p in self._waiting}

    def saved(self, tag: str, name: str, path: str) -> None:
        self._saved[(tag, name)] = path

    def committed(self, tag: str, version: str, rank: int) -> None:
        """The version was committed (in memory; in the store now or later)."""
        for key in [k for k in self._saved if k[0] == tag]:
            self._waiting.append(Placeholder(tag, version, rank, key[1], self._saved.pop(key)))

    def abandoned(self, tag: str) -> None:
        for key in [k for k in self._saved if k[0] == tag]:
            del self._saved[key]

    def replace_committed(self, root: str, committed: set[tuple[str, str]], alive: set[tuple[str, str]] | None) -> None:
        """Replaces each waiting placeholder whose (tag, version) is in `committed`, and forgets
        those whose version is neither committed nor in `alive` (None: nothing more will be
        committed, forget them all)."""
        still = []
        for p in self._waiting:
            if (p.tag, p.version) in committed:
                _copy_committed(root, p.tag, p.version, p.rank, p.name, p.path)
            elif alive is not None and (p.tag, p.version) in alive:
                still.append(p)
        self._waiting = still

    def replace_every_rank(self, root: str, tag: str, version: str, world_size: int) -> None:
        """Replaces the files of every rank of committed `version` in the directories of this
        rank's placeholders of it (DeepSpeed's readers open the other ranks' files too)."""
        mine = [p for p in self._waiting if (p.tag, p.version) == (tag, version)]
        for directory in sorted({os.path.dirname(p.path) for p in mine}):
            for rank in range(world_size):
                try:
                    files = _core.read_manifest(root, tag, version, rank)["files"]
                except NebuliteError as e:
                    log.warning("nebulite: rank %d's files of %s stay DeepSpeed's placeholders: %s",
                                rank, tag, e)
                    continue
                for name, size, crc in ((f[0], int(f[1]), int(f[2])) for f in files):
                    path = os.path.join(directory, name)
                    if os.path.isfile(path) and os.path.getsize(path) != size:
                        _copy_file(root, tag, version, rank, name, size, crc, path)
        self._waiting = [p for p in self._waiting if p not in mine]

    def write_from_memory(self, tag: str, version: str, load: Callable[[str], Any]) -> None:
        """Writes this rank's objects of `version` over their placeholders from the memory
        tier (``torch.save``, as DeepSpeed's own engine does): load(name) gives the object."""
        mine = [p for p in self._waiting if (p.tag, p.version) == (tag, version)]
        for p in mine:
            try:
                obj = load(p.name)
                _write_atomically(p.path, lambda f, o=obj: torch.save(o, f))
            except (NebuliteError, OSError) as e:
                log.warning("nebulite: %s stays DeepSpeed's placeholder: %s", p.path, e)
        self._waiting = [p for p in self._waiting if p not in mine]


def _copy_committed(root: str, tag: str, version: str, rank: int, name: str, path: str) -> None:
    try:
        manifest = _core.read_manifest(root, tag, version, rank)
    except NebuliteError as e:
        log.warning("nebulite: %s stays DeepSpeed's placeholder: %s", path, e)
        return
    entry = next((f for f in manifest["files"] if f[0] == name), None)
    if entry is not None:
        _copy_file(root, tag, version, rank, name, int(entry[1]), int(entry[2]), path)


def _copy_file(root: str, tag: str, version: str, rank: int, name: str, size: int, crc: int,
               path: str) -> None:
    """Copies committed data file `name` of `rank` (its size and CRC-32 as its manifest
    gives them, and checked) over `path`."""
    try:
        data = torch.empty(size, dtype=torch.uint8)
        rel = _core.data_file_path(tag, version, rank, name)
        _core.read_data_file(root, rel, name, size, crc, [(0, size, data.data_ptr())])
        _write_atomically(path, lambda f: f.write(memoryview(data.numpy())))
    except (NebuliteError, OSError) as e:
        log.warning("nebulite: %s stays DeepSpeed's placeholder: %s", path, e)


def _write_atomically(path: str, write: Callable[[Any], Any]) -> None:
    """Writes `path` through a temporary name beside it (unique to this process: ranks may
    replace the same file at once, with the same bytes), synced, renamed, directory synced."""
    tmp = f"{path}.nebulite-tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

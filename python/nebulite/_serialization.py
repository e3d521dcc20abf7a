"""State flattening: an object with tensors <-> the records of a torch.save archive.

Saving runs torch's own serializer (``torch.serialization._save``) against a stand-in
for its zip writer. It hands us ``data.pkl`` (the pickled skeleton, tensors as
persistent ids) as bytes and every storage as a pointer and a size, without a copy;
the C++ engine then copies the storages straight from tensor memory into the arena.
Loading runs torch's own loader (``torch.serialization._load``) against a stand-in
for its zip reader that serves records from the memory tier or from a data file, so
every tensor subtype, view, shared storage and dtype is handled as torch handles it,
and ``weights_only`` behaves exactly as in ``torch.load``.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import secrets
import time
from typing import Any, Callable

import torch

from . import _plan, _staging
from .errors import InvalidArgumentError

FORMAT_VERSION = 1
INDEX_RECORD = ".nebulite/index.json"
_TORCH_ARCHIVE_VERSION = b"3\n"  # what torch.save writes as `version`
STORAGE_ALIGNMENT = 4096


def new_buffer(nbytes: int) -> torch.Tensor:
    """A fresh uint8 tensor of `nbytes` for a load to fill."""
    # Transparent huge pages were tried here (MADV_HUGEPAGE): on the development machine, a
    # virtual machine that hands freed memory back to its host, fresh processes filled them
    # more slowly than 4 KiB pages (see benchmarks/README.md, profiles).
    return torch.empty(nbytes, dtype=torch.uint8)


def _bytes_address(b: bytes) -> int:
    if not b:
        return 0
    return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value or 0


class RecordCollector:
    """Stands in for torch's zip writer; keeps what it is handed alive."""

    def __init__(self, watch: _staging.Watch | None = None) -> None:
        # (name, address, size, deferred): deferred bytes may be copied after save()
        self.records: list[tuple[str, int, int, bool]] = []
        self.sources: list[Any] = []  # each record's bytes or storage, kept alive
        self.storage_bytes = 0
        self.watch = watch if watch is not None else _staging.Watch()

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, (bytes, bytearray)):
            data = bytes(data)
            self.sources.append(data)
            self.records.append((name, _bytes_address(data), len(data), False))
            return
        # An untyped storage (already on the CPU: _save moves others there).
        if data.device.type != "cpu":  # pragma: no cover - _save handles it
            data = data.cpu()
        self.sources.append(data)
        ptr = int(data.data_ptr())
        self.records.append((name, ptr, int(nbytes), self.watch.defer(data, int(nbytes))))
        self.storage_bytes += int(nbytes)

    def write_record_metadata(self, name: str, nbytes: int) -> None:  # pragma: no cover
        raise InvalidArgumentError("saving with skip_data is not supported")

    def add_bytes(self, name: str, data: bytes) -> None:
        self.write_record(name, data, len(data))

    @property
    def deferred(self) -> bool:
        return any(r[3] for r in self.records)

    def plan(self, structure: _plan.Structure) -> _plan.Plan | None:
        """The records so far as a plan for later saves of the same structure (None when
        a storage is not one the walk met)."""
        if structure.key is None:
            return None
        order = {id(st): j for j, st in enumerate(structure.storages)}
        out: list[tuple[Any, ...]] = []
        for (name, _, size, _), src in zip(self.records, self.sources):
            if isinstance(src, bytes):
                out.append((name, src, None))
            elif id(src) in order:
                out.append((name, None, order[id(src)], size))
            else:
                return None
        return _plan.Plan(structure.key, tuple(out))


def flatten(obj: Any, *, tag: str, name: str, rank: int, version: str) -> RecordCollector:
    """Returns the records of `obj` as torch.save would write them, plus nebulite's index.
    A structure saved under `name` before reuses its flattening (see nebulite._plan)."""
    structure = _plan.walk(obj)
    collector = RecordCollector(_staging.Watch(obj, structure))
    plan = _plan.find(name, structure.key)
    if plan is not None:
        for record in plan.records:
            if record[1] is not None:
                collector.add_bytes(record[0], record[1])
            else:
                collector.write_record(record[0], structure.storages[record[2]], record[3])
    else:
        try:
            torch.serialization._save(obj, collector, pickle, 2, False)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as e:
            raise InvalidArgumentError(
                f"cannot save {name!r} in checkpoint {tag!r}: the object is not picklable ({e})"
            ) from e
        # torch records its own payload alignment; ours is 4 KiB.
        alignment = str(STORAGE_ALIGNMENT).encode()
        for i, (n, _, _, _) in enumerate(collector.records):
            if n == ".storage_alignment":
                collector.sources[i] = alignment
                collector.records[i] = (n, _bytes_address(alignment), len(alignment), False)
        # torch.save's own writer adds this record; so do we.
        collector.add_bytes("version", _TORCH_ARCHIVE_VERSION)
        made = collector.plan(structure)
        if made is not None:
            _plan.keep(name, made)
    # ... and this one, new for every archive.
    collector.add_bytes(".data/serialization_id", str(secrets.randbits(128)).zfill(40).encode())
    index = {
        "format": "nebulite",
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "name": name,
        "rank": rank,
        "version": version,
        "created_unix_ns": time.time_ns(),
    }
    collector.add_bytes(INDEX_RECORD, json.dumps(index, sort_keys=True).encode())
    return collector


class ArchiveSource:
    """Stands in for torch's zip reader (PyTorchFileReader) over nebulite records.

    `read(name)` returns a record's bytes; `read_into(name, address)` fills memory;
    `buffers` holds records already read (each a uint8 tensor), which are handed out as
    they are, without a copy.
    """

    def __init__(
        self,
        sizes: dict[str, int],
        read: Callable[[str], bytes],
        read_into: Callable[[str, int], None],
        description: str,
        buffers: dict[str, torch.Tensor] | None = None,
        offsets: dict[str, int] | None = None,
    ) -> None:
        self._sizes = sizes
        self._offsets = offsets or {}
        self._read = read
        self._read_into = read_into
        self._buffers = buffers or {}
        self.description = description

    def has_record(self, name: str) -> bool:
        return name in self._sizes

    def get_record(self, name: str) -> bytes:
        if name in self._buffers:
            return self._buffers[name].numpy().tobytes()
        return self._read(name)

    def get_all_records(self) -> list[str]:
        return list(self._sizes)

    def get_record_offset(self, name: str) -> int:
        """Where record `name`'s bytes start in its data file (torch records it on meta
        tensors, ``map_location="meta"``); 0 for a record held apart from any file."""
        if name not in self._sizes:
            from .errors import CorruptCheckpointError

            raise CorruptCheckpointError(f"{self.description}: missing record {name!r}")
        return self._offsets.get(name, 0)

    def get_record_header_offset(self, name: str) -> int:
        return self.get_record_offset(name)  # no zip headers: a record starts where it starts

    def get_record_offset_no_read(self, zip_offset: int, name: str, numel: int, alignment: int) -> int:
        """torch derives offsets from the zip layout when it can; nebulite's index knows them."""
        return self.get_record_offset(name)

    def get_storage_from_record(self, name: str, numel: int, dtype: Any) -> torch.Tensor:
        size = self._sizes.get(name)
        if size is None:
            from .errors import CorruptCheckpointError

            raise CorruptCheckpointError(f"{self.description}: missing record {name!r}")
        if size != numel:
            from .errors import CorruptCheckpointError

            raise CorruptCheckpointError(
                f"{self.description}: record {name!r} holds {size} bytes, the skeleton expects {numel}"
            )
        t = self._buffers.pop(name, None)
        if t is not None:
            return t
        t = new_buffer(numel)
        if numel:
            self._read_into(name, t.data_ptr())
        return t

    def serialization_id(self) -> str:
        try:
            return self.get_record(".data/serialization_id").decode()
        except Exception:
            return ""

    def check_index(self) -> None:
        """Rejects a nebulite index record from a newer format version."""
        if INDEX_RECORD not in self._sizes:
            return
        from .errors import CorruptCheckpointError, UnsupportedVersionError

        try:
            index = json.loads(self.get_record(INDEX_RECORD))
            version = int(index["format_version"])
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{self.description}: unreadable nebulite index ({e})") from e
        if version > FORMAT_VERSION:
            raise UnsupportedVersionError(
                f"{self.description}: written by nebulite format version {version}; "
                f"this nebulite reads up to version {FORMAT_VERSION}. Upgrade nebulite."
            )


_TRUE_VALUES = ("1", "y", "yes", "true")


def resolve_weights_only(weights_only: bool | None) -> bool:
    """torch.load's rule for `weights_only`: True unless given, forced True by
    ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``; when not given, ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    makes it False (the switch torch offers scripts written before its safe default)."""
    force = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE_VALUES
    force_no = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE_VALUES
    if force and force_no:
        raise InvalidArgumentError(
            "only one of TORCH_FORCE_WEIGHTS_ONLY_LOAD and TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD may be set"
        )
    if force:
        return True
    if weights_only is None:
        return not force_no
    return bool(weights_only)


def load_archive(source: ArchiveSource, map_location: Any, weights_only: bool) -> Any:
    """Unpickles the skeleton with torch's loader; tensors come from `source`."""
    source.check_index()
    if weights_only:
        from torch import _weights_only_unpickler

        try:
            return torch.serialization._load(source, map_location, _weights_only_unpickler)
        except pickle.UnpicklingError as e:
            raise pickle.UnpicklingError(
                f"{source.description}: weights-only load failed: {e}\n"
                "The object holds types that torch.load(weights_only=True) does not allow. "
                "If you trust this checkpoint, load it with weights_only=False, or allow the "
                "types with torch.serialization.add_safe_globals([...])."
            ) from None
    return torch.serialization._load(source, map_location, pickle)

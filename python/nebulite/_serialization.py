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
import functools
import io
import json
import os
import pickle
import secrets
import sys
import time
from typing import Any, Callable

import torch

from . import _device, _plan, _staging
from .errors import InvalidArgumentError, TornCheckpointError

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
        self.on_device: set[int] = set()  # indexes of records held by a CUDA storage
        self.job: Any = None  # the sealing of its device copies (nebulite._device.Sealer.Job)
        self.checked = False  # its deferred tensors were checked at a barrier
        self.streamed = False  # staged straight to the store (the memory tier was full)
        self.watch = watch if watch is not None else _staging.Watch()

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, (bytes, bytearray)):
            data = bytes(data)
            self.sources.append(data)
            self.records.append((name, _bytes_address(data), len(data), False))
            return
        # An untyped storage: on the CPU, or on a CUDA device when the skeleton came from
        # save_skeleton (torch's _save moves others to the CPU first).
        # With `scanned`, it must be a storage save() saw: else a tensor of the object was
        # given another one since.
        scanned = self.watch.scanned
        if scanned is not None and scanned.storages.get(id(data)) is not data:
            raise TornCheckpointError(
                f"a tensor was given another storage after save() (record {name!r})")
        if data.device.type != "cpu":
            if not _device.is_device_storage(data):  # pragma: no cover - no such device here
                data = data.cpu()
            else:
                self.on_device.add(len(self.records))
                self.sources.append(data)
                self.records.append((name, 0, int(nbytes), self.watch.defer(data, int(nbytes))))
                self.storage_bytes += int(nbytes)
                return
        if scanned is not None and self._copied_at_save(name, data, int(nbytes), scanned):
            return
        self.sources.append(data)
        ptr = int(data.data_ptr())
        self.records.append((name, ptr, int(nbytes), self.watch.defer(data, int(nbytes))))
        self.storage_bytes += int(nbytes)

    def _copied_at_save(self, name: str, storage: Any, nbytes: int,
                        scanned: _staging.Scanned) -> bool:
        """True if save() copied `storage` (a storage it saw: the record is those bytes)."""
        copied = scanned.copied.get(id(storage))
        if copied is None:
            return False
        offset, size = copied
        if size != nbytes:
            raise TornCheckpointError(f"a storage was resized after save() (record {name!r})")
        self.sources.append(storage)
        self.records.append((name, scanned.address + offset, nbytes, False))
        self.storage_bytes += nbytes
        return True

    def write_record_metadata(self, name: str, nbytes: int) -> None:  # pragma: no cover
        raise InvalidArgumentError("saving with skip_data is not supported")

    def add_bytes(self, name: str, data: bytes) -> None:
        self.write_record(name, data, len(data))

    @property
    def deferred(self) -> bool:
        return any(r[3] for r in self.records)

    @property
    def device_copies(self) -> bool:
        """True if some record is copied from a device (see nebulite._device)."""
        return bool(self.on_device)

    def move_to_host(self) -> None:
        """Copies the device records to (pageable) host memory: staged by the engine like
        any other, when the object is too large for a reservation in the memory tier."""
        for i in sorted(self.on_device):
            name, _, size, _ = self.records[i]
            host = self.sources[i].cpu()
            self.sources[i] = host
            self.records[i] = (name, int(host.data_ptr()), size, False)
        self.watch.deferred = [d for d in self.watch.deferred if d[0].device.type == "cpu"]
        self.on_device.clear()

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


def save_skeleton(obj: Any, zip_file: Any, pickle_module: Any, pickle_protocol: int,
                  _disable_byteorder_record: bool) -> None:
    """``torch.serialization._save`` (torch 2.x) but for one thing: every storage is
    handed to `zip_file` on its own device, never copied to the CPU. Everything written
    (the pickled skeleton, with torch's persistent ids, and the records in their order) is
    what torch.save writes; tests/test_device.py holds the two to the same bytes."""
    from torch.serialization import _get_storage_alignment, location_tag, normalize_storage_type

    serialized_storages: dict[str, torch.UntypedStorage] = {}
    id_map: dict[int, str] = {}
    storage_dtypes: dict[int, torch.dtype] = {}

    def persistent_id(obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            if isinstance(obj, torch.storage.TypedStorage):
                storage = obj._untyped_storage
                storage_dtype = obj.dtype
                storage_type = getattr(torch, obj._pickle_storage_type())
                storage_numel = obj._size()
            else:
                storage = obj
                storage_dtype = torch.uint8
                storage_type = normalize_storage_type(type(obj))
                storage_numel = storage.nbytes()
            if str(storage.device) != "meta" and storage.data_ptr() != 0:
                if storage.data_ptr() in storage_dtypes:
                    if storage_dtype != storage_dtypes[storage.data_ptr()]:
                        raise RuntimeError(
                            "Cannot save multiple tensors or storages that "
                            "view the same data as different types")
                else:
                    storage_dtypes[storage.data_ptr()] = storage_dtype
            storage_key = id_map.setdefault(storage._cdata, str(len(id_map)))
            if hasattr(obj, "_fake_device") and obj._fake_device is not None:
                location = str(obj._fake_device)
            else:
                location = location_tag(storage)
            serialized_storages[storage_key] = storage
            return ("storage", storage_type, storage_key, location, storage_numel)
        return None

    data_buf = io.BytesIO()

    class PyTorchPickler(pickle_module.Pickler):  # type: ignore[name-defined,misc]
        def persistent_id(self, obj: Any) -> Any:
            return persistent_id(obj)

    PyTorchPickler(data_buf, protocol=pickle_protocol).dump(obj)
    data_value = data_buf.getvalue()
    zip_file.write_record("data.pkl", data_value, len(data_value))
    zip_file.write_record(".format_version", "1", len("1"))
    storage_alignment = str(_get_storage_alignment())
    zip_file.write_record(".storage_alignment", storage_alignment, len(storage_alignment))
    if not _disable_byteorder_record:
        if sys.byteorder not in ["little", "big"]:
            raise ValueError("Unknown endianness type: " + sys.byteorder)
        zip_file.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    for key, storage in serialized_storages.items():
        if torch.serialization._serialization_tls.skip_data:
            zip_file.write_record_metadata(f"data/{key}", storage.nbytes())
            continue
        if storage.device.type not in ("cpu", "cuda"):  # what torch does for the others
            storage = storage.cpu()
        zip_file.write_record(f"data/{key}", storage, storage.nbytes())


@functools.cache
def skeleton_matches_torch() -> bool:
    """True if save_skeleton writes what this torch's _save writes (checked once, on a small
    object with a shared storage): with another torch, CUDA storages go through _save."""
    base = torch.arange(16, dtype=torch.float32)
    probe = {"a": base[2:], "b": base, "c": torch.zeros(2, dtype=torch.int8), "n": [1, "x"]}

    def written(save: Callable[..., None]) -> list[tuple[str, Any]]:
        c = RecordCollector()
        save(probe, c, pickle, 2, False)
        return [(name, src if isinstance(src, bytes) else src.data_ptr())
                for (name, _, _, _), src in zip(c.records, c.sources)]

    try:
        return written(save_skeleton) == written(torch.serialization._save)
    except Exception:
        return False


def flatten(obj: Any, *, tag: str, name: str, rank: int, version: str,
            scanned: _staging.Scanned | None = None) -> RecordCollector:
    """Returns the records of `obj` as torch.save would write them, plus nebulite's index.
    A structure saved under `name` before reuses its flattening (see nebulite._plan). With
    `scanned` (what an asynchronous save recorded, see nebulite._staging.scan), `obj` is
    its copy of the saved object, and the storages save() copied are read from that copy
    (which the collector's watch keeps alive)."""
    structure = _plan.walk(obj)
    collector = RecordCollector(_staging.Watch(obj, structure, scanned))
    plan = _plan.find(name, structure.key)
    if plan is not None:
        for record in plan.records:
            if record[1] is not None:
                collector.add_bytes(record[0], record[1])
            else:
                collector.write_record(record[0], structure.storages[record[2]], record[3])
    else:
        # With CUDA in use, the skeleton is written by save_skeleton, which hands CUDA
        # storages over where they are; torch's _save would copy each to pageable memory.
        save = save_skeleton if _device.in_use() and skeleton_matches_torch() \
            else torch.serialization._save
        try:
            save(obj, collector, pickle, 2, False)
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
        lend: Callable[[str], int] | None = None,
        pin: Callable[[], bool] | None = None,
    ) -> None:
        self._sizes = sizes
        # Records in host memory that outlives the load (the memory tier): record -> its
        # address, so that a record restored to a CUDA device is copied there directly.
        self._lend = lend
        self._pin = pin
        self.targets: dict[str, torch.device] = {}  # record -> the CUDA device it goes to
        self.devices: set[torch.device] = set()  # devices with copies still in flight
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
        target = self.targets.get(name)
        if target is not None and numel:
            # Straight from the memory tier (pinned: asynchronous) to the device; torch's
            # restore then finds the storage where it belongs and keeps it.
            assert self._lend is not None
            t = torch.empty(numel, dtype=torch.uint8, device=target)
            t.copy_(_device.host_view(self._lend(name), numel), non_blocking=True)
            self.devices.add(t.device)
            return t
        t = self._buffers.pop(name, None)
        if t is not None:
            return t
        t = new_buffer(numel)
        if numel:
            self._read_into(name, t.data_ptr())
        return t

    def plan_device_copies(self, map_location: Any) -> None:
        """Finds the records this load restores to a CUDA device (`targets`): only for a
        source that lends host memory, with CUDA available, and a map_location that is
        None, a device, a device's name or a dict (a callable decides per storage, after
        the storage was read: those records are read as usual)."""
        if self._lend is None or not torch.cuda.is_available():
            return
        if "byteorder" in self._sizes and self.get_record("byteorder").decode() != sys.byteorder:
            return  # torch swaps the bytes of such storages in place
        if isinstance(map_location, (str, torch.device)):
            target = _cuda_device(str(map_location))
            if target is not None:
                self.targets = {n: target for n in self._sizes if n.startswith("data/")}
        elif map_location is None or isinstance(map_location, dict):
            mapping = map_location or {}
            pkl = self.get_record("data.pkl") if "data.pkl" in self._sizes else b""
            if b"cuda" not in pkl and not any("cuda" in str(v) for v in mapping.values()):
                return  # nothing goes to a device
            for key, location in storage_locations(pkl).items():
                target = _cuda_device(str(mapping.get(location, location)))
                if target is not None:
                    self.targets[f"data/{key}"] = target
        if self.targets and self._pin is not None:
            torch.cuda.init()  # the load is about to use CUDA: register the memory first,
            self._pin()  # copies from pinned memory run at the link's speed

    def finish_device_copies(self) -> None:
        """Waits until the copies to devices landed (before the lent memory may go)."""
        for device in self.devices:
            torch.cuda.current_stream(device).synchronize()
        self.devices.clear()

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


def _cuda_device(location: str) -> torch.device | None:
    """The CUDA device a storage restored to `location` lands on (None: not CUDA)."""
    if not location.startswith("cuda"):
        return None
    try:
        device = torch.device(location)
    except RuntimeError:
        return None  # torch's own restore reports it
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        return None  # torch's own restore reports it
    return device


class _Absorb:
    """Whatever a skeleton refers to, as an object that accepts everything asked of it
    while unpickling: nothing of the skeleton is imported or run."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Absorb":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Absorb":
        return _Absorb()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _LocationReader(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.found: dict[str, str] = {}

    def find_class(self, module: str, name: str) -> Any:
        return _Absorb

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5:
            key, location = pid[2], pid[3]
            self.found[key.decode() if isinstance(key, bytes) else str(key)] = (
                location.decode() if isinstance(location, bytes) else str(location))
        return _Absorb()


def storage_locations(data_pkl: bytes) -> dict[str, str]:
    """{storage key: location} of a skeleton's storages (``data/<key>`` records), read
    without importing or running anything it names; {} when it cannot be read (the load
    then reads every record as usual, and torch's loader reports what is wrong)."""
    reader = _LocationReader(data_pkl)
    try:
        reader.load()
    except Exception:
        return {}
    return reader.found


def load_archive(source: ArchiveSource, map_location: Any, weights_only: bool) -> Any:
    """Unpickles the skeleton with torch's loader; tensors come from `source` (records
    restored to a CUDA device straight from memory the source lends, see
    ArchiveSource.plan_device_copies)."""
    source.check_index()
    source.plan_device_copies(map_location)
    try:
        return _load_archive(source, map_location, weights_only)
    finally:
        if source.devices:
            source.finish_device_copies()


def _load_archive(source: ArchiveSource, map_location: Any, weights_only: bool) -> Any:
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

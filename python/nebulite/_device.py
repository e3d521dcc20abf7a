"""Device-to-host staging: CUDA storages copied into the memory tier by DMA.

A CUDA storage of a saved object is never copied through pageable memory. Its record is
reserved in the arena (``Engine.reserve``), and the copy is issued on a copy stream of its
device (one per device, made once), in chunks of `CHUNK_BYTES` so that the link is never
held long by one copy, after the copy stream waited for the device's current stream (the
work that produced the bytes), or, when the staging thread issues them after save()
returned, for the event save() recorded on it (``mark()``). The end of each checkpoint
object's copies is marked by one event per device, the *landed* event; copies of storages
that may change before the next optimizer step (see nebulite._staging) come first and are
marked by the *unsafe* event.

Lifecycle of one object's copies (`DeviceCopies`):
  ``add()`` for each storage -> ``finish()`` (records the events; the sources stay alive)
  -> ``order_after()`` (the current stream waits for the events on the device, the host
  does not; with async staging, for the unsafe copies at save(), for all of them at the
  optimizer barrier) -> ``landing()`` (the host waits for them group by group, on the
  thread that seals the object, checksumming what landed: nothing reads the arena bytes
  before they landed) -> the sources go.

The CUDA calls are made through a `CopyBackend`; `CudaBackend` is torch's, and tests of the
bookkeeping pass a stand-in. Nothing here touches CUDA unless a saved storage is on a CUDA
device (which implies that CUDA is available and initialised).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Callable, Iterator, Protocol

import torch

from .errors import MemoryBudgetError, TornCheckpointError

#: The largest single copy issued on a copy stream.
CHUNK_BYTES = 64 << 20
#: Bytes issued on a stream between two events whose landing the host checks as it comes.
GROUP_BYTES = 256 << 20


def chunks(nbytes: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """[(offset, size)] covering [0, nbytes) in order, each at most `chunk` bytes."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


def in_use() -> bool:
    """True if this process has initialised CUDA: only then may a storage be on a CUDA
    device (checked first, it is the cheap test)."""
    return torch.cuda.is_initialized() and torch.cuda.is_available()


def is_device_storage(storage: Any) -> bool:
    return storage.device.type == "cuda"


def host_view(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over `nbytes` of host memory at `address` (no copy, not owned)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage as a flat uint8 tensor on its device (no copy)."""
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, 0, (storage.nbytes(),), (1,))


class CopyBackend(Protocol):
    """The device calls the staging makes (CUDA's, or a stand-in in tests)."""

    def copy_stream(self, device: torch.device) -> Any: ...
    def wait_current(self, stream: Any, device: torch.device) -> None: ...
    def copy(self, stream: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None: ...
    def record(self, stream: Any) -> Any: ...
    def order_current_after(self, event: Any, device: torch.device) -> None: ...
    def synchronize(self, event: Any) -> None: ...
    def mark(self, device: torch.device) -> Any: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...


class CudaBackend:
    """Copy streams (one per device, made once) and events through torch.cuda."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, Any] = {}

    def copy_stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            return stream

    def wait_current(self, stream: Any, device: torch.device) -> None:
        stream.wait_stream(torch.cuda.current_stream(device))

    def copy(self, stream: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def record(self, stream: Any) -> Any:
        # blocking: the thread that waits for it sleeps instead of spinning on a core
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event

    def order_current_after(self, event: Any, device: torch.device) -> None:
        torch.cuda.current_stream(device).wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def mark(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device).record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)


_backend: CopyBackend | None = None


def backend() -> CopyBackend:
    global _backend
    if _backend is None:
        _backend = CudaBackend()
    return _backend


class DeviceCopies:
    """The device-to-host copies of one checkpoint object (see the module's lifecycle).
    Used by one thread at a time: the saving thread, then the sealing one.

    Besides the two events of each device, an event is recorded after every `group` bytes
    issued on a stream, so that the host can check the bytes that landed (their CRC-32)
    while the rest is still being copied: ``landing()``."""

    def __init__(self, copier: CopyBackend | None = None, chunk: int = CHUNK_BYTES,
                 group: int = GROUP_BYTES, after: dict[torch.device, Any] | None = None) -> None:
        self._backend = copier if copier is not None else backend()
        # device -> the event its copies wait for (see mark()); None: its current stream
        self._after = after
        self._chunk = chunk
        self._group = group
        self._sources: list[Any] = []  # kept alive until the copies landed
        self._streams: dict[torch.device, Any] = {}  # device -> its copy stream, waited on
        self._queued: list[tuple[bool, Any, torch.Tensor, int]] = []  # (safe, storage, host, span)
        # (event, spans) in the order issued: the spans (indexes into `spans`) landed once
        # the event completed
        self._progress: list[tuple[Any, list[int]]] = []
        self.unsafe: list[tuple[torch.device, Any]] = []  # (device, event) per device
        self.landed: list[tuple[torch.device, Any]] = []
        self.ordered = False  # the current streams wait for every copy
        self.spans: list[tuple[int, int, int]] = []  # (record index, host address, size)

    def add(self, index: int, storage: Any, host: torch.Tensor, safe: bool) -> None:
        """Queues record `index`: device `storage` into `host` (a uint8 CPU tensor of its
        size, in the arena); `safe` storages may change only at the next optimizer step.
        With events to wait for, a storage on a device without one was not the object's at
        save(): TornCheckpointError, before any copy is issued."""
        if self._after is not None and storage.device not in self._after:
            raise TornCheckpointError(
                f"a tensor was given a storage on {storage.device} after save()")
        self._sources.append(storage)
        self._queued.append((safe, storage, host, len(self.spans)))
        self.spans.append((index, int(host.data_ptr()), int(host.numel())))

    def _issue(self, safe: bool) -> list[tuple[torch.device, Any]]:
        """Issues the copies of safe (or unsafe) storages; returns each device's last event."""
        # device -> groups of ([(dst, src)], [span], bytes)
        groups: dict[torch.device, list[tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int], int]]] = {}
        for is_safe, storage, host, span in self._queued:
            nbytes = int(host.numel())
            if is_safe != safe or nbytes == 0:
                continue
            device = storage.device
            if device not in self._streams:
                stream = self._streams[device] = self._backend.copy_stream(device)
                if self._after is None:
                    self._backend.wait_current(stream, device)
                else:
                    self._backend.wait_event(stream, self._after[device])
            mine = groups.setdefault(device, [])
            if not mine or mine[-1][2] >= self._group:
                mine.append(([], [], 0))
            pairs, spans, size = mine[-1]
            src = storage_bytes(storage)
            if nbytes <= self._chunk:
                pairs.append((host, src))
            else:
                pairs.extend((host[off:off + n], src[off:off + n])
                             for off, n in chunks(nbytes, self._chunk))
            spans.append(span)
            mine[-1] = (pairs, spans, size + nbytes)
        last: list[tuple[torch.device, Any]] = []
        for device, mine in groups.items():
            stream = self._streams[device]
            event = None
            for pairs, spans, _ in mine:
                self._backend.copy(stream, pairs)
                event = self._backend.record(stream)
                self._progress.append((event, spans))
            last.append((device, event))
        return last

    def finish(self) -> None:
        """Issues the copies, unsafe ones first, and records the events."""
        self.unsafe = self._issue(safe=False)
        last = dict(self.unsafe)  # a stream's last event: every copy on it landed
        last.update(self._issue(safe=True))
        self.landed = list(last.items())
        self._queued.clear()

    def order_after(self, unsafe_only: bool = False) -> None:
        """The devices' current streams wait for the copies (of unsafe storages only, or
        all); the host does not wait."""
        if self.ordered:
            return
        for device, event in (self.unsafe if unsafe_only else self.landed):
            self._backend.order_current_after(event, device)
        self.ordered = not unsafe_only

    def landing(self) -> Iterator[tuple[int, int, int]]:
        """Waits on the host for the copies, group by group, yielding the spans (record
        index, host address, size) as they land; the sources go once all landed."""
        progress, self._progress = self._progress, []
        for event, spans in progress:
            self._backend.synchronize(event)
            for span in spans:
                yield self.spans[span]
        self._sources.clear()

    def synchronize(self) -> None:
        """Waits on the host until every copy landed; lets the sources go."""
        for _ in self.landing():
            pass


class Sealer:
    """Runs, on a thread of its own, what must wait until an object's device copies
    landed (computing the records' checksums as they land, see DeviceCopies.landing, and
    sealing it), in submission order; each job's copies have landed when it is done.

    Lifecycle: ``submit()`` any number of times; ``wait(job)`` or ``drain()`` from any
    thread; a job's error is kept on it. The thread stays once its jobs are done, for the
    next save (starting a thread costs the saving thread a tenth of a millisecond or
    more), until ``drain()`` stops it: the optimizer's barrier keeps it, as it keeps the
    staging thread (nebulite._stager). Thread-safe."""

    class Job:
        def __init__(self, copies: DeviceCopies, then: Callable[[], None]) -> None:
            self.copies = copies
            self.then = then
            self.done = threading.Event()
            self.error: BaseException | None = None

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._jobs: list[Sealer.Job] = []
        self._thread: threading.Thread | None = None
        self._stop = False

    def submit(self, copies: DeviceCopies, then: Callable[[], None]) -> "Sealer.Job":
        job = Sealer.Job(copies, then)
        with self._cv:
            self._jobs.append(job)
            self._start_locked()
            self._cv.notify_all()
        return job

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nebulite-device-sealer",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs[0]
            try:
                job.then()
            except BaseException as e:  # reported by the session's next barrier
                job.error = e
            finally:
                job.copies.synchronize()  # no copy may still land once the job is done
            with self._cv:
                self._jobs.pop(0)
                job.done.set()
                self._cv.notify_all()

    def drain(self, stop: bool = True) -> None:
        """Waits until every submitted job ran; with `stop`, until the thread ended too."""
        with self._cv:
            while self._jobs:
                self._cv.wait()
            if not stop:
                return
            thread, self._stop = self._thread, True
            self._cv.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cv:
            self._thread, self._stop = None, False
            if self._jobs:  # submitted while the thread was ending
                self._start_locked()


def mark(devices: list[torch.device]) -> dict[torch.device, Any]:
    """An event recorded now on the current stream of each of `devices`: copies issued
    later, on another thread, that wait for it read the bytes as they are once the work
    queued until now is done (an asynchronous save's, see nebulite._staging)."""
    copier = backend()
    return {device: copier.mark(device) for device in devices}


def order_current_after(marks: dict[torch.device, Any]) -> None:
    """The current streams of this thread wait on the device for `marks` (see mark())."""
    copier = backend()
    for device, event in marks.items():
        copier.order_current_after(event, device)


def stage(engine: Any, tag: str, version: str, name: str, records: Any, persist_now: bool,
          sealer: Sealer, copier: CopyBackend | None = None,
          crc: Callable[[int, int], int] | None = None,
          after: dict[torch.device, Any] | None = None) -> "Sealer.Job":
    """Stages a flattened object (a nebulite._serialization.RecordCollector) that holds
    device storages: reserves its image in the arena, copies the host records there at once
    (computing their CRC-32s), issues the device copies, and hands the sealing (the device
    records' CRC-32s, once landed, then ``engine.seal``) to `sealer`. Returns the job; the
    caller waits for it (blocking staging) or leaves it to the optimizer barrier. The copies
    wait for the devices' current streams, or with `after` for its events (see mark()).

    Memory not free now may be held by earlier objects whose copies are still landing: the
    reservation waits for memory only once `sealer` has sealed them (with the node agent,
    their seals would queue behind it on one connection). An object larger than the free
    memory after that raises MemoryBudgetError."""
    from . import _core

    # Beside training, half the cores and at most 8: the checksum pass over bytes the DMA
    # just wrote is bound by host memory (one H200 host, 16 cores, 4 GB landed: 27 GB/s
    # with 4 threads, 36 with 8, no more with 12; the link itself moves 55).
    threads = max(1, min(8, (os.cpu_count() or 2) // 2))
    crc = crc if crc is not None else (lambda address, n: int(_core.crc32(address, n, threads)))
    specs = [(n, size) for n, _, size, _ in records.records]
    try:
        arena_offset, nbytes, placed = engine.reserve(tag, version, name, specs, wait=False)
    except MemoryBudgetError:
        sealer.drain(stop=False)
        arena_offset, nbytes, placed = engine.reserve(tag, version, name, specs)
    image = int(engine.arena_address) + int(arena_offset)
    view = host_view(image, int(nbytes))  # the object's image in the arena
    crcs = [0] * len(records.records)
    host: list[tuple[int, int, int]] = []
    host_index: list[int] = []
    copies = DeviceCopies(copier, after=after)
    try:
        for i, ((_, src, size, deferred), (_, off, _)) in enumerate(zip(records.records, placed)):
            if i in records.on_device:
                copies.add(i, records.sources[i], view[int(off):int(off) + size], deferred)
            elif size:
                host.append((image + int(off), src, size))
                host_index.append(i)
        for i, c in zip(host_index, _core.copy_many(host, crc=True)):
            crcs[i] = int(c)
        copies.finish()
    except BaseException:
        engine.discard(tag, version, name)
        raise

    def seal() -> None:
        try:
            for i, address, size in copies.landing():
                crcs[i] = crc(address, size) if size else 0
            engine.seal(tag, version, name, persist_now, crcs)
        except BaseException:
            engine.discard(tag, version, name)
            raise

    return sealer.submit(copies, seal)

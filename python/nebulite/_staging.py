"""Asynchronous staging: copying optimizer-managed tensors after save() returns.

With ``init(async_staging=True)`` a save copies most bytes in the background while
training goes on. This is sound under one contract, which every training loop that
only changes weights through ``optimizer.step()`` meets: the bytes of parameters and
optimizer state do not change between ``save()`` and the next optimizer step. To
enforce it, nebulite registers a global optimizer step pre-hook that waits for every
pending copy before any ``torch.optim.Optimizer`` steps (DeepSpeed's and Lightning's
optimizers are such optimizers or wrap one). Only storages that belong to a parameter
or to the state of an optimizer that has stepped at least once are deferred; every
other tensor (buffers such as BatchNorm statistics, which change in forward) is
copied before save() returns. On a CUDA device (nebulite._device) no copy waits on the
host: the copies of safe storages are issued after an event that save() records on the
device's current stream, and the device's current stream waits for them at the barrier;
the barrier commits the checkpoint once the copies landed.

A save does little on the caller's thread (``scan``, in the extension): it copies the
object's containers (and instances of classes that pickle as object's default does, such
as DeepSpeed's loss scaler), records each tensor's storage and ``_version``, and copies the
storages no optimizer manages into one buffer. Walking the object, pickling its skeleton
and staging its records run on a staging thread (nebulite._stager), behind the same
barrier: the next optimizer step waits for them as it waits for the copies. Safe storages
on a CUDA device are copied from there by the staging thread too: save() records an event
on the current stream of each of their devices (the bytes as they are once the work queued
before save() is done), and their copies are issued on a copy stream that waits for it. An
object that is not made of dicts, lists, tuples, sets, such instances, immutable values
(enum members among them) and plain tensors, that
holds a tensor off the CPU whose storage is not a safe one (a CUDA buffer), or whose other
storages hold more than MAX_COPIED_BYTES, is staged on the caller's thread (with CUDA
storages, whose copies are then issued there, see nebulite._device).

Safe storages are known by identity, never by address alone: the registry
(``_core.SafeStorages``) holds a weak reference to each of torch's storage objects (which
torch keeps as long as the storage lives), and its callback drops the entry when the object
goes, before its address can be another's: an address that a freed optimizer state leaves
behind may be reused by a buffer that forward changes.

A save that breaks the contract (a deferred tensor changed in place before the
barrier: ``with torch.no_grad(): p.add_(1)``, ``t.set_(...)``) is detected at the barrier,
after the copies landed and before the checkpoint is committed: each deferred storage
is recorded with the tensors of the saved object that view it (their key paths) and
their ``_version`` counters; a counter that moved, or a tensor whose storage is no
longer the recorded one, fails that checkpoint (TornCheckpointError, naming the
tensor) and it is never committed. A write through ``Tensor.data`` is out of reach:
torch gives ``.data`` a version counter of its own.
"""

from __future__ import annotations

import abc
import collections
import copyreg
import enum
import functools
from typing import Any, Callable, Iterator

import torch

from . import _core

#: The safe storages, known by identity (see _core.SafeStorages): an entry leaves when its
#: storage is freed, before its address can be another storage's. It needs no lock: each of
#: its calls holds the interpreter's lock, and none holds an entry across Python code.
_safe_storages = _core.SafeStorages()
_hook_handle: Any = None
_waiter: Callable[[], None] | None = None

#: Storages smaller than this are always copied before save() returns. None is: every
#: safe storage, however small, is one copy fewer on the caller's thread (a GPT-2 state has
#: hundreds of small biases, norms and ``step`` counters).
MIN_DEFERRED_BYTES = 0
#: How deep the key paths of a saved object are followed to find its tensors.
_MAX_DEPTH = 64
#: The most bytes of storages outside the optimizers' that a save copies on the caller's
#: thread (buffers, RNG states); an object with more is staged there whole.
MAX_COPIED_BYTES = 64 << 20
#: Immutable values a scanned object may hold besides str, int, float, complex, bool,
#: bytes and None.
_ATOMS = (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter


def _remember(optimizer: torch.optim.Optimizer) -> None:
    """Registers the storages of `optimizer`'s parameters and tensor state (on the CPU or a
    CUDA device) that are not registered yet. It runs before every step, so the walk is the
    extension's: one attribute read and one lookup per tensor whose storage is registered."""
    _safe_storages.remember(optimizer.param_groups, optimizer.state, torch.Tensor)


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    waiter = _waiter
    if waiter is not None:
        waiter()
    _remember(optimizer)


def enable(wait: Callable[[], None]) -> None:
    """Installs the optimizer barrier; `wait` blocks until pending copies landed (it must
    not raise: a failed checkpoint is reported by the next nebulite call)."""
    global _hook_handle, _waiter
    _waiter = wait
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook_handle = register_optimizer_step_pre_hook(_pre_step)


def disable() -> None:
    global _hook_handle, _waiter
    _waiter = None
    if _hook_handle is not None:
        _hook_handle.remove()
        _hook_handle = None
    _safe_storages.clear()


def enabled() -> bool:
    return _waiter is not None


def any_safe() -> bool:
    """True if some storage may be deferred (an optimizer stepped with staging on)."""
    return _waiter is not None and len(_safe_storages) > 0


def deferrable(storage: torch.UntypedStorage, nbytes: int) -> bool:
    """True if `storage` may be copied after save() returns."""
    if _waiter is None or nbytes < MIN_DEFERRED_BYTES:
        return False
    return storage in _safe_storages


class Scanned:
    """What ``scan`` recorded of a saved object on the caller's thread, as flat lists (few
    objects per tensor there); the maps by id(storage) that the staging thread reads are
    made from them on first use."""

    def __init__(self, obj: Any, tensors: list[torch.Tensor], versions: list[int],
                 which: bytes, storage_list: list[torch.UntypedStorage], safe: bytes,
                 snapshot: bytearray, address: int, copied: list[tuple[int, int, int]],
                 storage_bytes: int,
                 layouts: list[tuple[torch.Tensor, Any, tuple[int, ...], int]],
                 cuda_devices: int = 0, skeleton_bytes: int = 0) -> None:
        self.obj = obj  # the saved object with its containers copied
        self._tensors = tensors  # each tensor met, with its _version at save()
        self._versions = versions
        self._which = memoryview(which).cast("I")  # each tensor's index in storage_list
        self._storage_list = storage_list
        self._safe = safe  # per storage: 1 if safe (copied later)
        self._copied = copied  # (index in storage_list, offset in snapshot, nbytes)
        self.snapshot = snapshot  # the bytes of the copied storages, copied at save()
        self.address = address
        self.storage_bytes = storage_bytes  # of every storage met
        self.layouts = layouts  # of the tensors on copied storages, at save()
        self.skeleton_bytes = skeleton_bytes  # the pickled skeleton's size, from above
        # The CUDA devices of the safe storages met (their copies are issued later).
        self.devices = [torch.device("cuda", i) for i in range(cuda_devices.bit_length())
                        if cuda_devices >> i & 1] if cuda_devices else []
        # device -> the event save() recorded on its current stream (see nebulite._device)
        self.marks: dict[torch.device, Any] = {}

    @property
    def image_bytes(self) -> int:
        """At most how large the object's data file will be (docs/format.md): its storages,
        each payload aligned to 4096 bytes behind headers of its own, its skeleton, and the
        few small records and the directory of every data file."""
        return (self.storage_bytes + len(self._storage_list) * (4096 + 512)
                + self.skeleton_bytes + (64 << 10))

    @functools.cached_property
    def views(self) -> dict[int, list[tuple[torch.Tensor, int]]]:
        """id(storage) -> [(tensor, _version at save())]"""
        out: dict[int, list[tuple[torch.Tensor, int]]] = {}
        ids = [id(st) for st in self._storage_list]
        for t, version, k in zip(self._tensors, self._versions, self._which):
            out.setdefault(ids[k], []).append((t, version))
        return out

    @functools.cached_property
    def storages(self) -> dict[int, torch.UntypedStorage]:
        return {id(st): st for st in self._storage_list}

    @functools.cached_property
    def deferred(self) -> set[int]:
        """id(storage) of the safe storages: copied later."""
        return {id(st) for st, safe in zip(self._storage_list, self._safe) if safe}

    @functools.cached_property
    def copied(self) -> dict[int, tuple[int, int]]:
        """id(storage) -> (offset in snapshot, nbytes) of the storages copied at save()."""
        return {id(self._storage_list[k]): (offset, n) for k, offset, n in self._copied}

    def moved(self) -> str | None:
        """Why the object pickled now may not be the one saved (None if it is): a tensor
        was given another storage, or one whose bytes save() copied has another layout.
        (Changes of the deferred tensors are found at the barrier, see Watch.)"""
        for sid, views in self.views.items():
            storage = self.storages[sid]
            for t, _ in views:
                if t.untyped_storage() is not storage:
                    return f"tensor {key_path(self.obj, t)!r} was given another storage"
        for t, shape, stride, offset in self.layouts:
            if t.shape != shape or t.stride() != stride or t.storage_offset() != offset:
                return f"tensor {key_path(self.obj, t)!r} was reshaped in place"
        return None


#: What instances of a class may define that makes them pickle otherwise than object's
#: default (a new instance given the attributes).
_PICKLING_HOOKS = ("__reduce_ex__", "__reduce__", "__getstate__", "__getnewargs__",
                   "__getnewargs_ex__", "__slots__")
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


@functools.lru_cache(maxsize=1024)
def _plain(cls: type) -> bool:
    """True if instances of `cls` pickle as object's default does: their class, and their
    ``__dict__`` as state; then a copy made at save() (a new instance given a copy of the
    attributes, see nebulite._core.scan) pickles as the instance did. So are DeepSpeed's
    ``LossScaler`` and ``fragment_address`` (a dataclass). Not a class defined in C or
    deriving from one (a tensor, a named tuple), one with ``__slots__`` or a pickling hook
    of its own, or one with a reducer in ``copyreg``."""
    if type(cls) not in (type, abc.ABCMeta) or cls in copyreg.dispatch_table:
        return False
    for c in cls.__mro__[:-1]:
        own = vars(c)
        if not c.__flags__ & _HEAP_TYPE or any(hook in own for hook in _PICKLING_HOOKS):
            return False
    return True


def scan(obj: Any) -> Scanned | None:
    """What an asynchronous save records of `obj` on the caller's thread (see the module's
    text), or None where it must be staged there whole."""
    if not any_safe():
        return None
    found = _core.scan(obj, _TENSOR, _PARAMETER, collections.OrderedDict, _ATOMS, enum.Enum,
                       _plain, _safe_storages, _MAX_DEPTH, MAX_COPIED_BYTES)
    return None if found is None else Scanned(*found)


def _tensors(obj: Any, path: tuple[Any, ...] = (), depth: int = 0,
             seen: set[int] | None = None) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """(key path, tensor) for every tensor reachable through dicts, lists, tuples and the
    attributes of objects the scan copies."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif _plain(type(obj)):
        items = vars(obj).items()
    else:
        return
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    for k, v in items:
        yield from _tensors(v, path + (k,), depth + 1, seen)


def key_path(obj: Any, tensor: torch.Tensor) -> str:
    """Where `tensor` is in `obj`, as dotted keys (``state.0.exp_avg``)."""
    for path, t in _tensors(obj):
        if t is tensor:
            return ".".join(str(k) for k in path) or "<the object itself>"
    return "<a tensor inside the object>"


class Watch:
    """The deferred storages of one saved object and the tensors that view them, as
    they were at save() (found by nebulite._plan.walk): what the barrier checks before
    the object may be committed. Keeps the object alive until then."""

    def __init__(self, obj: Any = None, structure: Any = None,
                 scanned: Scanned | None = None) -> None:
        self._obj = obj
        self.scanned = scanned  # what save() recorded, when it scanned the object
        # id(storage) -> [(tensor, _version at save)] for tensors found in the object
        self._views: dict[int, list[tuple[torch.Tensor, int]]] = (
            scanned.views if scanned is not None
            else structure.views if structure is not None and any_safe() else {})
        self.deferred: list[tuple[torch.UntypedStorage, list[tuple[torch.Tensor, int]]]] = []

    def defer(self, storage: torch.UntypedStorage, nbytes: int) -> bool:
        """True (and recorded) if `storage` is copied after save() returns: it is safe and
        the saved object's own tensors on it are known, so that a change shows."""
        views = self._views.get(id(storage))
        if not views:
            return False
        if self.scanned is not None:
            if id(storage) not in self.scanned.deferred:
                return False
        elif not deferrable(storage, nbytes):
            return False
        self.deferred.append((storage, views))
        return True

    def changed(self) -> str | None:
        """Why the deferred bytes may not be the ones at save() (None if they are)."""
        for storage, views in self.deferred:
            for t, version in views:
                if t._version != version:
                    return f"tensor {key_path(self._obj, t)!r} was changed in place"
                if t.untyped_storage() is not storage:
                    return f"tensor {key_path(self._obj, t)!r} was given another storage"
        return None

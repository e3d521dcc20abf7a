"""The structure of a saved object, found in one walk, and the flattenings it lets us reuse.

Flattening an object through torch's serializer pickles every value with a Python
callback per object: tens of milliseconds for a GPT-2 state and its optimizer's. Saves
of one training run save objects of the same structure again and again; only the bytes
of their tensors differ. `walk()` visits an object once and returns its *key* (every
container's type and size, every key and leaf value with its type, and for each tensor
its type, dtype, shape, strides, offset, requires_grad and which of the object's storages
it views), its distinct storages in the order they were met, and each storage's tensors
with their ``_version`` counters (what asynchronous staging checks, see nebulite._staging).
An object whose key equals the one its name had last time pickles to the same skeleton
(``data.pkl``), so the skeleton and the record layout are reused and only the storages'
addresses are taken afresh.

Only objects made of dicts, lists, tuples, plain scalars and plain CPU or CUDA tensors have
a key (a CUDA tensor's includes its device); anything else (a custom class, a tensor
subclass, a tensor with hooks or attributes of its own, a quantized, conjugate or
negative-bit tensor) is flattened by torch's serializer every time.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _core

#: How deep containers are followed; deeper objects have no key.
MAX_DEPTH = 64
#: Names whose plan is kept (the newest ones).
MAX_PLANS = 64

Tensor, Parameter, strided = torch.Tensor, torch.nn.Parameter, torch.strided
OrderedDict = collections.OrderedDict


@dataclass
class Structure:
    """What one walk of a saved object found."""

    key: tuple[Any, ...] | None
    storages: list[torch.UntypedStorage] = field(default_factory=list)
    # id(storage) -> [(tensor, its _version at save)], for every tensor met in the walk
    views: dict[int, list[tuple[torch.Tensor, int]]] = field(default_factory=dict)


def walk(obj: Any) -> Structure:
    """The structure of `obj` (see the module's text), in one pass of nebulite._core.walk:
    the per-tensor work of every save, on the caller's thread (for an asynchronous save that
    nebulite._staging.scan took, on the staging thread)."""
    key, storages, views = _core.walk(obj, Tensor, Parameter, strided, OrderedDict, MAX_DEPTH)
    return Structure(key, storages, views)


@dataclass(frozen=True)
class Plan:
    """A reusable flattening: the records in order, each either fixed bytes or the
    storage with that walk order (`None` marks the records made afresh each save)."""

    key: tuple[Any, ...]
    # (record name, bytes, None) or (record name, None, storage index, size)
    records: tuple[tuple[Any, ...], ...]


_lock = threading.Lock()
_plans: collections.OrderedDict[str, Plan] = collections.OrderedDict()


def find(name: str, key: tuple[Any, ...] | None) -> Plan | None:
    if key is None:
        return None
    with _lock:
        plan = _plans.get(name)
        if plan is None or plan.key != key:
            return None
        _plans.move_to_end(name)
        return plan


def keep(name: str, plan: Plan) -> None:
    with _lock:
        _plans[name] = plan
        _plans.move_to_end(name)
        while len(_plans) > MAX_PLANS:
            _plans.popitem(last=False)


def forget() -> None:
    with _lock:
        _plans.clear()

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
copied before save() returns.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

_lock = threading.Lock()
_safe_storages: set[int] = set()
_hook_handle: Any = None
_waiter: Callable[[], None] | None = None

#: Storages smaller than this are always copied before save() returns.
MIN_DEFERRED_BYTES = 1 << 20


def _storage_ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def _remember(optimizer: torch.optim.Optimizer) -> None:
    ptrs = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, torch.Tensor) and p.device.type == "cpu":
                ptrs.add(_storage_ptr(p))
    for state in optimizer.state.values():
        if isinstance(state, dict):
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.numel() > 0:
                    ptrs.add(_storage_ptr(v))
    with _lock:
        _safe_storages.update(ptrs)


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    waiter = _waiter
    if waiter is not None:
        waiter()
    _remember(optimizer)


def enable(wait: Callable[[], None]) -> None:
    """Installs the optimizer barrier; `wait` blocks until pending copies landed."""
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
    with _lock:
        _safe_storages.clear()


def enabled() -> bool:
    return _waiter is not None


def deferrable(data_ptr: int, nbytes: int) -> bool:
    """True if a storage may be copied after save() returns."""
    if _waiter is None or nbytes < MIN_DEFERRED_BYTES:
        return False
    with _lock:
        return data_ptr in _safe_storages

"""The few torch.distributed operations nebulite needs, usable when it is absent."""

from __future__ import annotations

import uuid

import torch


def initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_and_world() -> tuple[int, int]:
    if initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _device() -> torch.device:
    backend = torch.distributed.get_backend()
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(values: list[int]) -> list[int]:
    """Element-wise maximum of `values` over every rank (identity when alone)."""
    if not initialized() or torch.distributed.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [int(x) for x in t.tolist()]


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def agree_on_run_id() -> str:
    """A run id chosen by rank 0 and shared with every rank."""
    run_id = new_run_id()
    if initialized() and torch.distributed.get_world_size() > 1:
        box = [run_id]
        torch.distributed.broadcast_object_list(box, src=0)
        run_id = str(box[0])
    return run_id


def all_gather(obj: object) -> list[object]:
    """Every rank's `obj`, in rank order (a list of one when alone)."""
    if not initialized() or torch.distributed.get_world_size() == 1:
        return [obj]
    out: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out

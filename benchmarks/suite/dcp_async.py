"""DCP ``async_save`` with its cached asynchronous stager, timed: the peer that
bench_async_staging.py and bench_gpu.py put nebulite's asynchronous saves beside."""

from __future__ import annotations

import os
import shutil
import time
import warnings
from typing import Any

import torch


def async_save_times(state: dict[str, Any], d: str, reps: int) -> list[dict[str, float]]:
    """`reps` saves of `state` below `d` (after one left out, which warms the stager's
    memory) through ``torch.distributed.checkpoint.async_save`` with
    ``DefaultStager(StagingOptions(use_pinned_memory=<CUDA>, use_shared_memory=True,
    use_async_staging=True))``, kept across saves: DCP's fastest configuration. Each
    save's ``blocking_s`` (until the call returns) and ``staged_s`` (until its staging
    future is done); with CUDA, the device is synchronised before each save starts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    warnings.filterwarnings("ignore", module=r"torch\.distributed")
    cuda = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(cuda, True, True, False))
    out = []
    try:
        for i in range(reps + 1):
            path = os.path.join(d, f"dcp-{i}")
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            f = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
            t1 = time.perf_counter()
            f.staging_completion.result()
            t2 = time.perf_counter()
            f.upload_completion.result()
            shutil.rmtree(path, ignore_errors=True)
            if i:
                out.append({"blocking_s": t1 - t0, "staged_s": t2 - t0})
    finally:
        stager.close()
    return out

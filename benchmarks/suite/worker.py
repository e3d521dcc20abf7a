"""One candidate family, in a process of its own: ``python -m suite.worker '<json spec>'``.

Families: ``limits`` (the machine's limits), ``torch`` (torch.save with and without fsync),
``dcp`` (torch.distributed.checkpoint save / async_save variants), ``nebulite-sync``,
``nebulite-async`` (embedded engine, synchronous or asynchronous staging),
``nebulite-agent`` (the node agent), ``train`` (the training run).

Each save candidate: a warm-up save, then `reps` timed saves (blocking time: until the
call returns; committed: until the checkpoint is durable), then one more save while the
parent samples the memory of this process and its descendants (that save is not timed,
so sampling never disturbs a timing). Every process builds its own state from the same
seed: the candidates save the same bytes, and memory is not shared between them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import shutil
import sys
import time
import warnings
from typing import Any, Callable

import torch

from . import limits, workloads
from .link import Link

MiB = 1 << 20


def arena_bytes(state_bytes: int, factor: float) -> int:
    """nebulite's memory budget for a state: `factor` times its size plus room for the
    archive headers and 4 KiB alignment of every tensor, in whole MiB."""
    return (int(state_bytes * factor) + 16 * MiB + MiB - 1) // MiB * MiB


def _malloc_trim() -> None:
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def _reps(reps: int, one: Callable[[int], dict[str, float]]) -> dict[str, Any]:
    """Runs one(0) as a warm-up, then one(1..reps); gathers each figure into a list. The
    warm-up's figures are kept apart as first_<figure> (the first save after setting up)."""
    out: dict[str, Any] = {}
    for i in range(reps + 1):
        figures = one(i)
        for k, v in figures.items():
            if i:
                out.setdefault(k, []).append(v)
            else:
                out[f"first_{k}"] = v
    return out


# --------------------------------------------------------------------------- torch.save


def run_torch(held: dict[str, Any], spec: dict[str, Any], link: Link) -> dict[str, Any]:
    state, d, reps = held["state"], spec["dir"], spec["reps"]
    out: dict[str, Any] = {}
    last: list[str] = []

    def save(i: int, fsync: bool) -> dict[str, float]:
        path = os.path.join(d, f"torch-{'fsync' if fsync else 'nofsync'}-{i}.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        if last:
            _rm(last.pop())
        last.append(path)
        return {"blocking_s": dt, "committed_s": dt}

    key = "torch.save+fsync"
    link.baseline(key)
    out[key] = _reps(reps, lambda i: save(i, True))
    link.monitor(key, True)
    save(reps + 1, True)
    link.monitor(key, False)
    keep = last.pop()

    key = "torch.save"
    out[key] = _reps(reps, lambda i: save(i, False))
    for k in ("committed_s", "first_committed_s"):
        out[key].pop(k)  # not durable: the page cache holds it
    _rm(last.pop())
    os.sync()  # write back what the unsynced saves left dirty, before anything else runs
    out["file"] = keep
    return out


# --------------------------------------------------------------------------- DCP


def run_dcp(held: dict[str, Any], spec: dict[str, Any], link: Link) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    warnings.filterwarnings("ignore", module=r"torch\.distributed")
    state, d, reps = held["state"], spec["dir"], spec["reps"]
    # Single process: DCP needs no process group (it saves as one rank without one).
    out: dict[str, Any] = {"process_group": "none (single process, no_dist)"}
    cuda = torch.cuda.is_available()

    def variant(key: str, make_stager: Callable[[], Any] | None, asynchronous: bool) -> str:
        stager = None
        last: list[str] = []

        def one(i: int) -> dict[str, float]:
            path = os.path.join(d, f"dcp-{key.replace('+', '-')}-{i}")
            t0 = time.perf_counter()
            if not asynchronous:
                dcp.save(state, checkpoint_id=path)
                t1 = t2 = t3 = time.perf_counter()
            else:
                kw = {"async_stager": stager} if stager is not None else {}
                f = dcp.async_save(state, checkpoint_id=path, **kw)
                t1 = time.perf_counter()
                if hasattr(f, "staging_completion"):  # staging in the background too
                    f.staging_completion.result()
                    t2 = time.perf_counter()
                    f.upload_completion.result()
                else:
                    t2 = t1
                    f.result()
                t3 = time.perf_counter()
            if last:
                _rm(last.pop())
            last.append(path)
            return {"blocking_s": t1 - t0, "staged_s": t2 - t0, "committed_s": t3 - t0}

        link.baseline(key)
        if make_stager is not None:
            stager = make_stager()
        out[key] = _reps(reps, one)
        link.monitor(key, True)
        one(reps + 1)
        link.monitor(key, False)
        if stager is not None:
            stager.close()
        gc.collect()
        return last.pop()

    _rm(variant("dcp.async_save", None, True))
    # DCP's own stager, kept across saves: it caches the staged copy (in shared memory;
    # pinned where CUDA is available), so later saves copy into warm memory.
    _rm(variant("dcp.async_save+stager",
                lambda: DefaultStager(StagingOptions(cuda, True, False, False)), True))
    _rm(variant("dcp.async_save+async_stager",
                lambda: DefaultStager(StagingOptions(cuda, True, True, False)), True))
    out["dir"] = variant("dcp.save", None, False)
    return out


# --------------------------------------------------------------------------- nebulite

def committed_at(root: str, tag: str) -> float | None:
    """The time (Unix seconds, to the millisecond) at which checkpoint `tag` was logged
    committed in the store's checkpointHistories.csv, or None."""
    import csv
    import datetime

    try:
        with open(os.path.join(root, "checkpointHistories.csv"), newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["tag"] == tag and r["outcome"] == "committed"]
    except (OSError, KeyError):
        return None
    if not rows:
        return None
    stamp = rows[-1]["time_utc"].replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


NEBULITE_KEYS = {"sync": "nebulite", "async": "nebulite async staging", "agent": "nebulite agent"}


def run_nebulite(held: dict[str, Any], spec: dict[str, Any], link: Link, mode: str) -> dict[str, Any]:
    import nebulite as nm

    state, reps = held["state"], spec["reps"]
    nbytes = workloads.state_bytes(state)
    memory = arena_bytes(nbytes, spec["memory_factor"])
    root = os.path.join(spec["dir"], f"nebulite-{mode}")
    key = NEBULITE_KEYS[mode]
    names = list(state)

    link.baseline(key)
    t0 = time.perf_counter()
    nm.init(root, persistent_time_interval=0, num_of_version_in_retention=2,
            memory_buffer_size=memory, agent=mode == "agent", async_staging=mode == "async",
            agent_idle_exit=900)
    if mode == "async":
        held["optimizer"].step()  # no gradients: nothing changes; nebulite learns its storages
    init_s = time.perf_counter() - t0
    # The memory tier is pre-faulted in the background after init(); a training job reaches
    # its first checkpoint long after that is done, so wait for it.
    engine = getattr(getattr(nm.api, "_session", None), "engine", None)
    t0 = time.perf_counter()
    if hasattr(engine, "wait_prefaulted"):
        engine.wait_prefaulted()
    prefault_s = time.perf_counter() - t0

    def one(i: int) -> dict[str, float]:
        wall0 = time.time()
        t0 = time.perf_counter()
        ck = nm.Checkpoint(f"bench{i}", num_files=len(names))
        for n in names:
            ck.save(n, state[n])
        t1 = time.perf_counter()
        nm.wait_staged()  # what an optimizer step right after the save would wait for
        t2 = time.perf_counter()
        nm.flush_persistence()
        t3 = time.perf_counter()
        # Committed: when the engine logged the commit marker durable. flush_persistence()
        # returns later, after store retention has deleted the oldest checkpoint.
        at = committed_at(root, f"bench{i}")
        committed = min(at - wall0, t3 - t0) if at is not None else t3 - t0
        return {"blocking_s": t1 - t0, "staged_s": t2 - t0, "committed_s": max(committed, t2 - t0),
                "flushed_s": t3 - t0}

    out: dict[str, Any] = {"init_s": init_s, "prefault_wait_s": prefault_s, "memory_budget": memory,
                           "root": root, "names": names}
    out[key] = _reps(reps, one)
    link.monitor(key, True)
    one(reps + 1)
    link.monitor(key, False)
    info = nm.session_info()
    out["memory_used"] = info["memory_used"]
    out["agent_pid"] = info["agent_pid"]
    on_disk = 0
    for dpath, _, files in os.walk(os.path.join(root, f"bench{reps + 1}")):
        on_disk += sum(os.path.getsize(os.path.join(dpath, f)) for f in files)
    out["bytes_on_disk"] = on_disk

    if mode == "sync":
        # Load from the memory tier of this very process (a rollback without a restart):
        # drop the state first, so that only the checkpoint's copy is in memory.
        held.clear()
        del state
        gc.collect()
        t0 = time.perf_counter()
        ck = nm.get_latest_checkpoint()
        t1 = time.perf_counter()
        loaded = {n: ck.load(n) for n in names}
        t2 = time.perf_counter()
        out["load_memory"] = {"seconds": t2 - t0, "find_s": t1 - t0, "load_s": t2 - t1,
                              "tier": nm.list_checkpoints()[0]["tier"],
                              "bytes": workloads.state_bytes(loaded)}
        del loaded
    nm.shutdown()  # the agent, if any, stays: the suite loads from its memory next
    return out


# --------------------------------------------------------------------------- main


def main() -> int:
    spec = json.loads(sys.argv[1])
    link = Link()
    family = spec["family"]
    torch.set_num_threads(spec.get("threads") or os.cpu_count() or 1)
    if family == "limits":
        link.result(limits.measure(spec["dir"], spec["memcpy_bytes"], spec["disk_bytes"]))
        return 0
    if family == "train":
        from . import train

        link.result(train.run(spec, link))
        return 0
    t0 = time.perf_counter()
    state, optimizer = workloads.build(spec["workload"])
    held: dict[str, Any] = {"state": state, "optimizer": optimizer}
    del state, optimizer
    # Hand what building the state freed back to the system, so that the memory baseline
    # does not include it (it would hide as much of a candidate's own memory).
    gc.collect()
    _malloc_trim()
    info = workloads.describe(held["state"])
    info["build_s"] = time.perf_counter() - t0
    link.progress(f"  {family}: state built ({info['bytes'] / 1e9:.2f} GB, {info['tensors']} tensors, "
                  f"{info['build_s']:.1f} s)")
    if family == "torch":
        out = run_torch(held, spec, link)
    elif family == "dcp":
        out = run_dcp(held, spec, link)
    elif family.startswith("nebulite-"):
        out = run_nebulite(held, spec, link, family[len("nebulite-"):])
    else:
        raise SystemExit(f"unknown family {family!r}")
    out["state"] = info
    link.result(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

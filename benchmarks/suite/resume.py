"""One rank of the resume workload: ``python -m suite.resume '<json spec>'``.

Every rank is a process of its own and joins a torch.distributed process group (gloo, tcp on
127.0.0.1) first, as the ranks of a job on one node do. Roles:

- ``save``: builds this rank's shard (a few tensors, `shard_mb` MiB in all, and the step),
  initialises nebulite (embedded engine, a persistent path, retention 2), saves `checkpoints`
  checkpoints of it (``Checkpoint(tag, -2).save(f"shard{rank}", shard)`` and ``commit()``,
  the shard changing between them), flushes and shuts down; then saves the final shard once
  more with ``torch.distributed.checkpoint.save`` (a state dict of this rank's own keys,
  ``shard{rank}.<tensor>``), and reports a CRC of every tensor of the final shard;
- ``nebulite``: a restarted rank: ``init()`` as the job does at its start (not timed), then,
  timed, ``get_latest_checkpoint(persist_path=...)`` and ``load(f"shard{rank}")``;
- ``dcp``: a restarted rank that resumes with DCP: empty tensors of the shard's shapes (the
  job knows them from its model; not timed), then, timed, ``torch.distributed.checkpoint.load``
  of a state dict holding only this rank's keys.

A resume reports its time, what ``/proc/self/io`` counted from just before the first call to
just after the shard is loaded (``rchar``: bytes returned by read system calls, page cache or
not; ``read_bytes``: bytes this process had fetched from the disk), and the size of this rank's
own data files in the checkpoint it resumed from. It checks every tensor against the saving
rank's CRCs, after the measurement.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings
import zlib
from typing import Any

import torch
import torch.distributed as dist

from .link import Link
from .worker import arena_bytes

MiB = 1 << 20
COLUMNS = 1024
#: The shard's tensors: (name, share of the shard's bytes in 16ths, dtype).
LAYOUT = [("w0", 8, torch.float32), ("w1", 4, torch.float32), ("w2", 2, torch.float32),
          ("w3", 1, torch.float32), ("w4", 1, torch.bfloat16)]


def shapes(shard_mb: int) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
    """Shape and dtype of every tensor of a shard of `shard_mb` MiB."""
    out = {}
    for name, sixteenths, dtype in LAYOUT:
        nbytes = shard_mb * MiB * sixteenths // 16
        elements = nbytes // torch.empty((), dtype=dtype).element_size()
        out[name] = ((elements // COLUMNS, COLUMNS), dtype)
    return out


def build_shard(rank: int, shard_mb: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + rank)
    shard: dict[str, Any] = {}
    for name, (shape, dtype) in shapes(shard_mb).items():
        t = torch.rand(shape, generator=g)
        shard[name] = t if dtype == torch.float32 else t.to(dtype)
    shard["step"] = 0
    return shard


def set_step(shard: dict[str, Any], rank: int, step: int) -> None:
    """What a training step changes: a row of every tensor, and the step."""
    for name, _, _ in LAYOUT:
        shard[name][0].fill_(rank * 1000 + step)
    shard["step"] = step


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def fingerprint(shard: dict[str, Any]) -> dict[str, int]:
    return {name: crc(shard[name]) for name, _, _ in LAYOUT}


def proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k.strip(): int(v) for k, v in (line.split(":", 1) for line in f if ":" in line)}


def io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("rchar", "read_bytes", "syscr")}


def files_of(directory: str) -> dict[str, int]:
    out = {}
    for d, _, names in os.walk(directory):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, directory)] = os.path.getsize(p)
    return out


def init_nebulite(spec: dict[str, Any]) -> None:
    import nebulite as nm

    nm.init(spec["root"], persistent_time_interval=0, num_of_version_in_retention=2,
            memory_buffer_size=arena_bytes(spec["shard_mb"] * MiB, spec["memory_factor"]),
            agent=False, commit_timeout=spec["timeout_s"])


# --------------------------------------------------------------------------- save


def run_save(spec: dict[str, Any], rank: int, link: Link) -> dict[str, Any]:
    import nebulite as nm
    import torch.distributed.checkpoint as dcp

    shard = build_shard(rank, spec["shard_mb"])
    init_nebulite(spec)
    saves = []
    for step in range(1, spec["checkpoints"] + 1):
        set_step(shard, rank, step)
        t0 = time.perf_counter()
        ck = nm.Checkpoint(f"step{step}", -2)
        ck.save(f"shard{rank}", shard)
        t1 = time.perf_counter()
        if not ck.commit():
            raise RuntimeError(f"rank {rank}: checkpoint step{step} did not commit")
        saves.append({"tag": f"step{step}", "blocking_s": t1 - t0, "commit_s": time.perf_counter() - t0})
    t0 = time.perf_counter()
    nm.flush_persistence(timeout=spec["timeout_s"])
    flush_s = time.perf_counter() - t0
    nm.shutdown()
    if rank == 0:
        link.progress(f"  resume: {spec['checkpoints']} nebulite checkpoints saved by {spec['world']} ranks")

    dist.barrier()
    t0 = time.perf_counter()
    dcp.save({f"shard{rank}.{k}": v for k, v in shard.items()}, checkpoint_id=spec["dcp_dir"])
    dcp_s = time.perf_counter() - t0
    return {"saves": saves, "flush_s": flush_s, "dcp_save_s": dcp_s, "fingerprint": fingerprint(shard),
            "step": spec["checkpoints"]}


# --------------------------------------------------------------------------- resume


def check(rank: int, what: str, got: dict[str, Any], spec: dict[str, Any]) -> None:
    want = {k: int(v) for k, v in spec["fingerprint"].items()}
    have = fingerprint(got)
    if have != want or got["step"] != spec["step"]:
        raise RuntimeError(f"rank {rank}: {what} resumed step {got['step']} (want {spec['step']}), "
                           f"CRCs {have} (want {want})")


def run_nebulite(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    import nebulite as nm

    nm.get_latest_checkpoint  # noqa: B018 - imports the API now (nebulite imports it lazily)
    io0 = proc_io()
    t0 = time.perf_counter()
    init_nebulite(spec)
    init_s = time.perf_counter() - t0
    io_init = io_delta(io0, proc_io())
    dist.barrier()  # every rank starts resuming at once, as after a restart

    io1 = proc_io()
    t0 = time.perf_counter()
    ck = nm.get_latest_checkpoint(persist_path=spec["root"])
    t1 = time.perf_counter()
    shard = ck.load(f"shard{rank}")
    t2 = time.perf_counter()
    io = io_delta(io1, proc_io())

    entry = next(e for e in nm.list_checkpoints(persist_path=spec["root"]) if e["tag"] == ck.tag)
    own = files_of(os.path.join(entry["path"], f"rank{rank}"))
    check(rank, f"nebulite ({ck.tag})", shard, spec)
    store = sorted(e["tag"] for e in nm.list_checkpoints(persist_path=spec["root"]))
    nm.shutdown()
    return {"seconds": t2 - t0, "find_s": t1 - t0, "load_s": t2 - t1, "io": io, "init_s": init_s,
            "init_io": io_init, "tag": ck.tag, "store": store, "own_files": own,
            "own_bytes": sum(own.values())}


def run_dcp(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    warnings.filterwarnings("ignore", module=r"torch\.distributed")
    try:  # imported by dcp.load's first call (to pick a reader): now, outside the measurement
        import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401
    except ImportError:
        pass
    target: dict[str, Any] = {f"shard{rank}.{k}": torch.empty(shape, dtype=dtype)
                              for k, (shape, dtype) in shapes(spec["shard_mb"]).items()}
    target[f"shard{rank}.step"] = 0
    dist.barrier()

    io1 = proc_io()
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=spec["dcp_dir"])
    t1 = time.perf_counter()
    io = io_delta(io1, proc_io())

    shard = {k.split(".", 1)[1]: v for k, v in target.items()}
    check(rank, "DCP", shard, spec)
    # This rank's share: the files that hold its own items, by the checkpoint's metadata
    # (and which ranks' items each of them holds: each rank's own file, if DCP wrote it so).
    md = dcp.FileSystemReader(spec["dcp_dir"]).read_metadata()
    holders: dict[str, set[str]] = {}
    for index, info in (md.storage_data or {}).items():
        holders.setdefault(info.relative_path, set()).add(index.fqn.split(".", 1)[0])
    mine = {f for f, owners in holders.items() if f"shard{rank}" in owners}
    own = {f: os.path.getsize(os.path.join(spec["dcp_dir"], f)) for f in sorted(mine)}
    tensors = sum(1 for m in md.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata))
    return {"seconds": t1 - t0, "io": io, "own_files": own, "own_bytes": sum(own.values()),
            "files_shared_with": sorted(set().union(*(holders[f] for f in mine)) - {f"shard{rank}"}),
            "checkpoint_tensors": tensors}


# --------------------------------------------------------------------------- main


def main() -> int:
    spec = json.loads(sys.argv[1])
    link = Link()
    rank, world = spec["rank"], spec["world"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    try:
        role = spec["role"]
        if role == "save":
            out = run_save(spec, rank, link)
        elif role == "nebulite":
            out = run_nebulite(spec, rank)
        elif role == "dcp":
            out = run_dcp(spec, rank)
        else:
            raise SystemExit(f"unknown role {role!r}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    out["rank"] = rank
    link.result(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

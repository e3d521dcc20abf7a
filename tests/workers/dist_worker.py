"""Worker for tests/test_multirank.py: one rank of a multi-process nebulite run.

Usage: dist_worker.py MODE STORE RANK WORLD PORT [ARGS...]

Modes:
  dist TAGS RETENTION  -- torch.distributed (gloo) run; every rank saves a rank-specific
                          shard for each tag (rank 0 also "model"), commits, flushes and
                          loads rank 0's "model" back through get_latest_checkpoint(STORE).
  plain                -- no torch.distributed: nm.init(..., rank=R, world_size=2);
                          both ranks commit and flush t1, t2; for t3 rank 1 saves and
                          exits without committing, rank 0 commits and flushes with a timeout.
  misstep              -- torch.distributed: one save() fails on rank 1 only (caught), the
                          ranks go on saving, committing and loading t1..t3.
  rank_error           -- torch.distributed: rank 1's store write of t1 fails in the
                          background; then both ranks commit t2 and report what they raised.
  shard_save SIZE_MB   -- torch.distributed: every rank saves its own shard of SIZE_MB MiB
                          for t1, t2 (retention 2) and flushes.
  shard_resume         -- torch.distributed: every rank finds the latest checkpoint and loads
                          its own shard, counting the bytes it read (/proc/self/io).
  init_only            -- torch.distributed: every rank calls init() and reports what it
                          raised (a store another job writes), then meets the others.
  rank0_dies PHASE     -- torch.distributed, each rank on a node of its own (one agent each).
                          PHASE crash: t0 is persisted, t1 committed to memory only; for t2
                          rank 0 dies between the ranks' agreement and its own commit, and
                          rank 1 commits and persists t2, then dies too. PHASE resume: a new
                          job over the same agents finds the latest checkpoint (t1),
                          loads it and finds its persisted file; each rank reports what
                          its agent says of t2.
Prints one JSON line "RESULT {...}" on success and exits 0.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch

import nebulite as nm

#: Bounds a hang only: what is waited for comes in milliseconds, many times that on a busy
#: machine.
HANG_TIMEOUT = 600


def wait_for_manifest(store: str, tag: str, rank: int) -> None:
    """Waits until rank `rank`'s manifest of `tag` is in the store: the ranks here are plain
    processes, started at once but reaching a step whenever the machine lets them, and the
    coordinator (rank 0) must see every rank's manifest within its short commit timeout."""
    deadline = time.monotonic() + HANG_TIMEOUT
    tdir = os.path.join(store, tag)
    while not (os.path.isdir(tdir) and any(os.path.exists(os.path.join(tdir, v, f"rank{rank}.manifest"))
                                           for v in os.listdir(tdir))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} never persisted {tag}")
        time.sleep(0.01)


def shard(rank: int, step: int) -> dict:
    return {
        "w": torch.full((64, 64), float(rank * 100 + step)),
        "idx": torch.arange(32, dtype=torch.int64) + rank * 1000 + step,
        "rank": rank,
        "step": step,
    }


def model(step: int) -> dict:
    return {"weight": torch.full((128, 32), float(step) + 0.5), "bias": torch.arange(16.0) * step}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def run_dist(store: str, rank: int, world: int, port: int, ntags: int, retention: int) -> dict:
    import torch.distributed as dist

    per_node = int(os.environ.get("NEBULITE_TEST_RANKS_PER_NODE", "0"))
    if per_node:  # simulate several nodes on this machine: one agent per node identity
        os.environ["NEBULITE_NODE_ID"] = f"node{rank // per_node}"
    _init_dist(rank, world, port)
    nm.init(persistent_storage_path=store, persistent_time_interval=0,
            num_of_version_in_retention=retention, commit_timeout=60)
    info = nm.session_info()
    assert info["rank"] == rank and info["world_size"] == world, info
    loaded, early = [], []
    for step in range(1, ntags + 1):
        tag = f"t{step}"
        ck = nm.Checkpoint(tag, -2)
        ck.save(f"shard_rank{rank}", shard(rank, step))
        if rank == 0:
            ck.save("model", model(step))
        assert ck.commit() is True
        # DeepSpeed-style: every rank loads rank 0's model straight after commit. The ranks
        # agree on the newest checkpoint every one of them can load: this one, or (while it
        # is not loadable everywhere yet) the previous one. Recorded for the parent.
        latest = nm.get_latest_checkpoint(persist_path=store)
        previous = f"t{step - 1}" if step > 1 else ""
        assert latest.tag in (tag, previous), (latest.tag, tag)
        want = step if latest.tag == tag else step - 1
        try:
            if latest.tag:
                ok = same(latest.load("model"), model(want))
                early.append(("ok" if latest.tag == tag else "older") if ok else "wrong content")
            else:
                early.append("older")
        except Exception as e:  # noqa: BLE001 - reported to the parent
            early.append(f"{type(e).__name__}: {e}")
        if latest.tag == tag:
            assert same(latest.load(f"shard_rank{rank}"), shard(rank, step))
        # ... and after it was persisted and committed in the store.
        nm.flush_persistence(timeout=HANG_TIMEOUT)
        latest = nm.get_latest_checkpoint(persist_path=store)
        assert latest.tag == tag, (latest.tag, tag)
        assert same(latest.load("model"), model(step)), f"rank {rank}: model of {tag} (store)"
        # Any rank's object is loadable by name from any rank.
        for r in range(world):
            assert same(latest.load(f"shard_rank{r}"), shard(r, step)), (rank, r, tag)
        loaded.append(tag)
    agent_pid = getattr(nm.api._session.engine, "agent_pid", None)
    dist.barrier()
    nm.shutdown()
    dist.destroy_process_group()
    return {"rank": rank, "loaded": loaded, "model_before_flush": early, "agent_pid": agent_pid}


def run_plain(store: str, rank: int) -> dict:
    # The two processes agree on the run id through the environment (no collective).
    nm.init(persistent_storage_path=store, persistent_time_interval=0,
            num_of_version_in_retention=0, rank=rank, world_size=2, commit_timeout=2)
    out: dict = {"rank": rank}
    for step in (1, 2):
        tag = f"t{step}"
        ck = nm.Checkpoint(tag, -2)
        ck.save(f"shard_rank{rank}", shard(rank, step))
        if rank == 0:
            wait_for_manifest(store, tag, 1)
        assert ck.commit() is True
        nm.flush_persistence(timeout=HANG_TIMEOUT)
    if rank == 1:
        ck = nm.Checkpoint("t3", -2)
        ck.save("shard_rank1", shard(1, 3))
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)  # dies without committing t3
    ck = nm.Checkpoint("t3", -2)
    ck.save("shard_rank0", shard(0, 3))
    assert ck.commit() is True
    t0 = time.monotonic()
    try:
        nm.flush_persistence(timeout=HANG_TIMEOUT)  # the commit timeout (2 s) ends it
        out["flush_error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out["flush_error"] = f"{type(e).__name__}: {e}"
    out["flush_seconds"] = time.monotonic() - t0
    latest = nm.get_latest_checkpoint(persist_path=store)
    out["latest_here"] = latest.tag
    try:
        latest.load("shard_rank1")
        out["load_rank1_from_latest"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["load_rank1_from_latest"] = f"{type(e).__name__}: {e}"
    t0 = time.monotonic()
    try:
        nm.shutdown()
        out["shutdown_error"] = None
    except Exception as e:  # noqa: BLE001
        out["shutdown_error"] = f"{type(e).__name__}: {e}"
    out["shutdown_seconds"] = time.monotonic() - t0
    return out


def run_plain_no_flush(store: str, rank: int) -> dict:
    """No torch.distributed, interval 0: both ranks commit t1 (rank 0 once rank 1's manifest
    is in); only rank 0 flushes; rank 1 waits for the commit marker to appear without
    calling flush_persistence."""
    nm.init(persistent_storage_path=store, persistent_time_interval=0,
            num_of_version_in_retention=0, rank=rank, world_size=2, commit_timeout=4)
    ck = nm.Checkpoint("t1", -2)
    ck.save(f"shard_rank{rank}", shard(rank, 1))
    if rank == 0:
        wait_for_manifest(store, "t1", 1)
    assert ck.commit() is True
    out: dict = {"rank": rank}
    if rank == 0:
        try:
            nm.flush_persistence(timeout=HANG_TIMEOUT)
            out["flush_error"] = None
        except Exception as e:  # noqa: BLE001
            out["flush_error"] = f"{type(e).__name__}: {e}"
    else:
        deadline = time.monotonic() + HANG_TIMEOUT
        while time.monotonic() < deadline and not any(
            os.path.exists(os.path.join(store, "t1", v, "COMMITTED"))
            for v in (os.listdir(os.path.join(store, "t1")) if os.path.isdir(os.path.join(store, "t1")) else [])
        ):
            time.sleep(0.05)
    # What the store holds as committed (this rank may also still hold t1 in memory).
    out["committed"] = [e["tag"] for e in nm._core.read_catalog(store)[0]]
    return out


def _init_dist(rank: int, world: int, port: int) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=HANG_TIMEOUT))


def run_misstep(store: str, rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist

    _init_dist(rank, world, port)
    nm.init(persistent_storage_path=store, persistent_time_interval=0,
            num_of_version_in_retention=0, commit_timeout=20)
    loaded = []
    for step in (1, 2, 3):
        tag = f"t{step}"
        if rank == 1 and step == 1:
            try:  # a save that fails on this rank only, caught by the training script
                nm.Checkpoint(tag, -2).save("bad", lambda: None)
            except Exception:  # noqa: BLE001
                pass
        ck = nm.Checkpoint(tag, -2)
        ck.save(f"shard_rank{rank}", shard(rank, step))
        assert ck.commit() is True
        nm.flush_persistence(timeout=HANG_TIMEOUT)
        latest = nm.get_latest_checkpoint(persist_path=store)
        assert latest.tag == tag, (rank, latest.tag, tag)
        for r in range(world):
            assert same(latest.load(f"shard_rank{r}"), shard(r, step)), (rank, r, tag)
        loaded.append(tag)
    dist.barrier()
    nm.shutdown()
    dist.destroy_process_group()
    return {"rank": rank, "loaded": loaded}


def run_rank_error(store: str, rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist

    _init_dist(rank, world, port)
    nm.init(persistent_storage_path=store, persistent_time_interval=0,
            num_of_version_in_retention=0, commit_timeout=5, agent=False)
    # Rank 1 makes t1's version directory by hand below: rank 0 must have read the store
    # at init before (else it counts that version as taken and names t1 after the next).
    dist.barrier()
    ck = nm.Checkpoint("t1", -2)
    ck.save(f"shard_rank{rank}", shard(rank, 1))
    if rank == 1:  # a file where this rank's directory goes: its writes of t1 will fail
        version = nm.api._session.open["t1"].version
        os.makedirs(os.path.join(store, "t1", version), exist_ok=True)
        open(os.path.join(store, "t1", version, "rank1"), "w").close()
    assert ck.commit() is True
    if rank == 1:  # wait until the failure is known here (and only here)
        # Less than the tests' JOB_TIMEOUT (300 s), so that a failure that never shows is
        # reported with what this rank saw, not as a hung job.
        deadline = time.monotonic() + 240
        while not any(v["failed"] for v in nm.api._session.engine.versions()):
            if time.monotonic() > deadline:
                files = sorted(os.path.relpath(os.path.join(d, f), store)
                               for d, _, fs in os.walk(store) for f in fs)
                raise AssertionError(f"the write of t1 did not fail on rank 1 (blocked at "
                                     f"t1/{version}/rank1): versions "
                                     f"{nm.api._session.engine.versions()}, files {files}")
            time.sleep(0.05)
    dist.barrier()
    out: dict = {"rank": rank}
    ck = nm.Checkpoint("t2", -2)
    ck.save(f"shard_rank{rank}", shard(rank, 2))
    try:
        ck.commit()
        out["raised"] = None
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out["raised"] = f"{type(e).__name__}: {e}"
    dist.barrier()  # both ranks got here: nobody is left waiting in a collective
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # t1 and t2 are not to be persisted: do not wait for them at exit


def run_streamed_async(store: str, rank: int, world: int, port: int, foresee: str,
                       engine: str) -> dict:
    """Asynchronous staging with coordinated ranks and a memory tier that rank 1's state
    outgrows. With `foresee` "yes", the ranks persist each checkpoint that rank 1's engine
    foresees will not fit; with "no", the engine is not asked (as when memory another
    engine of the node took after the commit proves its answer wrong): an object rank 1's
    staging thread streams to the store fails that checkpoint on rank 1 (the ranks had
    committed it to memory only). No step raises. `engine`: "embedded" or "agent" (both
    ranks share one node agent's memory)."""
    import torch.distributed as dist

    if foresee == "no":
        nm.api._Session.unstaged_bytes = lambda self: 0  # type: ignore[method-assign]
    _init_dist(rank, world, port)
    width = 1024 if rank == 1 else 64  # rank 1: 4 MiB of weight and 4 of momentum
    model = torch.nn.Linear(width, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        opt.zero_grad()

    nm.init(persistent_storage_path=store, async_staging=True, persistent_time_interval=3600,
            memory_buffer_size=12 << 20, num_of_version_in_retention=5,
            agent=engine == "agent",
            commit_timeout=5)  # bounds the wait for a version rank 1 lacks, were it tried
    step()
    saved = {}
    for i in range(4):
        ck = nm.Checkpoint(f"c{i}", num_files=2)
        ck.save("model", model.state_dict())
        ck.save("optimizer", opt.state_dict())
        saved[f"c{i}"] = {k: v.clone() for k, v in model.state_dict().items()}
        step()  # the barrier: never raises
    out: dict = {"rank": rank, "raised": None}
    try:
        nm.wait_staged()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out["raised"] = f"{type(e).__name__}: {e}"
    out["committed"] = sorted(e["tag"] for e in nm.list_checkpoints())
    persisting: list[str] = []  # what persisting a candidate at resume ran into
    handler = logging.Handler()
    handler.emit = lambda r: persisting.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("nebulite").addHandler(handler)
    try:
        latest = nm.get_latest_checkpoint()  # one both ranks can load
    finally:
        logging.getLogger("nebulite").removeHandler(handler)
    out["latest"] = latest.tag
    out["persisting"] = persisting
    got = latest.load("model")
    out["latest_loads"] = all(torch.equal(got[k], v) for k, v in saved[latest.tag].items())
    dist.barrier()
    nm.shutdown()
    dist.destroy_process_group()
    return out


def run_shard_save(store: str, rank: int, world: int, port: int, size_mb: int) -> dict:
    import torch.distributed as dist

    _init_dist(rank, world, port)
    nm.init(persistent_storage_path=store, persistent_time_interval=0,
            num_of_version_in_retention=2, agent=False)
    n = size_mb * (1 << 20) // 4
    for step in (1, 2):
        ck = nm.Checkpoint(f"t{step}", -2)
        ck.save(f"shard{rank}", {"w": torch.full((n,), float(rank * 10 + step)), "step": step})
        assert ck.commit() is True
    nm.flush_persistence(timeout=120)
    dist.barrier()
    nm.shutdown()
    dist.destroy_process_group()
    return {"rank": rank}


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def run_shard_resume(store: str, rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist

    _init_dist(rank, world, port)
    nm.init(agent=False)
    before = _bytes_read()
    latest = nm.get_latest_checkpoint(persist_path=store)
    got = latest.load(f"shard{rank}")
    read = _bytes_read() - before
    assert latest.tag == "t2" and got["step"] == 2 and float(got["w"][0]) == rank * 10 + 2
    version = next(e["version"] for e in nm._core.read_catalog(store)[0] if e["tag"] == "t2")
    own = sum(f[1] for f in nm._core.read_manifest(store, "t2", version, rank)["files"])
    dist.barrier()
    nm.shutdown()
    dist.destroy_process_group()
    return {"rank": rank, "read": read, "own": own}


def run_init_only(store: str, rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist

    _init_dist(rank, world, port)
    out: dict = {"rank": rank, "raised": None}
    try:
        nm.init(persistent_storage_path=store, agent=False)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out["raised"] = f"{type(e).__name__}: {e}"
    dist.barrier()  # every rank got here: nobody is left waiting in a collective
    nm.shutdown()
    dist.destroy_process_group()
    return out


def run_rank0_dies(store: str, rank: int, world: int, port: int, phase: str) -> dict:
    os.environ["NEBULITE_NODE_ID"] = f"node{rank}"  # no memory shared between the ranks
    _init_dist(rank, world, port)
    # The agents keep the commit timeout of the job that started them: rank 1's waits that
    # long after the crashed trainer left before it stops awaiting t2's commit marker.
    nm.init(persistent_storage_path=store, persistent_time_interval=3600,
            num_of_version_in_retention=5, commit_timeout=HANG_TIMEOUT)
    engine = nm.api._session.engine
    if phase == "crash":
        for step in (0, 1):  # the first commit is persisted; the next, an hour early, not
            ck = nm.Checkpoint(f"t{step}", -2)
            ck.save(f"shard_rank{rank}", shard(rank, step))
            assert ck.commit() is True
            if step == 0:
                nm.flush_persistence(timeout=HANG_TIMEOUT)
        ck = nm.Checkpoint("t2", -2)
        ck.save(f"shard_rank{rank}", shard(rank, 2))
        if rank == 0:  # killed after agreeing on the commit, before committing it here
            def die(*args: object, **kwargs: object) -> None:
                print("RESULT " + json.dumps({"rank": 0, "died": "before committing t2"}),
                      flush=True)
                os._exit(0)

            engine.commit = die
        assert ck.commit() is True
        try:  # rank 1 persists t2; rank 0 will never write its commit marker
            nm.flush_persistence(timeout=0.1)
        except nm.NebuliteError:
            pass
        wait_for_manifest(store, "t2", 1)
        print("RESULT " + json.dumps({"rank": 1, "died": "after persisting t2"}), flush=True)
        os._exit(0)  # killed as well, before anything else
    latest = nm.get_latest_checkpoint(persist_path=store)
    out: dict = {"rank": rank, "latest": latest.tag, "t2": None}
    if latest.tag:
        out["loads"] = same(latest.load(f"shard_rank{rank}"), shard(rank, 1))
    # Lightning's way to resume: the newest persisted file (t1's, persisted above)
    path = nm.get_latest_checkpoint_path(f"shard_rank{rank}", store)
    out["path_tag"] = os.path.relpath(path, store).split(os.sep)[0]
    for v in engine.versions():
        if v["tag"] == "t2":
            out["t2"] = {k: v[k] for k in ("persisted", "store_committed", "failed")}
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the agents keep t2 (rank 1's waits for its marker): not waited for here


def main() -> None:
    mode, store, rank, world, port = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    if mode == "dist":
        out = run_dist(store, rank, world, port, int(sys.argv[6]), int(sys.argv[7]))
    elif mode == "plain":
        out = run_plain(store, rank)
    elif mode == "plain_no_flush":
        out = run_plain_no_flush(store, rank)
    elif mode == "misstep":
        out = run_misstep(store, rank, world, port)
    elif mode == "rank_error":
        out = run_rank_error(store, rank, world, port)
    elif mode == "streamed_async":
        out = run_streamed_async(store, rank, world, port, sys.argv[6], sys.argv[7])
    elif mode == "shard_save":
        out = run_shard_save(store, rank, world, port, int(sys.argv[6]))
    elif mode == "shard_resume":
        out = run_shard_resume(store, rank, world, port)
    elif mode == "init_only":
        out = run_init_only(store, rank, world, port)
    elif mode == "rank0_dies":
        out = run_rank0_dies(store, rank, world, port, sys.argv[6])
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

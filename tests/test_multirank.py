"""Several ranks saving into one store: per-rank files, manifests, the commit marker,
cross-rank loading, retention, and a rank that dies before it commits.

Every rank runs in its own process (tests/workers/dist_worker.py) with the parent's
environment, so the children import the same nebulite as the test.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import tempfile
import sys

import pytest
import torch

import nebulite
import nebulite.api
from nebulite import _core

WORKER = os.path.join(os.path.dirname(__file__), "workers", "dist_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
import dist_worker  # noqa: E402  (expected values shared with the workers)
from conftest import HANG_TIMEOUT, remove_runtime_dir, wait_ranks  # noqa: E402


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(nebulite.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in [env.get("PYTHONPATH")] if p])
    env["NEBULA_MEMORY_BUFFER_SIZE"] = str(32 * 1024 * 1024)  # per process; keep it small
    env["OMP_NUM_THREADS"] = "1"
    env.pop("NEBULITE_RUN_ID", None)
    env.update(extra)
    return env


def _run_ranks(mode: str, store: str, world: int, *args: object, env: dict[str, str] | None = None) -> list[dict]:
    """Starts `world` worker processes, waits for all; returns each rank's RESULT dict."""
    port = _free_port()
    env = env or _child_env()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, mode, store, str(r), str(world), str(port), *map(str, args)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(world)
    ]
    outs = wait_ranks(procs)
    failed = [
        f"rank {r} exited {p.returncode}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
        for r, (p, (out, err)) in enumerate(zip(procs, outs)) if p.returncode != 0
    ]
    assert not failed, "\n\n".join(failed)
    results = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        assert lines, f"rank {r} printed no result\nstdout:\n{out}\nstderr:\n{err[-4000:]}"
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def _same(a, b) -> bool:
    return dist_worker.same(a, b)


def _assert_version_complete(store: str, tag: str, version: str, world: int) -> None:
    vdir = os.path.join(store, tag, version)
    assert os.path.isfile(os.path.join(vdir, "COMMITTED")), f"{tag}/{version} has no commit marker"
    for r in range(world):
        assert os.path.isfile(os.path.join(vdir, f"rank{r}.manifest")), f"{tag}/{version}: rank{r}.manifest missing"
        m = _core.read_manifest(store, tag, version, r)
        assert m["rank"] == r and m["world_size"] == world and m["tag"] == tag
        names = [f[0] for f in m["files"]]
        expected = [f"shard_rank{r}"] + (["model"] if r == 0 and "model" in names else [])
        assert sorted(names) == sorted(expected), (r, names)
        for name, size, crc in m["files"]:
            rel = _core.data_file_path(tag, version, r, name)
            assert os.path.isfile(os.path.join(store, rel))
            _core.verify_data_file(store, rel, name, size, crc)


def _assert_loadable(store: str, tag: str, world: int, step: int) -> None:
    ck = nebulite.get_checkpoint(tag=tag, persist_path=store)
    assert ck.tag == tag
    for r in range(world):
        assert _same(ck.load(f"shard_rank{r}"), dist_worker.shard(r, step)), (tag, r)
    assert _same(ck.load("model"), dist_worker.model(step)), tag


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def dist_run(request, tmp_path_factory):
    """`world` torch.distributed (gloo) ranks; each saves its shard (rank 0 also "model")
    for tags t1..t3, commits, loads, flushes and loads again (retention: keep all)."""
    world = request.param
    store = str(tmp_path_factory.mktemp(f"dist{world}") / "ckpt")
    return store, world, _run_ranks("dist", store, world, 3, 0)


def test_ranks_save_commit_and_load_each_others_objects(dist_run):
    store, world, results = dist_run
    assert [r["rank"] for r in results] == list(range(world))
    for r in results:
        assert r["loaded"] == ["t1", "t2", "t3"]  # the workers' own cross-rank loads passed

    nebulite.api._reset_for_tests()
    listed = nebulite.list_checkpoints(store)
    assert [e["tag"] for e in listed] == ["t3", "t2", "t1"]  # newest commit first
    assert all(e["tier"] == "persistent" and e["persisted"] for e in listed)
    assert len({e["version"] for e in listed}) == 3
    seqs = [e["seq"] for e in listed]
    assert seqs == sorted(seqs, reverse=True) and len(set(seqs)) == 3
    for e in listed:
        assert sorted(e["names"]) == sorted(["model"] + [f"shard_rank{r}" for r in range(world)])
        _assert_version_complete(store, e["tag"], e["version"], world)
    for step, tag in enumerate(["t1", "t2", "t3"], start=1):
        _assert_loadable(store, tag, world, step)

    latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert latest.tag == "t3"
    for r in range(world):
        assert _same(latest.load(f"shard_rank{r}", map_location="cpu"), dist_worker.shard(r, 3))
    # get_latest_checkpoint_path gives a real file of the newest committed version.
    path = nebulite.get_latest_checkpoint_path("model", persist_path=store)
    assert path.startswith(os.path.join(os.path.abspath(store), "t3") + os.sep) and os.path.isfile(path)


def test_ranks_agree_on_a_latest_they_can_all_load_straight_after_commit(dist_run):
    """Embedded engines keep each rank's memory to itself: right after commit() the ranks
    agree on the newest checkpoint every rank can load (this one once it is committed in
    the store, else the previous one), and loading it never fails."""
    store, world, results = dist_run
    tags = [r["model_before_flush"] for r in results]
    assert all(t == tags[0] for t in tags), tags  # the same answer on every rank
    for r in results:
        assert all(e in ("ok", "older") for e in r["model_before_flush"]), r


def test_with_the_agent_every_rank_loads_rank0_model_straight_after_commit(tmp_path):
    """With the node agent, tier 1 is shared by the node's ranks: no flush needed."""
    store = str(tmp_path / "ckpt")
    runtime = tempfile.mkdtemp(prefix="nbrt-")  # short: Unix socket paths are limited
    env = _child_env(NEBULITE_AGENT="1", NEBULITE_RUNTIME_DIR=runtime, NEBULITE_AGENT_IDLE_EXIT="1")
    try:
        results = _run_ranks("dist", store, 2, 3, 0, env=env)
    finally:
        remove_runtime_dir(runtime)
    for r in results:
        assert r["model_before_flush"] == ["ok"] * 3, (r["rank"], r["model_before_flush"])
        assert r["loaded"] == ["t1", "t2", "t3"]
    nebulite.api._reset_for_tests()
    _assert_loadable(store, "t3", 2, 3)


def _assert_two_nodes(results: list[dict], store: str) -> None:
    """Ranks 0-1 on one node, 2-3 on another, each node with its agent, tags t1 and t2."""
    pids = [r["agent_pid"] for r in results]
    assert pids[0] == pids[1] and pids[2] == pids[3] and pids[0] != pids[2]
    for r in results:
        assert r["loaded"] == ["t1", "t2"]
        # The nodes do not share memory: the ranks agree on what all of them can load.
        assert r["model_before_flush"] == results[0]["model_before_flush"]
        assert all(e in ("ok", "older") for e in r["model_before_flush"]), r
    nebulite.api._reset_for_tests()
    _assert_loadable(store, "t2", 4, 2)


def test_two_simulated_nodes_each_with_its_agent(tmp_path):
    """4 ranks on 2 simulated nodes: each node's ranks share their node's agent; objects
    held only in the other node's memory are read from the store once persisted."""
    store = str(tmp_path / "ckpt")
    runtime = tempfile.mkdtemp(prefix="nbrt-")
    env = _child_env(NEBULITE_AGENT="1", NEBULITE_RUNTIME_DIR=runtime, NEBULITE_AGENT_IDLE_EXIT="1",
                     NEBULITE_TEST_RANKS_PER_NODE="2")
    try:
        results = _run_ranks("dist", store, 4, 2, 0, env=env)
    finally:
        remove_runtime_dir(runtime)
    _assert_two_nodes(results, store)


def test_two_nodes_launched_by_torchrun(tmp_path):
    """`torchrun --nnodes 2` on 127.0.0.1, 2 ranks per node, one agent per node identity."""
    store, out = str(tmp_path / "ckpt"), tmp_path / "out"
    out.mkdir()
    runtime = tempfile.mkdtemp(prefix="nbrt-")
    master, pg = _free_port(), _free_port()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    entry = os.path.join(os.path.dirname(__file__), "workers", "torchrun_entry.py")
    procs = []
    try:
        for node in (0, 1):
            env = _child_env(NEBULITE_AGENT="1", NEBULITE_RUNTIME_DIR=runtime,
                             NEBULITE_AGENT_IDLE_EXIT="1", NEBULITE_NODE_ID=f"node{node}",
                             TEST_PG_PORT=str(pg), TMPDIR=str(tmp_path))  # torchrun's logs
            procs.append(subprocess.Popen(
                [torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                 "--master-addr", "127.0.0.1", "--master-port", str(master), entry, store, str(out)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [log for log, _ in wait_ranks(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        remove_runtime_dir(runtime)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    _assert_two_nodes([json.loads((out / f"rank{r}.json").read_text()) for r in range(4)], store)


def test_retention_across_two_ranks(store):
    results = _run_ranks("dist", store, 2, 4, 2)
    assert all(r["loaded"] == ["t1", "t2", "t3", "t4"] for r in results)

    nebulite.api._reset_for_tests()
    listed = nebulite.list_checkpoints(store)
    assert [e["tag"] for e in listed] == ["t4", "t3"]
    for e in listed:
        _assert_version_complete(store, e["tag"], e["version"], 2)
    _assert_loadable(store, "t3", 2, 3)
    _assert_loadable(store, "t4", 2, 4)
    # The retired tags have no commit marker left (it is deleted first) and are not loadable.
    for tag in ("t1", "t2"):
        tdir = os.path.join(store, tag)
        if os.path.isdir(tdir):
            for version in os.listdir(tdir):
                assert not os.path.exists(os.path.join(tdir, version, "COMMITTED")), (tag, version)
        assert nebulite.get_checkpoint(tag=tag, persist_path=store).tag == ""


@pytest.fixture(scope="module")
def rank_dies_run(tmp_path_factory):
    """Two plain processes (explicit rank/world_size, no torch.distributed): both commit
    and flush t1 and t2; rank 1 saves t3 and exits without committing it; rank 0 commits
    t3 and flushes, which fails once its commit timeout (2 s) is over."""
    store = str(tmp_path_factory.mktemp("rank_dies") / "ckpt")
    env = _child_env(NEBULITE_RUN_ID="rankdies01")
    results = _run_ranks("plain", store, 2, env=env)
    return store, results


def test_tag_not_committed_when_a_rank_never_commits(rank_dies_run):
    store, (r0, r1) = rank_dies_run
    # Rank 0's flush does not hang: the coordinator gives up after commit_timeout and the
    # failure surfaces from flush_persistence.
    assert r0["flush_error"] is not None, "flush_persistence returned although t3 cannot be committed"
    assert "PersistError" in r0["flush_error"] and "t3" in r0["flush_error"], r0["flush_error"]
    # Given up after its commit_timeout, not after the default one (600 s); generous bounds,
    # for a busy machine: they tell a hang from a wait, not fast from slow.
    assert r0["flush_seconds"] < 300
    assert r0["shutdown_seconds"] < 300

    nebulite.api._reset_for_tests()
    tags = [e["tag"] for e in nebulite.list_checkpoints(store)]
    assert tags == ["t2", "t1"]
    t3 = os.path.join(store, "t3")
    if os.path.isdir(t3):
        for version in os.listdir(t3):
            assert not os.path.exists(os.path.join(t3, version, "COMMITTED"))
    latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert latest.tag == "t2"
    for r in range(2):
        assert _same(latest.load(f"shard_rank{r}"), dist_worker.shard(r, 2))
    assert nebulite.get_checkpoint(tag="t3", persist_path=store).tag == ""
    t1 = nebulite.get_checkpoint(tag="t1", persist_path=store)
    for r in range(2):
        assert _same(t1.load(f"shard_rank{r}"), dist_worker.shard(r, 1))


def test_failed_commit_is_not_reported_as_latest(rank_dies_run):
    store, (r0, r1) = rank_dies_run
    assert r0["flush_error"] is not None
    assert r0["latest_here"] == "t2", (r0["latest_here"], r0["load_rank1_from_latest"])


def test_a_restart_on_nodes_apart_resumes_without_waiting_for_what_rank_0_never_committed(
        tmp_path):
    """Two ranks, each on a node of its own (one agent each): rank 0 died between agreeing
    on t2 and committing it, rank 1 committed and persisted t2, and both trainers died. The
    restarted ranks agree on t1, held in memory only, and persist it to share it; rank 1's
    agent still awaits t2's commit marker (for the commit timeout after its trainer left).
    Resuming waits for t1 alone: t2 is still awaited when the ranks have loaded t1 and
    found its file (get_latest_checkpoint_path waits for this trainer's checkpoints only)."""
    store = str(tmp_path / "ckpt")
    runtime = tempfile.mkdtemp(prefix="nbrt-")
    env = _child_env(NEBULITE_AGENT="1", NEBULITE_RUNTIME_DIR=runtime,
                     NEBULITE_AGENT_IDLE_EXIT=str(dist_worker.HANG_TIMEOUT))
    try:
        died = _run_ranks("rank0_dies", store, 2, "crash", env=env)
        assert [r["died"] for r in died] == ["before committing t2", "after persisting t2"]
        resumed = _run_ranks("rank0_dies", store, 2, "resume", env=env)
    finally:
        remove_runtime_dir(runtime)
    for r in resumed:
        assert r["latest"] == "t1" and r["loads"] and r["path_tag"] == "t1", r
    assert resumed[0]["t2"] is None  # never committed on rank 0
    assert resumed[1]["t2"] == {"persisted": True, "store_committed": False, "failed": False}
    t2 = os.path.join(store, "t2")
    assert not any(os.path.exists(os.path.join(t2, v, "COMMITTED")) for v in os.listdir(t2))
    t1 = os.path.join(store, "t1")  # persisted at the restart, to be shared
    assert any(os.path.exists(os.path.join(t1, v, "COMMITTED")) for v in os.listdir(t1))


def test_explicit_ranks_persist_every_commit_with_interval_zero(store):
    env = _child_env(NEBULITE_RUN_ID="noflush0001")
    r0, r1 = _run_ranks("plain_no_flush", store, 2, env=env)
    assert r0["flush_error"] is None, r0["flush_error"]
    assert r0["committed"] == ["t1"] and r1["committed"] == ["t1"]


def test_a_save_that_failed_on_one_rank_does_not_put_the_ranks_out_of_step(store):
    """Rank 0 names every version: a save() that raised on one rank only (and was caught)
    does not make the ranks' version names differ for the rest of the run."""
    results = _run_ranks("misstep", store, 2)
    assert all(r["loaded"] == ["t1", "t2", "t3"] for r in results)
    nebulite.api._reset_for_tests()
    for step, tag in enumerate(["t1", "t2", "t3"], start=1):
        ck = nebulite.get_checkpoint(tag=tag, persist_path=store)
        for r in range(2):
            assert _same(ck.load(f"shard_rank{r}"), dist_worker.shard(r, step))


def test_a_background_error_on_one_rank_is_raised_by_every_rank(store):
    """The commit collective carries every rank's error state: all ranks raise together,
    none is left waiting in a collective."""
    results = _run_ranks("rank_error", store, 2)
    for r in results:
        assert r["raised"] and r["raised"].startswith("PersistError"), r
        assert "rank 1" in r["raised"], r
    assert results[0]["raised"] == results[1]["raised"]


def test_checkpoints_that_will_not_fit_in_memory_are_persisted_by_every_rank(store):
    """Coordinated ranks with asynchronous staging and a long persistent_time_interval
    agree at the commit whether a checkpoint stays in memory only, before the staging
    thread of a rank has staged its objects: a checkpoint that rank 1's memory tier cannot
    hold beside the newest one (which stays while it is in memory only) is persisted by
    every rank, and none fails."""
    results = _run_ranks("streamed_async", store, 2, "yes", "embedded")
    for r in results:
        assert r["raised"] is None, r
        assert r["latest"] == "c3" and r["latest_loads"], r
    # c0 is persisted as the first checkpoint is; c1 fits beside c0 (being persisted, its
    # memory comes back); c2 does not fit beside c1, which is in memory only.
    stored = _stored_tags(store)
    assert {"c0", "c2"} <= stored and "c1" not in stored, stored


def _stored_tags(store: str) -> set[str]:
    """The tags with a version committed in `store`."""
    return {path.split(os.sep)[-3]
            for path in glob.glob(os.path.join(store, "*", "*", "COMMITTED"))}


def test_an_object_streamed_after_save_fails_its_checkpoint_on_that_rank_only(store):
    """Coordinated ranks with asynchronous staging commit a checkpoint to memory only, as
    the engine foresaw; when an object that rank 1's staging thread then stages proves it
    wrong (the memory tier was full: here the engine was not asked) and streams to the store,
    it fails that checkpoint on rank 1, reported by its next call, never inside a step, and
    the ranks still agree on a latest checkpoint both hold, without trying to persist (and
    waiting in the store for) one that rank 1 lacks."""
    results = _run_ranks("streamed_async", store, 2, "no", "embedded")
    for r in results:
        assert not any("could not be persisted" in m for m in r["persisting"]), r
    assert results[0]["raised"] is None, results
    assert results[1]["raised"].startswith("PersistError"), results
    assert "did not fit in the memory tier" in results[1]["raised"], results
    assert len(results[1]["committed"]) < len(results[0]["committed"]), results
    assert results[0]["latest"] == results[1]["latest"] != "", results
    assert all(r["latest_loads"] for r in results), results


def test_each_rank_reads_only_its_own_share_at_resume(store):
    """Resuming with several ranks, each rank checks (and loads) its own files only: the
    bytes it reads stay close to its own share, whatever the number of ranks and versions."""
    _run_ranks("shard_save", store, 2, 8)
    results = _run_ranks("shard_resume", store, 2)
    for r in results:
        assert r["own"] > 8 << 20
        assert r["read"] < 1.2 * r["own"], r


def test_every_rank_of_a_second_job_is_refused_together(store):
    """The ranks of a job share rank 0's decision about the store's writer lease: all raise
    StoreInUseError naming the job that writes the store, none waits in a collective; the
    ranks of the job holding it never refuse each other."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, nebulite; nebulite.init(persistent_storage_path="
         "sys.argv[1], agent=False); print(nebulite.session_info()['run_id'], flush=True); "
         "sys.stdin.readline()", store],
        env=_child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        run_id = holder.stdout.readline().strip()
        assert run_id
        results = _run_ranks("init_only", store, 2)
    finally:
        holder.communicate("\n", timeout=HANG_TIMEOUT)
    for r in results:
        assert r["raised"] and r["raised"].startswith("StoreInUseError"), r
        assert f"run {run_id}" in r["raised"], r
    assert [r["raised"] for r in _run_ranks("init_only", store, 2)] == [None, None]


"""DeepSpeed with a "nebula" block in its config: DeepSpeed's own NebulaCheckpointEngine
imports ``torch_nebula`` (nebulite) and drives it; nothing in the training script changes.

DeepSpeed silently falls back to torch.save when ``import torch_nebula`` fails, so every test
checks that nebulite did the work: the engine class, nebulite's commit markers, manifests and
history in the persistent path, and DeepSpeed's own files in save_dir being empty placeholders
(``torch.save("", path)``), so that whatever a resumed engine loaded came from nebulite.

The training runs are real DeepSpeed engines on the CPU (gloo), one process per rank
(tests/workers/deepspeed_worker.py), for ZeRO stages 0, 1, 2 and 3 with 1 and 2 ranks, and
with 2 ranks again with nebulite's asynchronous staging (NEBULITE_ASYNC_STAGING=1).
"""

from __future__ import annotations

import csv
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import nebulite
import nebulite.api

from conftest import HANG_TIMEOUT, JOB_TIMEOUT, remove_runtime_dir, wait_ranks

pytest.importorskip("deepspeed.runtime.checkpoint_engine.nebula_checkpoint_engine",
                    reason="needs DeepSpeed with its Nebula engine (0.18.4 to 0.19.6)")
from deepspeed.nebula.config import DeepSpeedNebulaConfig  # noqa: E402
from deepspeed.runtime.checkpoint_engine import checkpoint_engine  # noqa: E402
from deepspeed.runtime.checkpoint_engine.nebula_checkpoint_engine import NebulaCheckpointEngine  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "workers", "deepspeed_worker.py")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "deepspeed.md"
TIMEOUT = HANG_TIMEOUT
STAGES = (0, 1, 2, 3)
MODEL = "mp_rank_00_model_states.pt"


def _zero_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _model_file(stage: int, rank: int) -> str:
    """The model states file that DeepSpeed loads on `rank`: rank 0's, or with ZeRO 3
    (parameters partitioned) each rank's own."""
    return f"zero_pp_rank_{rank}_{MODEL}" if stage == 3 else MODEL


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(nebulite.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(NEBULITE_AGENT="0", NEBULA_MEMORY_BUFFER_SIZE=str(32 * 1024 * 1024), OMP_NUM_THREADS="1",
               DS_ACCELERATOR="cpu")
    for key in ("NEBULITE_RUN_ID", "NEBULA_PERSISTENT_STORAGE_PATH", "NEBULA_PERSISTENT_TIME_INTERVAL"):
        env.pop(key, None)
    env.update(extra)
    return env


def _run(*groups: tuple[str, Path, int, dict[str, str]]) -> list[list[dict[str, Any]]]:
    """Runs each group (modes, workdir, world size, env) as that many ranks, all groups at
    once; returns each group's per-rank RESULT dicts."""
    started = []
    for modes, workdir, world, env in groups:
        port = _free_port()
        started.append([
            subprocess.Popen([sys.executable, WORKER, modes, str(workdir), str(r), str(world), str(port)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world)
        ])
    flat = wait_ranks([p for procs in started for p in procs], JOB_TIMEOUT)
    outs: list[list[tuple[str, str]]] = []
    for procs in started:
        outs.append(flat[:len(procs)])
        flat = flat[len(procs):]
    failed = [
        f"{groups[g][0]} rank {r} exited {p.returncode}\nstdout:\n{out[-2000:]}\nstderr:\n{err[-4000:]}"
        for g, procs in enumerate(started) for r, (p, (out, err)) in enumerate(zip(procs, outs[g]))
        if p.returncode != 0
    ]
    assert not failed, "\n\n".join(failed)
    results = []
    for g, procs in enumerate(started):
        ranks = []
        for r, (out, err) in enumerate(outs[g]):
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert lines, f"{groups[g][0]} rank {r} printed no result\n{err[-4000:]}"
            ranks.append(json.loads(lines[-1][len("RESULT "):]))
        results.append(ranks)
    return results


def _catalog(store: Path) -> list[dict[str, Any]]:
    entries, problems = nebulite._core.read_catalog(str(store))
    assert not problems, problems
    return entries


def _history(store: Path) -> list[dict[str, str]]:
    with open(store / "checkpointHistories.csv", newline="") as f:
        return list(csv.DictReader(f))


def _store_snapshot(store: Path) -> dict[str, Any]:
    """What nebulite holds in `store`: committed tags with each rank's object names."""
    out = {}
    for e in _catalog(store):
        vdir = store / e["tag"] / e["version"]
        assert (vdir / "COMMITTED").is_file()
        names = {}
        for r in range(int(e["world_size"])):
            manifest = nebulite._core.read_manifest(str(store), e["tag"], e["version"], r)
            names[r] = sorted(f[0] for f in manifest["files"])
            assert (vdir / f"rank{r}.manifest").is_file()
        out[e["tag"]] = {"version": e["version"], "world_size": int(e["world_size"]), "names": names}
    return out


def _ds_files(save_dir: Path) -> dict[str, Any]:
    """DeepSpeed's files in save_dir (the top level and each tag's directory): each with what
    it holds (`latest`: the tag; checkpoint files: what torch.load reads from them)."""
    out: dict[str, Any] = {}
    for p in sorted([*save_dir.glob("*"), *save_dir.glob("*/*")]):
        if not p.is_file():
            continue
        name = str(p.relative_to(save_dir))
        if name == "latest":
            out[name] = p.read_text()
        elif name.endswith(".pt"):
            out[name] = torch.load(p, weights_only=False)  # DeepSpeed's state, or its placeholder
        else:
            out[name] = None
    return out


def _expected_names(stage: int, world: int) -> dict[int, list[str]]:
    """The objects each rank saves: rank 0 the model states (with ZeRO 3 every rank its own),
    every rank its ZeRO partition."""
    return {r: sorted(([_model_file(stage, r)] if r == 0 or stage == 3 else []) + ([_zero_file(r)] if stage else []))
            for r in range(world)}


def _export_with_the_docs_recipe(store: Path, workdir: Path, env: dict[str, str]) -> None:
    """Runs docs/deepspeed.md's recipe in `workdir`, with ckpt/run1 being `store`: it writes
    workdir/ds_checkpoints, a plain DeepSpeed save_dir (the resume worker loads it)."""
    (block,) = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    (workdir / "ckpt").mkdir(parents=True)
    (workdir / "ckpt" / "run1").symlink_to(store)
    result = subprocess.run([sys.executable, "-c", block], cwd=workdir, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr


# -- the runs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Trains and saves (1 and 2 ranks, ZeRO 0/1/2/3), records what is on disk, then resumes
    in new processes. Keys: work[world], saved[world] and resumed[world] (each rank's
    results), stores_after_save, history and ds_files [world][stage], and azure_save,
    azure_store_after_save, azure_resume."""
    work = {w: tmp_path_factory.mktemp(f"ds{w}") for w in (1, 2)}
    env = _child_env()
    # The same two-rank run with nebulite's asynchronous staging turned on the way a
    # DeepSpeed user turns it on (DeepSpeed calls init() itself): by the environment.
    work_async = tmp_path_factory.mktemp("ds2async")
    async_env = _child_env(NEBULITE_ASYNC_STAGING="1")
    # Azure's pattern runs as users run it: with the node agent, init()'s default. The agent
    # outlives the first process, so the second one finds the checkpoints kept in memory.
    # Between the two, this fixture does other work for as long as the machine's load makes
    # it take: the agent must not leave when idle before the resume (it is killed below).
    runtime = tempfile.mkdtemp(prefix="nbrt-")  # short: Unix socket paths are limited
    agent_env = _child_env(NEBULITE_AGENT="1", NEBULITE_RUNTIME_DIR=runtime, NEBULITE_AGENT_IDLE_EXIT="86400")
    try:
        saved = _run(("save", work[1], 1, env), ("save", work[2], 2, env),
                     ("azure_save", work[1], 1, agent_env), ("save", work_async, 2, async_env))
        azure_store = work[1] / "azure" / "checkpoints"
        run: dict[str, Any] = {"work": work, "saved": dict(zip((1, 2), saved)),
                               "azure_save": saved[2][0]["azure_save"],
                               "azure_store_after_save": _store_snapshot(azure_store),
                               "stores_after_save": {}, "ds_files": {}, "history": {},
                               "async_saved": saved[3]}
        run["async_stores_after_save"] = {s: _store_snapshot(work_async / f"z{s}" / "nebula") for s in STAGES}
        _export_with_the_docs_recipe(work_async / "z1" / "nebula", work_async / "export", env)
        for w in (1, 2):
            run["stores_after_save"][w] = {s: _store_snapshot(work[w] / f"z{s}" / "nebula") for s in STAGES}
            run["history"][w] = {s: _history(work[w] / f"z{s}" / "nebula") for s in STAGES}
            run["ds_files"][w] = {s: _ds_files(work[w] / f"z{s}" / "ds") for s in STAGES}
            _export_with_the_docs_recipe(work[w] / "z1" / "nebula", work[w] / "export", env)
        resumed = _run(("resume", work[1], 1, env), ("resume", work[2], 2, env),
                       ("azure_resume", work[1], 1, agent_env), ("resume", work_async, 2, async_env))
    finally:
        remove_runtime_dir(runtime)
    run["resumed"] = dict(zip((1, 2), resumed))
    run["azure_resume"] = resumed[2][0]["azure_resume"]
    run["async_resumed"] = resumed[3]
    return run


def _ranks(run: dict[str, Any], phase: str) -> list[tuple[int, dict[str, Any]]]:
    return [(w, r) for w in (1, 2) for r in run[phase][w]]


# -- saving --------------------------------------------------------------------------------


def test_deepspeed_uses_its_nebula_engine_backed_by_nebulite(runs):
    for world, r in _ranks(runs, "saved"):
        assert r["save"]["torch_nebula_is_nebulite"], (world, r["rank"])
        for stage in STAGES:
            assert r["save"][f"z{stage}"]["engine"] == "NebulaCheckpointEngine", (world, r["rank"], stage)
        assert r["save"]["plain_engine"] == "TorchCheckpointEngine"  # the run without the block


def test_every_save_checkpoint_is_committed_in_nebulite(runs):
    for world in (1, 2):
        for stage in STAGES:
            held = runs["stores_after_save"][world][stage]
            # Three saves, two versions retained: global_step2 was retired.
            assert sorted(held) == ["global_step4", "global_step6"], (world, stage, held)
            for tag, entry in held.items():
                assert entry["world_size"] == world
                assert entry["names"] == _expected_names(stage, world), (world, stage, tag, entry)
            rows = runs["history"][world][stage]
            committed = [row["tag"] for row in rows if row["outcome"] == "committed"]
            assert committed == ["global_step2", "global_step4", "global_step6"], (world, stage, rows)
            assert any(row["tag"] == "global_step2" and row["outcome"] == "deleted_by_retention" for row in rows)
            persisted = {(row["tag"], row["name"], row["rank"]) for row in rows if row["outcome"] == "persisted"}
            for r, names in _expected_names(stage, world).items():
                assert all(("global_step6", n, str(r)) in persisted for n in names), (world, stage, persisted)


def test_nebulite_files_are_deepspeed_state_that_torch_load_reads(runs):
    """Each object is a torch.save archive holding the state DeepSpeed handed over."""
    for world in (1, 2):
        base = runs["work"][world] / "z1"
        entry = runs["stores_after_save"][world][1]["global_step6"]
        path = base / "nebula" / "global_step6" / entry["version"] / "rank0" / MODEL
        state = torch.load(path, map_location="cpu", weights_only=False)  # DeepSpeed's own classes
        expected = torch.load(base / "expected" / "global_step6.rank0.pt", weights_only=False)
        assert state["global_steps"] == 6
        assert state["module"].keys() == expected["module"].keys()
        assert all(torch.equal(state["module"][k], expected["module"][k]) for k in state["module"])
        assert state["args"] == expected["client"]["args"]


def test_deepspeed_finds_its_files_in_save_dir(runs):
    """save_dir holds what DeepSpeed's loader globs for: `latest` and one file per object:
    DeepSpeed's empty placeholder (torch.save("")) until the checkpoint is committed in the
    store, then the committed file (the retained tags, at the latest when the process ends)."""
    for world in (1, 2):
        for stage in STAGES:
            files = runs["ds_files"][world][stage]
            expected = {"latest"} | ({"zero_to_fp32.py"} if stage else set())
            for tag in ("global_step2", "global_step4", "global_step6"):
                expected |= {f"{tag}/{n}" for names in _expected_names(stage, world).values() for n in names}
            assert set(files) == expected, (world, stage, sorted(files))
            assert files["latest"] == "global_step6"
            for n in (n for n in files if n.endswith(".pt")):
                held = files[n]
                if n.startswith("global_step2/"):  # retention may remove it before it is seen
                    assert held == "" or isinstance(held, dict), (world, stage, n)
                else:
                    assert isinstance(held, dict), (world, stage, n)
                    if n.endswith(MODEL):
                        assert held["global_steps"] == int(n.split("/")[0][len("global_step"):])
            for r in runs["saved"][world]:
                assert set(r["save"][f"z{stage}"]["placeholders"].values()) == {""}


# -- resuming ------------------------------------------------------------------------------


def test_resume_from_latest_is_bit_identical(runs):
    """Model, optimizer (ZeRO partitions included), scheduler, step and client state."""
    for world, r in _ranks(runs, "resumed"):
        rank = r["rank"]
        for stage in STAGES:
            got = r["resume"][f"z{stage}"]
            assert got["differs_before_load"], (world, stage)
            assert got["latest"] == [f"global_step6/{_model_file(stage, rank)}", "ok"], (world, rank, stage, got)


def test_zero_to_fp32_reads_a_checkpoint_nebulite_saved(runs):
    """DeepSpeed's zero_to_fp32 (get_fp32_state_dict_from_zero_checkpoint(save_dir, tag)) on
    a ZeRO 3 checkpoint, after flush_persistence: the fp32 weights equal, bit for bit, the
    partitions the ranks held when they saved."""
    for world in (1, 2):
        got = [r["save"]["z3"]["zero_to_fp32"] for r in runs["saved"][world]]
        assert got == ["ok"] + ["rank 0 reads"] * (world - 1), (world, got)


def test_resume_from_an_explicit_tag_is_bit_identical(runs):
    for world, r in _ranks(runs, "resumed"):
        rank = r["rank"]
        for stage in STAGES:
            got = r["resume"][f"z{stage}"]
            assert got["explicit"] == [f"global_step4/{_model_file(stage, rank)}", "ok"], (world, rank, stage, got)


def test_with_async_staging_checkpoints_hold_the_state_at_save_time(runs):
    """With NEBULITE_ASYNC_STAGING=1, DeepSpeed trains on right after save_checkpoint()
    returns while nebulite copies the optimizer's storages; each ZeRO stage's checkpoints
    are committed on both ranks and load bit-identical to the state at save time."""
    for r in runs["async_saved"]:
        for stage in STAGES:
            got = r["save"][f"z{stage}"]
            assert got["async_staging"] is True, (r["rank"], stage)
            assert got["safe_storages"] > 0, (r["rank"], stage)  # the optimizer's, deferred
            # Recorded on the caller's thread, the rest staged after save() returned: each
            # object, LossScaler, fragment_address, ZeroStageEnum and the client's
            # Namespace and HTTPStatus included. ZeRO-3's optimizer state holds a tensor with
            # an attribute of its own (ds_id): it is staged on the caller's thread.
            if stage < 3:
                assert all(got["scanned"]), (r["rank"], stage, got["scanned"])
            else:
                assert got["scanned"].count(True) >= 3, (r["rank"], stage, got["scanned"])
    for stage in STAGES:
        held = runs["async_stores_after_save"][stage]
        assert sorted(held) == ["global_step4", "global_step6"], (stage, held)
        for tag, entry in held.items():
            assert entry["names"] == _expected_names(stage, 2), (stage, tag, entry)
    for r in runs["async_resumed"]:
        rank = r["rank"]
        for stage in STAGES:
            got = r["resume"][f"z{stage}"]
            assert got["latest"] == [f"global_step6/{_model_file(stage, rank)}", "ok"], (rank, stage, got)
            assert got["explicit"] == [f"global_step4/{_model_file(stage, rank)}", "ok"], (rank, stage, got)


def test_with_async_staging_a_tight_memory_tier_fails_no_checkpoint(tmp_path: Path) -> None:
    """Two ranks, ZeRO-1, asynchronous staging, persistent_time_interval 100 and a memory
    tier that holds one of rank 0's checkpoints but not two: no save_checkpoint() raises and
    the last checkpoint is the latest on both ranks. (Before, the checkpoints that rank 0's
    memory could not hold beside the newest failed there: its staging thread streamed them
    to the store after the ranks had agreed to keep them in memory only.)"""
    env = _child_env(NEBULITE_ASYNC_STAGING="1", NEBULA_MEMORY_BUFFER_SIZE=str(16 << 20))
    (results,) = _run(("tight_memory", tmp_path, 2, env))
    for r in results:
        assert r["tight_memory"]["raised"] == [], r
        assert r["tight_memory"]["latest"] == "global_step7", r


def test_a_tag_retention_removed_loads_the_latest(runs):
    """DeepSpeed's engine asks nebulite for the tag, gets '' and falls back to the latest."""
    for world, r in _ranks(runs, "resumed"):
        rank = r["rank"]
        for stage in STAGES:
            got = r["resume"][f"z{stage}"]
            assert got["retired_tag_in_nebulite"] == ""
            assert got["retired"] == [f"global_step2/{_model_file(stage, rank)}", "ok"], (world, rank, stage, got)


def test_saving_goes_on_after_resume_and_nebula_load_path_reads_another_store(runs):
    """ZeRO 2 resumed from nebula_load_path (the first run's store) and persists to its own."""
    for world in (1, 2):
        base = runs["work"][world]
        assert sorted(_store_snapshot(base / "z0" / "nebula")) == ["global_step6", "global_step8"]
        assert sorted(_store_snapshot(base / "z1" / "nebula")) == ["global_step6", "global_step8"]
        assert sorted(_store_snapshot(base / "z3" / "nebula")) == ["global_step6", "global_step8"]
        assert sorted(_store_snapshot(base / "z2" / "nebula")) == ["global_step4", "global_step6"]
        new = _store_snapshot(base / "z2" / "nebula_b")
        assert sorted(new) == ["global_step8"]
        assert new["global_step8"]["names"] == _expected_names(2, world)


def test_enable_nebula_load_false_reads_torch_files_first(runs):
    """The first load reads DeepSpeed's own files with torch.load (a checkpoint written
    without Nebula); a later tag loads from nebulite."""
    for world, r in _ranks(runs, "resumed"):
        got = r["resume"]["nebula_load_off"]
        assert got["engine"] == "NebulaCheckpointEngine"
        assert got["torch_load"] == [f"global_step2/{MODEL}", "ok"], (world, got)
        assert got["fresh_torch_load"] == "ok", (world, got)
        assert got["then_nebulite"] == [f"global_step4/{MODEL}", "ok"], (world, got)
    for world in (1, 2):
        held = _store_snapshot(runs["work"][world] / "plain" / "nebula")
        assert sorted(held) == ["global_step4"]
        assert held["global_step4"]["names"] == _expected_names(1, world)


def test_the_docs_recipe_turns_a_checkpoint_into_a_plain_deepspeed_save_dir(runs):
    """Copied out of nebulite's store, DeepSpeed without the nebula block loads it."""
    for world, r in _ranks(runs, "resumed"):
        assert r["resume"]["exported"] == ["TorchCheckpointEngine", f"global_step6/{MODEL}", "ok"], (world, r)
    save_dir = runs["work"][2] / "export" / "ds_checkpoints"
    assert (save_dir / "latest").read_text() == "global_step6"
    assert sorted(os.listdir(save_dir / "global_step6")) == [MODEL, _zero_file(0), _zero_file(1)]


def test_azure_documented_pattern(runs):
    """ds_config.json with Azure's nebula block (interval 100 s) and save_dir =
    persistent_storage_path; plain save_checkpoint(save_dir) three times, then a new process
    calls load_checkpoint(save_dir) and gets the newest checkpoint, bit for bit, from the
    memory of the agent, which is kept alive in between."""
    saved, resumed = runs["azure_save"], runs["azure_resume"]
    assert saved["engine"] == "NebulaCheckpointEngine"
    # When the first process ended, the newest checkpoint was held in memory only.
    assert saved["listed"][0] == ["global_step6", "memory", False], saved["listed"]
    # The new process attached to the same agent and loaded the newest checkpoint from its
    # memory: every tensor and DeepSpeed's client state equal to what was saved.
    assert saved["agent_pid"] and resumed["agent_pid"] == saved["agent_pid"]
    assert resumed["latest"] == [f"global_step6/{MODEL}", "ok"], resumed
    assert resumed["listed"][0] == ["global_step6", "memory"], resumed["listed"]
    # The first checkpoint is persisted at once; the next ones, within the interval, stay in
    # memory, next to DeepSpeed's own files in the same directory.
    held = runs["azure_store_after_save"]
    assert list(held) == ["global_step2"] and held["global_step2"]["names"] == {0: sorted([MODEL, _zero_file(0)])}
    files = _ds_files(runs["work"][1] / "azure" / "checkpoints")
    assert files["latest"] == "global_step6"
    # Persisted at once, global_step2's placeholders became its files; global_step6 is in memory only.
    assert files[f"global_step2/{MODEL}"]["global_steps"] == 2
    assert isinstance(files[f"global_step2/{_zero_file(0)}"], dict)
    assert all(files[f"global_step6/{n}"] == "" for n in (MODEL, _zero_file(0)))
    assert "zero_to_fp32.py" in files and "checkpointHistories.csv" in files


# -- the node agent ------------------------------------------------------------------------


def test_with_the_node_agent_ranks_load_straight_after_saving(tmp_path):
    """Two ranks, ZeRO 2, init()'s default agent: a fresh engine in the same processes loads
    both tags from the agent's memory without waiting for the disk; the store then commits."""
    runtime = tempfile.mkdtemp(prefix="nbrt-")  # short: Unix socket paths are limited
    try:
        env = _child_env(NEBULITE_AGENT="1", NEBULITE_RUNTIME_DIR=runtime, NEBULITE_AGENT_IDLE_EXIT="1")
        (results,) = _run(("agent", tmp_path, 2, env))
    finally:
        remove_runtime_dir(runtime)
    pids = {r["agent"]["agent_pid"] for r in results}
    assert len(pids) == 1 and None not in pids and os.getpid() not in pids  # one agent, not embedded
    for r in results:
        got = r["agent"]
        assert got["engine"] == "NebulaCheckpointEngine"
        assert got["latest"] == [f"global_step4/{MODEL}", "ok"], (r["rank"], got)
        assert got["explicit"] == [f"global_step2/{MODEL}", "ok"], (r["rank"], got)
    held = _store_snapshot(tmp_path / "agent" / "nebula")
    assert sorted(held) == ["global_step2", "global_step4"]
    assert held["global_step4"]["names"] == _expected_names(2, 2)


# -- DeepSpeed's engine against nebulite, in this process ------------------------------------


class _ScaleState:
    """Stands for DeepSpeed's loss scaler: an object torch.load(weights_only=True) refuses."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ScaleState) and other.scale == self.scale


def _commit_info(tag: str, save_dir: Path) -> Any:
    """What DeepSpeed passes to create() and commit(): a CheckpointCommitInfo in the releases
    that have one, the tag in earlier ones."""
    info_class = getattr(checkpoint_engine, "CheckpointCommitInfo", None)
    return tag if info_class is None else info_class(tag=tag, save_dir=str(save_dir), save_latest=True)


def _engine(store: str, **more: Any) -> NebulaCheckpointEngine:
    block = {"enabled": True, "persistent_storage_path": store, "persistent_time_interval": 0,
             "num_of_version_in_retention": 2, **more}
    return NebulaCheckpointEngine(DeepSpeedNebulaConfig({"nebula": block}))


def test_nebula_checkpoint_engine_calls(tmp_path, store):
    """Checkpoint(tag, -2), the placeholder, save(basename), commit() -> True, then
    get_checkpoint(tag=, persist_path=) and load(name, map_location=) with DeepSpeed's
    map_location callable, from memory and, in a new session, from the store."""
    save_dir = tmp_path / "ds"
    (save_dir / "global_step3").mkdir(parents=True)
    path = str(save_dir / "global_step3" / MODEL)
    state = {"module": {"w": torch.arange(6.0).reshape(2, 3)}, "loss_scaler": _ScaleState(2.0), "step": 3}
    engine = _engine(store)
    info = _commit_info("global_step3", save_dir)
    engine.create(info)
    engine.save(state, path)
    assert torch.load(path, weights_only=True) == ""  # DeepSpeed's placeholder
    assert engine.commit(info) is True
    from_memory = engine.load(path, map_location=lambda storage, loc: storage)
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    from_store = _engine(store).load(path, map_location=torch.device("cpu"))
    for loaded in (from_memory, from_store):
        assert loaded["loss_scaler"] == _ScaleState(2.0) and loaded["step"] == 3
        assert torch.equal(loaded["module"]["w"], state["module"]["w"])
    assert [e["tag"] for e in nebulite.list_checkpoints(store)] == ["global_step3"]


def test_only_deepspeeds_engine_unpickles_arbitrary_objects(tmp_path, store):
    """DeepSpeed's engine loads its state as its torch.load engine does (weights_only=False);
    through nebulite's own API the same object needs weights_only=False."""
    import pickle

    (tmp_path / "t").mkdir()
    path = str(tmp_path / "t" / "state")
    engine = _engine(store)
    info = _commit_info("t", tmp_path)
    engine.create(info)
    engine.save({"scaler": _ScaleState(4.0)}, path)
    assert engine.commit(info)
    assert engine.load(path)["scaler"] == _ScaleState(4.0)
    with pytest.raises(pickle.UnpicklingError, match="weights-only"):
        nebulite.get_checkpoint(tag="t").load("state")
    assert nebulite.get_checkpoint(tag="t").load("state", weights_only=False)["scaler"] == _ScaleState(4.0)


def test_torch_force_weights_only_load_applies_to_deepspeeds_engine(tmp_path, store, monkeypatch):
    """torch's switch forces weights-only loads on DeepSpeed's engine as on its torch.load;
    DeepSpeed's classes are then allowed with add_safe_globals."""
    import pickle

    (tmp_path / "t").mkdir()
    path = str(tmp_path / "t" / "state")
    engine = _engine(store)
    info = _commit_info("t", tmp_path)
    engine.create(info)
    engine.save({"scaler": _ScaleState(4.0)}, path)
    assert engine.commit(info)
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError, match="weights-only"):
        engine.load(path)
    with torch.serialization.safe_globals([_ScaleState]):
        assert engine.load(path)["scaler"] == _ScaleState(4.0)


# -- ranks that disagree on the tag ----------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ranks_committing_different_tags_fail_at_once_on_every_rank(tmp_path):
    """DeepSpeed's tag validation "Warn" or "Ignore" lets each rank save under its own tag:
    the commit fails on every rank with an error naming the tags, instead of rank 0 waiting
    for the other rank's manifest until the commit timeout (600 s, longer than the run is
    given here); the next save with one tag commits, and the agent exits once idle."""
    runtime = tempfile.mkdtemp(prefix="nbrt-")
    try:
        env = _child_env(NEBULITE_AGENT="1", NEBULITE_RUNTIME_DIR=runtime, NEBULITE_AGENT_IDLE_EXIT="1")
        (results,) = _run(("mixed_tags", tmp_path, 2, env))
        agent_pid = results[0]["mixed_tags"]["agent_pid"]
        assert agent_pid and all(r["mixed_tags"]["agent_pid"] == agent_pid for r in results)
        # Nothing of the failed checkpoints keeps the agent: it exits by itself once idle.
        while _pid_alive(agent_pid) and Path(f"/proc/{agent_pid}/stat").read_text().split()[2] != "Z":
            time.sleep(0.1)
    finally:
        remove_runtime_dir(runtime)
    for r in results:
        got = r["mixed_tags"]
        for validation in ("Warn", "Ignore"):
            error = got["errors"][validation]
            assert error is not None and error[0] == "TagMismatchError", (r["rank"], validation, got)
            assert "different tags" in error[1], error
            assert f"{validation}_rank0" in error[1] and f"{validation}_rank1" in error[1], error
        assert got["listed"] == ["agreed"], got
    assert sorted(_store_snapshot(tmp_path / "mixed" / "nebula")) == ["agreed"]


# -- save_dir holds real checkpoints ---------------------------------------------------------


def test_placeholders_become_the_committed_files(tmp_path, store):
    """Once a checkpoint is committed in the store, each placeholder DeepSpeed's engine wrote
    in save_dir is replaced by the committed file, which torch.load reads as DeepSpeed's own
    readers do (ZeRO-3 load paths, zero_to_fp32.py, enable_nebula_load: false)."""
    save_dir = tmp_path / "ds"
    (save_dir / "global_step3").mkdir(parents=True)
    paths = [str(save_dir / "global_step3" / n) for n in (MODEL, _zero_file(0))]
    states = [{"module": {"w": torch.arange(6.0).reshape(2, 3)}, "loss_scaler": _ScaleState(2.0)},
              {"optimizer_state_dict": {"step": 3, "m": torch.ones(4)}}]
    engine = _engine(store)
    info = _commit_info("global_step3", save_dir)
    engine.create(info)
    for state, path in zip(states, paths):
        engine.save(state, path)
    assert engine.commit(info) is True
    nebulite.flush_persistence()
    for state, path in zip(states, paths):
        loaded = torch.load(path, weights_only=False)  # DeepSpeed's own classes
        assert loaded.keys() == state.keys()
    model, zero = (torch.load(p, weights_only=False) for p in paths)
    assert torch.equal(model["module"]["w"], states[0]["module"]["w"])
    assert model["loss_scaler"] == _ScaleState(2.0)
    assert zero["optimizer_state_dict"]["step"] == 3
    assert torch.equal(zero["optimizer_state_dict"]["m"], torch.ones(4))
    assert sorted(os.listdir(save_dir / "global_step3")) == sorted(os.path.basename(p) for p in paths)


def test_placeholders_of_a_checkpoint_held_in_memory_are_replaced_once_it_is_persisted(tmp_path, store):
    """With persistent_time_interval, a checkpoint between two persisted ones is held in
    memory only: its placeholders stay until it reaches the store (flush_persistence() at
    the end of a run), and are replaced then."""
    save_dir = tmp_path / "ds"
    engine = _engine(store, persistent_time_interval=3600)
    paths = {}
    for step in (1, 2):
        tag = f"global_step{step}"
        (save_dir / tag).mkdir(parents=True)
        paths[tag] = str(save_dir / tag / MODEL)
        info = _commit_info(tag, save_dir)
        engine.create(info)
        engine.save({"module": {"w": torch.full((3,), float(step))}}, paths[tag])
        assert engine.commit(info) is True
    in_store = {e["tag"] for e in nebulite.list_checkpoints(store) if e["persisted"]}
    assert "global_step2" not in in_store  # held in memory only, for now
    assert torch.load(paths["global_step2"], weights_only=False) == ""  # DeepSpeed's placeholder
    nebulite.flush_persistence()
    for step, tag in ((1, "global_step1"), (2, "global_step2")):
        loaded = torch.load(paths[tag], weights_only=False)
        assert torch.equal(loaded["module"]["w"], torch.full((3,), float(step)))


# -- DeepSpeed's own checkpoint scenarios, ZeRO 3 ---------------------------------------------

RELOAD_WORKER = os.path.join(os.path.dirname(__file__), "workers", "deepspeed_reload_worker.py")


def _run_reload_worker(workdir: Path, world: int, nebula: dict[str, Any], env: dict[str, str]) -> list[dict[str, Any]]:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, RELOAD_WORKER, str(workdir), str(r), str(world), str(port),
                               json.dumps(nebula)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = wait_ranks(procs, JOB_TIMEOUT)
    results = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"rank {r} exited {p.returncode}\n{out[-2000:]}\n{err[-6000:]}"
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


@pytest.mark.parametrize("agent", [True, False], ids=["agent", "embedded"])
@pytest.mark.parametrize("store", [True, False], ids=["store", "memory-only"])
def test_zero3_loads_straight_after_saving_as_deepspeeds_own_tests_do(tmp_path, agent, store):
    """DeepSpeed's checkpoint tests (load with and without optimizer states, module only,
    immediate save/load, load then save) with ZeRO 3 on 2 ranks: the load happens in the
    processes that saved, straight after the save, while the checkpoint is in memory only
    (persistent_time_interval: the second engine's init() keeps the memory tier). Some of
    DeepSpeed's ZeRO-3 loads read its save_dir files themselves: they hold the checkpoint.
    The module's parameters are not compared here: DeepSpeed's CPU build reads ZeRO-3's
    whole parameters before its gathers land now and then, with its stock engine too; the
    fp32 partitions and zero_to_fp32's model are what it rebuilds them from."""
    nebula: dict[str, Any] = {"enabled": True}
    if store:
        nebula.update(persistent_storage_path=str(tmp_path / "nebula"), persistent_time_interval=100)
    runtime = tempfile.mkdtemp(prefix="nbrt-")  # short: Unix socket paths are limited
    try:
        env = _child_env(NEBULITE_AGENT="1" if agent else "0", NEBULITE_RUNTIME_DIR=runtime)
        results = _run_reload_worker(tmp_path, 2, nebula, env)
    finally:
        remove_runtime_dir(runtime)
    for rank, result in enumerate(results):
        for scenario, got in result.items():
            assert got["placeholders"] == [], (rank, scenario, "save_dir still holds placeholders")
            assert got["files_differ"] == [], (rank, scenario)
            # What DeepSpeed's ZeRO-3 loads without optimizer states (and zero_to_fp32.py) read.
            assert got["zero_to_fp32"] == "ok", (rank, scenario, "zero_to_fp32 differs from the saved model")
            if scenario in ("reload_optimizer", "immediate_load", "load_then_save"):
                assert got["same_fp32"] == "ok", (rank, scenario, "the loaded fp32 partitions differ from the saved ones")

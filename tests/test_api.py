"""The Nebula-compatible API surface: init, Checkpoint, commit, lookup, listing."""

from __future__ import annotations

import json
import os
import time
import warnings
import zipfile

import pytest
import torch

import nebulite
import nebulite.api
from nebulite import NotFoundError

from conftest import HANG_TIMEOUT

MIB = 1024 * 1024


def _state(value: float) -> dict:
    return {"w": torch.full((4, 3), float(value)), "step": int(value)}


def _assert_state(obj: dict, value: float) -> None:
    assert obj["step"] == int(value)
    assert torch.equal(obj["w"], torch.full((4, 3), float(value)))


# -- init ---------------------------------------------------------------------


def test_init_with_arguments(store):
    nebulite.init(persistent_storage_path=store, persistent_time_interval=5,
                  num_of_version_in_retention=3)
    info = nebulite.session_info()
    assert info["persistent_storage_path"] == os.path.abspath(store)
    assert info["rank"] == 0 and info["world_size"] == 1
    config = nebulite.api._session.config
    assert config.persistent_time_interval == 5.0
    assert config.num_of_version_in_retention == 3
    assert config.memory_buffer_size == 256 * MIB
    nebulite.Checkpoint("t").save("m", _state(1))
    nebulite.flush_persistence()
    assert os.path.isdir(store)
    assert nebulite.get_latest_checkpoint().tag == "t"


def test_init_from_environment(store, monkeypatch):
    monkeypatch.setenv("NEBULA_PERSISTENT_STORAGE_PATH", store)
    monkeypatch.setenv("NEBULA_PERSISTENT_TIME_INTERVAL", "7")
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", str(64 * MIB))
    nebulite.init()
    config = nebulite.api._session.config
    assert config.persistent_storage_path == os.path.abspath(store)
    assert config.persistent_time_interval == 7.0
    assert config.memory_buffer_size == 64 * MIB
    assert nebulite.session_info()["persistent_storage_path"] == os.path.abspath(store)
    nebulite.Checkpoint("env").save("m", _state(2))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    found = nebulite.get_latest_checkpoint(persist_path=store)
    assert found.tag == "env"
    _assert_state(found.load("m"), 2)


def test_arguments_override_environment(store, tmp_path, monkeypatch):
    monkeypatch.setenv("NEBULA_PERSISTENT_STORAGE_PATH", str(tmp_path / "from_env"))
    monkeypatch.setenv("NEBULA_PERSISTENT_TIME_INTERVAL", "7")
    nebulite.init(persistent_storage_path=store, persistent_time_interval=0)
    config = nebulite.api._session.config
    assert config.persistent_storage_path == os.path.abspath(store)
    assert config.persistent_time_interval == 0.0


# -- completion: num_files and commit() -----------------------------------------


def test_default_num_files_commits_after_one_save(store):
    nebulite.init(persistent_storage_path=store)
    ckpt = nebulite.Checkpoint("one")
    assert ckpt.num_files == 1
    assert nebulite.get_latest_checkpoint().tag == ""
    ckpt.save("model", _state(3))
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "one"
    _assert_state(latest.load("model"), 3)


def test_num_files_two_commits_after_second_save(store):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("first").save("model", _state(1))
    ckpt = nebulite.Checkpoint("second", num_files=2)
    ckpt.save("model", _state(2))
    assert nebulite.get_latest_checkpoint().tag == "first"
    assert nebulite.get_checkpoint(tag="second").tag == ""
    ckpt.save("optimizer", _state(20))
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "second"
    assert sorted(latest.list_names()) == ["model", "optimizer"]
    _assert_state(latest.load("model"), 2)
    _assert_state(latest.load("optimizer"), 20)


def test_num_files_two_without_previous_shows_none(store):
    nebulite.init(persistent_storage_path=store)
    ckpt = nebulite.Checkpoint("only", num_files=2)
    ckpt.save("a", _state(1))
    assert nebulite.get_latest_checkpoint().tag == ""
    assert nebulite.list_checkpoints() == []
    ckpt.save("b", _state(2))
    assert nebulite.get_latest_checkpoint().tag == "only"


def test_commit_explicitly(store):
    nebulite.init(persistent_storage_path=store)
    ckpt = nebulite.Checkpoint("explicit", num_files=nebulite.COMMIT_EXPLICITLY)
    assert nebulite.COMMIT_EXPLICITLY == -2
    for i in range(3):
        ckpt.save(f"part{i}", _state(i))
    assert nebulite.get_latest_checkpoint().tag == ""
    assert ckpt.commit() is True
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "explicit"
    assert sorted(latest.list_names()) == ["part0", "part1", "part2"]
    for i in range(3):
        _assert_state(latest.load(f"part{i}"), i)
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    stored = nebulite.get_latest_checkpoint(persist_path=store)
    assert stored.tag == "explicit"
    _assert_state(stored.load("part2"), 2)


def test_handles_are_keyed_by_tag(store):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t", -2).save("model", _state(1))
    nebulite.Checkpoint("t", -2).save("optimizer", _state(2))
    assert nebulite.get_latest_checkpoint().tag == ""
    assert nebulite.Checkpoint("t", -2).commit() is True
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "t"
    assert sorted(latest.list_names()) == ["model", "optimizer"]
    _assert_state(latest.load("model"), 1)
    _assert_state(latest.load("optimizer"), 2)


def test_saving_same_name_twice_in_one_version_is_rejected(store):
    nebulite.init(persistent_storage_path=store)
    ckpt = nebulite.Checkpoint("dup", -2)
    ckpt.save("model", _state(1))
    with pytest.raises(nebulite.InvalidArgumentError):
        ckpt.save("model", _state(2))
    assert ckpt.commit() is True
    _assert_state(nebulite.get_latest_checkpoint().load("model"), 1)


def test_invalid_num_files(store):
    nebulite.init(persistent_storage_path=store)
    for bad in (0, -1, -3, 1.5, "2"):
        with pytest.raises(nebulite.InvalidArgumentError):
            nebulite.Checkpoint("t", bad)


# -- lookup -----------------------------------------------------------------------


def test_empty_tag_when_nothing_exists(store):
    nebulite.init(persistent_storage_path=store)
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == ""
    assert latest.list_names() == []
    with pytest.raises(NotFoundError):
        latest.load("model")
    assert nebulite.get_latest_checkpoint(persist_path=store).tag == ""


def test_empty_tag_without_init_and_without_store(tmp_path):
    assert nebulite.get_latest_checkpoint().tag == ""
    assert nebulite.get_latest_checkpoint(persist_path=str(tmp_path / "missing")).tag == ""


def test_get_checkpoint_by_tag(store):
    nebulite.init(persistent_storage_path=store)
    for i, tag in enumerate(["alpha", "beta", "gamma"]):
        nebulite.Checkpoint(tag).save("model", _state(i))
    beta = nebulite.get_checkpoint(tag="beta")
    assert beta.tag == "beta"
    _assert_state(beta.load("model"), 1)
    assert nebulite.get_checkpoint(tag="nope").tag == ""
    assert nebulite.get_checkpoint().tag == "gamma"
    assert nebulite.get_checkpoint(tag="gamma", persist_path=store).tag == "gamma"


def test_get_checkpoint_by_tag_from_store(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    for i, tag in enumerate(["alpha", "beta", "gamma"]):
        nebulite.Checkpoint(tag).save("model", _state(i))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    alpha = nebulite.get_checkpoint(tag="alpha", persist_path=store)
    assert alpha.tag == "alpha"
    _assert_state(alpha.load("model"), 0)
    assert nebulite.get_checkpoint(tag="delta", persist_path=store).tag == ""


def test_latest_is_by_commit_order_not_tag_name(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    for i, tag in enumerate(["global_step900", "global_step1000", "a"]):
        nebulite.Checkpoint(tag).save("model", _state(i))
    assert nebulite.get_latest_checkpoint().tag == "a"
    assert [c["tag"] for c in nebulite.list_checkpoints()][:3] == ["a", "global_step1000", "global_step900"]
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert latest.tag == "a"
    _assert_state(latest.load("model"), 2)


def test_resaving_a_tag_makes_a_new_version(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    nebulite.Checkpoint("checkpoint").save("model", _state(1))
    old = nebulite.get_checkpoint(tag="checkpoint")
    assert old.tag == "checkpoint" and old.version is not None

    writer = nebulite.Checkpoint("checkpoint", -2)
    writer.save("model", _state(2))
    # Not committed yet: the tag still holds the old version, which stays loadable.
    current = nebulite.get_checkpoint(tag="checkpoint")
    assert current.version == old.version
    _assert_state(old.load("model"), 1)
    _assert_state(nebulite.get_latest_checkpoint().load("model"), 1)

    assert writer.commit() is True
    new = nebulite.get_checkpoint(tag="checkpoint")
    assert new.tag == "checkpoint"
    assert new.version != old.version
    _assert_state(new.load("model"), 2)
    _assert_state(nebulite.get_latest_checkpoint().load("model"), 2)

    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    stored = nebulite.get_checkpoint(tag="checkpoint", persist_path=store)
    assert stored.version == new.version
    _assert_state(stored.load("model"), 2)


def test_resaving_a_tag_old_version_loadable_from_store(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    nebulite.Checkpoint("checkpoint").save("model", _state(1))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()

    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    old = nebulite.get_checkpoint(tag="checkpoint")
    assert old.tag == "checkpoint"
    writer = nebulite.Checkpoint("checkpoint", -2)
    writer.save("model", _state(2))
    _assert_state(old.load("model"), 1)
    writer.commit()
    assert nebulite.get_checkpoint(tag="checkpoint").version != old.version
    _assert_state(nebulite.get_checkpoint(tag="checkpoint").load("model"), 2)


# -- listing and paths --------------------------------------------------------------


def test_list_checkpoints_is_json_and_lists_tiers(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    nebulite.Checkpoint("t1").save("model", _state(1))
    nebulite.Checkpoint("t2", 2).save("model", _state(2))
    nebulite.Checkpoint("t2", 2).save("optim", _state(3))
    nebulite.flush_persistence()

    listed = nebulite.list_checkpoints()
    json.loads(json.dumps(listed))
    assert [c["tag"] for c in listed] == ["t2", "t1"]
    for c in listed:
        assert c["tier"] in ("memory", "persistent")
        assert isinstance(c["version"], str) and c["version"]
        assert isinstance(c["seq"], int)
        assert c["persisted"] is True
    assert sorted(listed[0]["names"]) == ["model", "optim"]
    assert listed[0]["seq"] > listed[1]["seq"]

    nebulite.api._reset_for_tests()
    stored = nebulite.list_checkpoints(persist_path=store)
    json.loads(json.dumps(stored))
    assert [c["tag"] for c in stored] == ["t2", "t1"]
    for c in stored:
        assert c["tier"] == "persistent"
        assert c["persisted"] is True
        assert os.path.isdir(c["path"])
    assert sorted(stored[0]["names"]) == ["model", "optim"]
    assert stored[1]["names"] == ["model"]


def test_get_latest_checkpoint_path_is_a_torch_load_file(store):
    nebulite.init(persistent_storage_path=store)
    state = {
        "weight": torch.randn(16, 8),
        "bias": torch.arange(8, dtype=torch.int64),
        "meta": {"epoch": 3, "name": "net"},
    }
    nebulite.Checkpoint("step1").save("model", {"weight": torch.zeros(2)})
    nebulite.Checkpoint("step2").save("model", state)
    nebulite.flush_persistence()
    path = nebulite.get_latest_checkpoint_path("model", store)
    assert os.path.isfile(path)
    assert os.path.abspath(path).startswith(os.path.abspath(store))
    assert "step2" in path

    for kwargs in ({}, {"weights_only": True}, {"mmap": True}, {"mmap": True, "weights_only": True},
                   {"weights_only": False}):
        loaded = torch.load(path, map_location="cpu", **kwargs)
        assert torch.equal(loaded["weight"], state["weight"])
        assert torch.equal(loaded["bias"], state["bias"])
        assert loaded["meta"] == state["meta"]
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        assert all(info.compress_type == zipfile.ZIP_STORED for info in zf.infolist())

    # Also found from a fresh process state, and from the session's own path.
    assert nebulite.get_latest_checkpoint_path("model") == path
    nebulite.api._reset_for_tests()
    assert nebulite.get_latest_checkpoint_path("model", store) == path
    with pytest.raises(NotFoundError):
        nebulite.get_latest_checkpoint_path("nosuchname", store)


def test_get_latest_checkpoint_path_skips_checkpoints_without_the_name(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    nebulite.Checkpoint("a").save("model", {"x": torch.ones(3)})
    nebulite.Checkpoint("b").save("optimizer", {"y": torch.ones(3)})
    nebulite.flush_persistence()
    path = nebulite.get_latest_checkpoint_path("model", store)
    assert os.sep + "a" + os.sep in path
    assert torch.equal(torch.load(path)["x"], torch.ones(3))


def test_memory_only_mode():
    nebulite.init()
    assert nebulite.session_info()["persistent_storage_path"] is None
    nebulite.Checkpoint("mem").save("model", _state(5))
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "mem"
    _assert_state(latest.load("model"), 5)
    listed = nebulite.list_checkpoints()
    assert [c["tier"] for c in listed] == ["memory"]
    assert listed[0]["persisted"] is False
    json.dumps(listed)
    with pytest.raises(NotFoundError):
        nebulite.get_latest_checkpoint_path("model")
    nebulite.flush_persistence()  # nothing to persist; must not raise


def test_load_map_location(store):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t").save("model", _state(4))
    latest = nebulite.get_latest_checkpoint()
    _assert_state(latest.load("model", map_location="cpu"), 4)
    _assert_state(latest.load("model", map_location=torch.device("cpu")), 4)
    _assert_state(latest.load("model", map_location=lambda storage, loc: storage), 4)
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    stored = nebulite.get_latest_checkpoint(persist_path=store)
    loaded = stored.load("model", map_location="cpu")
    _assert_state(loaded, 4)
    assert loaded["w"].device.type == "cpu"


def test_compat_modules_reexport():
    import nebulaml
    import torch_nebula

    for mod in (torch_nebula, nebulaml):
        assert mod.init is nebulite.init
        assert mod.Checkpoint is nebulite.Checkpoint
        assert mod.get_latest_checkpoint is nebulite.get_latest_checkpoint
        assert mod.get_checkpoint is nebulite.get_checkpoint
        assert mod.list_checkpoints is nebulite.list_checkpoints
        assert mod.get_latest_checkpoint_path is nebulite.get_latest_checkpoint_path
        assert mod.flush_persistence is nebulite.flush_persistence


def test_compat_module_round_trip(store):
    import torch_nebula

    torch_nebula.init(persistent_storage_path=store)
    ckpt = torch_nebula.Checkpoint("global_step1", -2)
    ckpt.save("mp_rank_00_model_states.pt", _state(7))
    assert ckpt.commit() is True
    found = torch_nebula.get_checkpoint(tag="global_step1", persist_path=store)
    _assert_state(found.load("mp_rank_00_model_states.pt", map_location="cpu"), 7)


def test_flush_persistence_makes_interval_skipped_checkpoint_durable(store):
    nebulite.init(persistent_storage_path=store, persistent_time_interval=3600)
    nebulite.Checkpoint("first").save("model", _state(1))
    nebulite.Checkpoint("second").save("model", _state(2))
    listed = {c["tag"]: c for c in nebulite.list_checkpoints()}
    assert listed["second"]["persisted"] is False
    nebulite.flush_persistence()
    assert {c["tag"]: c for c in nebulite.list_checkpoints()}["second"]["persisted"] is True
    nebulite.api._reset_for_tests()
    latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert latest.tag == "second"
    _assert_state(latest.load("model"), 2)


def test_read_store_from_fresh_session(store):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t", 2).save("model", _state(8))
    nebulite.Checkpoint("t", 2).save("optim", _state(9))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    assert nebulite.api._session is None
    latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert latest.tag == "t"
    assert sorted(latest.list_names()) == ["model", "optim"]
    _assert_state(latest.load("model"), 8)
    _assert_state(latest.load("optim"), 9)
    assert nebulite.api._session is None  # reading does not init


def test_read_store_from_env_without_init(store, monkeypatch):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t").save("model", _state(8))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    monkeypatch.setenv("NEBULA_PERSISTENT_STORAGE_PATH", store)
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "t"
    _assert_state(latest.load("model"), 8)


def test_new_session_continues_commit_order(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    nebulite.Checkpoint("zzz").save("model", _state(1))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    nebulite.Checkpoint("aaa").save("model", _state(2))
    nebulite.flush_persistence()
    assert nebulite.get_latest_checkpoint().tag == "aaa"
    nebulite.api._reset_for_tests()
    assert nebulite.get_latest_checkpoint(persist_path=store).tag == "aaa"


def test_reinit_drains_previous_session(store, tmp_path):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t").save("model", _state(3))
    other = str(tmp_path / "other")
    nebulite.init(persistent_storage_path=other)
    assert nebulite.get_latest_checkpoint().tag == ""
    found = nebulite.get_latest_checkpoint(persist_path=store)
    assert found.tag == "t"
    _assert_state(found.load("model"), 3)


def test_commit_with_nothing_saved_warns(store):
    nebulite.init(persistent_storage_path=store)
    with pytest.warns(UserWarning, match="nothing to commit"):
        assert nebulite.Checkpoint("empty", -2).commit() is False
    # Committing a tag already completed by num_files is fine.
    nebulite.Checkpoint("done").save("model", _state(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nebulite.Checkpoint("done", -2).commit() is True


def test_loaded_tensors_are_independent_copies(store):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t").save("model", {"x": torch.zeros(4)})
    latest = nebulite.get_latest_checkpoint()
    latest.load("model")["x"].fill_(5.0)
    assert torch.equal(latest.load("model")["x"], torch.zeros(4))


def test_concurrent_saves_from_threads(store):
    import threading

    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(5):
                ckpt = nebulite.Checkpoint(f"t{i}_{j}", -2)
                ckpt.save("model", {"x": torch.full((100,), float(i * 100 + j))})
                ckpt.save("optim", {"y": torch.full((10,), float(j))})
                assert ckpt.commit() is True
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    listed = nebulite.list_checkpoints(persist_path=store)
    assert len(listed) == 15
    assert len({c["seq"] for c in listed}) == 15
    for i in range(3):
        for j in range(5):
            found = nebulite.get_checkpoint(tag=f"t{i}_{j}", persist_path=store)
            assert found.load("model")["x"][0].item() == i * 100 + j
            assert found.load("optim")["y"][0].item() == j


def test_list_checkpoints_commit_time_in_memory_tier(store):
    import time

    before = time.time_ns()
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t").save("model", _state(1))
    (entry,) = nebulite.list_checkpoints()
    assert entry["tier"] == "memory"
    assert entry["committed_unix_ns"] >= before


def test_latest_checkpoint_path_skips_memory_only_checkpoint(store):
    nebulite.init(persistent_storage_path=store, persistent_time_interval=3600,
                  num_of_version_in_retention=0)
    nebulite.Checkpoint("persisted").save("model", _state(1))
    nebulite.Checkpoint("memory_only").save("model", _state(2))
    nebulite.api._session.engine.flush(60)  # the first one's pending persistence only
    path = nebulite.get_latest_checkpoint_path("model")
    assert os.sep + "persisted" + os.sep in path
    _assert_state(torch.load(path), 1)
    nebulite.flush_persistence()
    path = nebulite.get_latest_checkpoint_path("model")
    assert os.sep + "memory_only" + os.sep in path
    _assert_state(torch.load(path), 2)


def test_memory_handle_loads_from_its_store_after_shutdown(store, tmp_path):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t").save("model", _state(6))
    nebulite.flush_persistence()
    handle = nebulite.get_latest_checkpoint()
    nebulite.init(persistent_storage_path=str(tmp_path / "elsewhere"))
    _assert_state(handle.load("model"), 6)
    nebulite.shutdown()
    _assert_state(handle.load("model"), 6)


def test_explicit_world_without_distributed_needs_a_shared_run_id(store, monkeypatch):
    monkeypatch.delenv("NEBULITE_RUN_ID", raising=False)
    with pytest.raises(nebulite.InvalidArgumentError, match="NEBULITE_RUN_ID"):
        nebulite.init(persistent_storage_path=store, rank=0, world_size=2)
    monkeypatch.setenv("NEBULITE_RUN_ID", "job42")
    nebulite.init(persistent_storage_path=store, rank=0, world_size=2)
    assert nebulite.session_info()["run_id"] == "job42"


def test_init_removes_only_dead_runs_uncommitted_versions(store, monkeypatch, tmp_path):
    import subprocess
    import sys

    monkeypatch.setenv("NEBULITE_RUN_ID", "alive1")
    nebulite.init(persistent_storage_path=store)  # this process is run "alive1", alive
    live = os.path.join(store, "t", "valive1-000001", "rank0")
    dead = os.path.join(store, "t", "vdead99-000001", "rank0")
    for d in (live, dead):
        os.makedirs(d)
        with open(os.path.join(d, "model"), "wb") as f:
            f.write(b"partial")
    # Another process opening the same store (an evaluation job, say). A free lock alone
    # proves nothing (locks may be node-local): a version that changed within the grace
    # period (an hour by default) is kept. It is a second job writing the store while this
    # one lives: it opts into sharing the store (else it is refused, see test_store_lease.py).
    env = dict(os.environ, NEBULITE_RUN_ID="other2", NEBULITE_SHARED_STORE="1")
    code = f"import nebulite; nebulite.init(persistent_storage_path={store!r})"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=HANG_TIMEOUT)
    assert os.path.exists(live), "a live run's version in progress was deleted"
    assert os.path.exists(dead), "a version changed within the grace period was deleted"
    # Past the grace period, the dead run's leftover goes; the live run's version stays.
    env["NEBULITE_DEAD_RUN_GRACE"] = "0"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=HANG_TIMEOUT)
    assert os.path.exists(live), "a live run's version in progress was deleted"
    assert not os.path.exists(dead), "a dead run's leftover was kept"


def test_forked_child_does_not_inherit_the_session(store, tmp_path):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("parent").save("x", torch.ones(3))
    child_store = str(tmp_path / "child")
    pid = os.fork()
    if pid == 0:  # the child: a fresh start must work, the parent's engine is untouched
        code = 1
        try:
            try:
                nebulite.Checkpoint("c").save("x", torch.ones(1))
            except nebulite.NotInitializedError:
                nebulite.init(persistent_storage_path=child_store)
                nebulite.Checkpoint("c").save("y", torch.zeros(2))
                nebulite.flush_persistence()
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    nebulite.flush_persistence()
    assert nebulite.get_latest_checkpoint().tag == "parent"
    assert nebulite.get_latest_checkpoint(persist_path=child_store).load("y").shape == (2,)


def test_a_forked_child_never_closes_an_engine_it_inherited(store):
    """An engine the parent still held when it forked (in garbage not collected yet, say)
    is left alone when the child drops it: its threads did not survive the fork, and
    closing it would wait for them forever."""
    import gc
    import signal

    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("p").save("x", torch.ones(3))
    engine = nebulite.api._session.engine
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            nebulite.api._left_behind.clear()  # the last references to the parent's engine
            del engine
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    # A child that waits for the parent's threads ends, at best, when the engine's 60 s
    # close timeout runs out; one that leaves the engine alone ends at once.
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not done:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert nebulite.get_latest_checkpoint().load("x").shape == (3,)  # the parent's goes on


def test_forked_child_can_load_from_its_own_memory_tier(store, tmp_path):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("p").save("x", torch.arange(4_000_000))  # > 1 MiB: the copy pool
    assert nebulite.get_latest_checkpoint().load("x")[-1] == 3_999_999
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            torch.set_num_threads(1)  # libgomp's pool does not survive fork
            nebulite.init(persistent_storage_path=str(tmp_path / "child"))
            nebulite.Checkpoint("c").save("y", torch.arange(3_000_000))
            code = 0 if nebulite.get_latest_checkpoint().load("y")[-1] == 2_999_999 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0

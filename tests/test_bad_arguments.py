"""Bad arguments: each is a clear error naming the argument (an InvalidArgumentError, a
ValueError; a TypeError too where the type is wrong), or it works. Never an abort, a raw
error from deep inside, or a silently different setting."""

from __future__ import annotations

import math
import os

import pytest
import torch

import nebulite
import nebulite.api
from nebulite import InvalidArgumentError


def _config():
    return nebulite.api._config()


def _save_and_flush(timeout=None) -> None:
    c = nebulite.Checkpoint("t", 1)
    c.save("m", {"w": torch.arange(8.0)})
    nebulite.flush_persistence(timeout=timeout)
    assert torch.equal(nebulite.get_latest_checkpoint().load("m")["w"], torch.arange(8.0))


@pytest.mark.parametrize("key", ["io_threads", "copy_threads"])
@pytest.mark.parametrize("value", [100000, -1, 2.5, "many", True])
def test_thread_counts_out_of_range_name_the_argument(store, key, value):
    with pytest.raises(InvalidArgumentError, match=key):
        nebulite.init(store, **{key: value})


@pytest.mark.parametrize("key", ["io_threads", "copy_threads"])
def test_thread_counts_in_range_work(store, key):
    nebulite.init(store, **{key: "3"})
    assert getattr(_config(), key) == 3
    _save_and_flush()


@pytest.mark.parametrize("timeout", [math.inf, 1e300, 1e18])
def test_flush_with_no_practical_limit_waits_for_the_commit(store, timeout):
    nebulite.init(store)
    _save_and_flush(timeout)


@pytest.mark.parametrize("timeout", [math.nan, -1.0, "soon", -math.inf])
def test_flush_with_a_meaningless_timeout_names_it(store, timeout):
    nebulite.init(store)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        nebulite.flush_persistence(timeout=timeout)


@pytest.mark.parametrize("timeout", [math.inf, 1e300, "inf"])
def test_commit_timeout_without_limit_works(store, timeout):
    nebulite.init(store, commit_timeout=timeout)
    assert _config().commit_timeout == math.inf
    _save_and_flush()


@pytest.mark.parametrize("key", ["commit_timeout", "dead_run_grace", "agent_idle_exit"])
def test_nan_seconds_are_refused(store, key):
    with pytest.raises(InvalidArgumentError, match=key):
        nebulite.init(store, **{key: math.nan})


@pytest.mark.parametrize("interval", [math.nan, math.inf, -1, "never"])
def test_persistent_time_interval_must_be_finite(store, interval):
    with pytest.raises(InvalidArgumentError, match="persistent_time_interval"):
        nebulite.init(store, interval)


def test_nan_interval_from_the_environment_is_refused(store, monkeypatch):
    monkeypatch.setenv("NEBULA_PERSISTENT_TIME_INTERVAL", "nan")
    with pytest.raises(InvalidArgumentError, match="NEBULA_PERSISTENT_TIME_INTERVAL"):
        nebulite.init(store)


@pytest.mark.parametrize("key", ["agent", "async_staging", "prefault", "direct_io"])
@pytest.mark.parametrize("text,value", [
    ("false", False), ("False", False), ("no", False), ("0", False), (" NO ", False),
    ("true", True), ("yes", True), ("1", True), ("TRUE", True),
])
def test_boolean_strings_mean_what_they_say(store, monkeypatch, agent_env, key, text, value):
    kwargs = {key: text}
    if key != "agent":
        kwargs["agent"] = False
    nebulite.init(store, **kwargs)
    assert getattr(_config(), key) is value


@pytest.mark.parametrize("key", ["agent", "async_staging", "prefault", "direct_io"])
@pytest.mark.parametrize("text", ["maybe", "", "2", "nein", 2, 0.5, [True]])
def test_other_boolean_values_are_refused(store, key, text):
    with pytest.raises(InvalidArgumentError, match=key):
        nebulite.init(store, **{key: text})


@pytest.mark.parametrize("var,key", [
    ("NEBULITE_AGENT", "agent"), ("NEBULITE_ASYNC_STAGING", "async_staging"),
])
def test_boolean_environment_variables_are_parsed_strictly(store, monkeypatch, var, key):
    monkeypatch.setenv(var, "false")
    nebulite.init(store)
    assert getattr(_config(), key) is False
    nebulite.shutdown()
    monkeypatch.setenv(var, "perhaps")
    with pytest.raises(InvalidArgumentError, match=var):
        nebulite.init(store)


@pytest.mark.parametrize("value", [1.5, "1.5", math.nan, math.inf, True, "two", -1])
def test_retention_must_be_a_whole_number(store, value):
    with pytest.raises(InvalidArgumentError, match="num_of_version_in_retention"):
        nebulite.init(store, num_of_version_in_retention=value)


@pytest.mark.parametrize("value,expected", [(3, 3), (3.0, 3), ("3", 3), (0, 0)])
def test_retention_accepts_whole_numbers(store, value, expected):
    nebulite.init(store, num_of_version_in_retention=value)
    assert _config().num_of_version_in_retention == expected


@pytest.mark.parametrize("value", [1.5, "lots", math.nan, -5, True])
def test_memory_buffer_size_must_be_whole_bytes(store, value):
    with pytest.raises(InvalidArgumentError, match="memory_buffer_size"):
        nebulite.init(store, memory_buffer_size=value)


@pytest.mark.parametrize("tag", ["a\udc80", "\ud800"])
def test_lone_surrogate_in_a_tag_is_a_clear_error(store, tag):
    nebulite.init(store)
    with pytest.raises(InvalidArgumentError, match="tag"):
        nebulite.Checkpoint(tag, 1)
    with pytest.raises(InvalidArgumentError, match="tag"):
        nebulite.get_checkpoint(tag)


def test_lone_surrogate_in_an_object_name_is_a_clear_error(store):
    nebulite.init(store)
    c = nebulite.Checkpoint("t", 1)
    with pytest.raises(InvalidArgumentError, match="name"):
        c.save("m\udc80", {"a": 1})
    c.save("m", {"a": 1})  # the checkpoint is still usable
    nebulite.flush_persistence()


def test_lone_surrogate_in_a_path_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidArgumentError, match="persistent_storage_path"):
        nebulite.init(str(tmp_path / "x\udc80"))


@pytest.mark.parametrize("path", [5, 3.5, ["a", "b"], object()])
def test_a_path_of_the_wrong_type_is_a_type_error_naming_it(path):
    with pytest.raises(TypeError, match="persistent_storage_path"):
        nebulite.init(path)


@pytest.mark.parametrize("call", [
    lambda p: nebulite.get_latest_checkpoint(p),
    lambda p: nebulite.list_checkpoints(p),
    lambda p: nebulite.get_checkpoint("t", persist_path=p),
])
def test_load_calls_name_a_path_of_the_wrong_type(call):
    with pytest.raises(TypeError, match="persist_path"):
        call(5)


def test_errors_for_bad_arguments_are_also_nebulite_errors(store):
    with pytest.raises(nebulite.NebuliteError):
        nebulite.init(5)
    with pytest.raises(nebulite.NebuliteError):
        nebulite.init(store, agent="maybe")


@pytest.mark.parametrize("from_memory", [True, False])
def test_map_location_meta_gives_meta_tensors(store, from_memory):
    nebulite.init(store)
    c = nebulite.Checkpoint("t", 1)
    c.save("m", {"w": torch.arange(12.0).reshape(3, 4), "step": 7})
    nebulite.flush_persistence()
    if not from_memory:
        nebulite.shutdown()
    got = nebulite.get_latest_checkpoint(store).load("m", map_location="meta")
    assert got["step"] == 7
    assert got["w"].is_meta and got["w"].shape == (3, 4) and got["w"].dtype == torch.float32
    got = nebulite.get_latest_checkpoint(store).load("m", map_location=torch.device("meta"))
    assert got["w"].is_meta


def test_an_unknown_device_in_map_location_is_a_clear_error(store):
    nebulite.init(store)
    c = nebulite.Checkpoint("t", 1)
    c.save("m", {"w": torch.ones(2)})
    nebulite.flush_persistence()
    with pytest.raises((ValueError, RuntimeError), match="gpu7|device"):
        nebulite.get_latest_checkpoint().load("m", map_location="gpu7")


def test_world_size_and_rank_must_agree(store):
    with pytest.raises(InvalidArgumentError, match="rank"):
        nebulite.init(store, rank=2, world_size=2)
    with pytest.raises(InvalidArgumentError, match="world_size"):
        nebulite.init(store, rank=0, world_size=0)


def test_a_bytes_path_is_a_path(tmp_path):
    nebulite.init(os.fsencode(str(tmp_path / "bytes")))
    assert _config().persistent_storage_path == str(tmp_path / "bytes")


def test_no_limit_through_the_node_agent(store, agent_env):
    nebulite.init(store, agent=True, commit_timeout=math.inf)
    _save_and_flush(math.inf)
    _save_and_flush(1e300)

"""Retention of committed versions, checkpointHistories.csv, persistent_time_interval."""

from __future__ import annotations

import csv
import os

import torch

import nebulite
import nebulite.api

HEADER = ("time_utc,tag,version,name,rank,bytes,blocking_seconds,persist_seconds,"
          "throughput_mb_s,tier,outcome")


def _state(value: float) -> dict:
    return {"w": torch.full((32, 32), float(value)), "step": int(value)}


def _tag_dirs(store: str) -> list[str]:
    return sorted(
        d for d in os.listdir(store)
        if os.path.isdir(os.path.join(store, d)) and not d.startswith(".")  # .nebulite: run locks
    )


def _version_dirs(store: str, tag: str) -> list[str]:
    return sorted(os.listdir(os.path.join(store, tag)))


def _history_rows(store: str) -> list[dict[str, str]]:
    with open(os.path.join(store, "checkpointHistories.csv"), newline="") as f:
        return list(csv.DictReader(f))


# -- retention ---------------------------------------------------------------------------


def test_retention_keeps_newest_two(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=2)
    for i, tag in enumerate(["t1", "t2", "t3", "t4"]):
        nebulite.Checkpoint(tag).save("model", _state(i))
        nebulite.flush_persistence()
    assert _tag_dirs(store) == ["t3", "t4"]
    assert [c["tag"] for c in nebulite.list_checkpoints()] == ["t4", "t3"]
    nebulite.api._reset_for_tests()
    assert [c["tag"] for c in nebulite.list_checkpoints(persist_path=store)] == ["t4", "t3"]
    assert nebulite.get_checkpoint(tag="t3", persist_path=store).load("model")["step"] == 2
    assert nebulite.get_checkpoint(tag="t1", persist_path=store).tag == ""


def test_retention_default_is_two(store):
    nebulite.init(persistent_storage_path=store)
    for i in range(4):
        nebulite.Checkpoint(f"step{i}").save("model", _state(i))
    nebulite.flush_persistence()
    assert _tag_dirs(store) == ["step2", "step3"]


def test_retention_is_by_commit_order(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=2)
    # Names sort the opposite way round from commit order.
    for i, tag in enumerate(["global_step900", "global_step1000", "b", "a"]):
        nebulite.Checkpoint(tag).save("model", _state(i))
    nebulite.flush_persistence()
    assert _tag_dirs(store) == ["a", "b"]
    nebulite.api._reset_for_tests()
    latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert latest.tag == "a"
    assert latest.load("model")["step"] == 3


def test_retention_counts_versions_of_a_resaved_tag(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=2)
    for i in range(4):
        nebulite.Checkpoint("checkpoint").save("model", _state(i))
    nebulite.flush_persistence()
    assert _tag_dirs(store) == ["checkpoint"]
    assert len(_version_dirs(store, "checkpoint")) == 2
    nebulite.api._reset_for_tests()
    assert nebulite.get_latest_checkpoint(persist_path=store).load("model")["step"] == 3


def test_retention_zero_keeps_all(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    tags = [f"t{i}" for i in range(5)]
    for i, tag in enumerate(tags):
        nebulite.Checkpoint(tag).save("model", _state(i))
    nebulite.flush_persistence()
    assert _tag_dirs(store) == tags
    nebulite.api._reset_for_tests()
    listed = nebulite.list_checkpoints(persist_path=store)
    assert [c["tag"] for c in listed] == tags[::-1]
    for i, tag in enumerate(tags):
        assert nebulite.get_checkpoint(tag=tag, persist_path=store).load("model")["step"] == i


def test_retention_across_sessions(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=2)
    for tag in ("old1", "old2"):
        nebulite.Checkpoint(tag).save("model", _state(0))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=2)
    nebulite.Checkpoint("new1").save("model", _state(1))
    nebulite.flush_persistence()
    assert _tag_dirs(store) == ["new1", "old2"]


def test_retention_records_deletions_in_history(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=1)
    nebulite.Checkpoint("a").save("model", _state(0))
    nebulite.Checkpoint("b").save("model", _state(1))
    nebulite.flush_persistence()
    assert _tag_dirs(store) == ["b"]
    rows = _history_rows(store)
    assert any(r["tag"] == "a" and r["outcome"] == "deleted_by_retention" for r in rows)


# -- history -----------------------------------------------------------------------------


def test_history_csv(store):
    nebulite.init(persistent_storage_path=store)
    c1 = nebulite.Checkpoint("step1", num_files=2)
    c1.save("model", _state(1))
    c1.save("optimizer", _state(2))
    nebulite.Checkpoint("step2").save("model", _state(3))
    nebulite.flush_persistence()

    path = os.path.join(store, "checkpointHistories.csv")
    assert os.path.isfile(path)
    with open(path, newline="") as f:
        assert f.readline().rstrip("\r\n") == HEADER
    rows = _history_rows(store)
    for r in rows:
        assert None not in r and None not in r.values(), r  # exactly 11 columns
        assert r["time_utc"].endswith("Z")
        int(r["rank"])
        int(r["bytes"])
        float(r["blocking_seconds"])
        float(r["persist_seconds"])
        float(r["throughput_mb_s"])

    objects = [r for r in rows if r["name"]]
    commits = [r for r in rows if r["outcome"] == "committed"]
    assert sorted((r["tag"], r["name"]) for r in objects) == [
        ("step1", "model"), ("step1", "optimizer"), ("step2", "model")]
    for r in objects:
        assert r["rank"] == "0"
        assert int(r["bytes"]) > 32 * 32 * 4
        assert r["tier"] == "persistent"
        assert r["outcome"] == "persisted"
    assert sorted(r["tag"] for r in commits) == ["step1", "step2"]
    versions = {r["tag"]: r["version"] for r in objects}
    for r in commits:
        assert r["version"] == versions[r["tag"]]

    in_process = nebulite.history()
    assert len(in_process) == len(rows)
    assert {(r["tag"], r["name"], r["outcome"]) for r in in_process} == {
        (r["tag"], r["name"], r["outcome"]) for r in rows}


def test_history_appends_across_sessions(store):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("a").save("model", _state(0))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("b").save("model", _state(1))
    nebulite.flush_persistence()
    with open(os.path.join(store, "checkpointHistories.csv")) as f:
        lines = f.read().splitlines()
    assert lines.count(HEADER) == 1
    assert lines[0] == HEADER
    committed = [r["tag"] for r in _history_rows(store) if r["outcome"] == "committed"]
    assert committed == ["a", "b"]


def test_history_without_store():
    nebulite.init()
    nebulite.Checkpoint("mem").save("model", _state(0))
    rows = nebulite.history()
    assert any(r["tag"] == "mem" and r["name"] == "model" for r in rows)


# -- persistent_time_interval --------------------------------------------------------------


def test_time_interval_skips_then_flush_persists(store):
    nebulite.init(persistent_storage_path=store, persistent_time_interval=3600,
                  num_of_version_in_retention=0)
    nebulite.Checkpoint("first").save("model", _state(1))
    nebulite.Checkpoint("second").save("model", _state(2))
    # Wait for the first one's background persistence without persisting the second.
    nebulite.api._session.engine.flush(60)

    listed = {c["tag"]: c for c in nebulite.list_checkpoints()}
    assert listed["second"]["tier"] == "memory"
    assert listed["second"]["persisted"] is False
    assert listed["first"]["persisted"] is True
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "second"
    assert latest.load("model")["step"] == 2

    assert "second" not in _tag_dirs(store)
    nebulite.api._reset_for_tests()
    stored = nebulite.get_latest_checkpoint(persist_path=store)
    assert stored.tag == "first"
    assert stored.load("model")["step"] == 1
    assert [c["tag"] for c in nebulite.list_checkpoints(persist_path=store)] == ["first"]


def test_time_interval_flush_persistence(store):
    nebulite.init(persistent_storage_path=store, persistent_time_interval=3600,
                  num_of_version_in_retention=0)
    nebulite.Checkpoint("first").save("model", _state(1))
    nebulite.Checkpoint("second").save("model", _state(2))
    nebulite.flush_persistence()
    assert {c["tag"]: c["persisted"] for c in nebulite.list_checkpoints()} == {
        "first": True, "second": True}
    nebulite.api._reset_for_tests()
    stored = nebulite.get_latest_checkpoint(persist_path=store)
    assert stored.tag == "second"
    assert stored.load("model")["step"] == 2
    assert [c["tag"] for c in nebulite.list_checkpoints(persist_path=store)] == ["second", "first"]


def test_time_interval_from_environment(store, monkeypatch):
    monkeypatch.setenv("NEBULA_PERSISTENT_TIME_INTERVAL", "3600")
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    for tag in ("a", "b", "c"):
        nebulite.Checkpoint(tag).save("model", _state(0))
    nebulite.api._session.engine.flush(60)  # pending persistence only
    persisted = {c["tag"]: c["persisted"] for c in nebulite.list_checkpoints()}
    assert persisted == {"a": True, "b": False, "c": False}


def test_time_interval_zero_persists_every_checkpoint(store):
    nebulite.init(persistent_storage_path=store, persistent_time_interval=0,
                  num_of_version_in_retention=0)
    for tag in ("a", "b", "c"):
        nebulite.Checkpoint(tag).save("model", _state(0))
    nebulite.api._session.engine.flush(60)
    assert _tag_dirs(store) == ["a", "b", "c"]

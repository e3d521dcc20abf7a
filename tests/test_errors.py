"""Typed errors, damaged stores and their fallbacks, unsafe pickles, a full disk."""

from __future__ import annotations

import glob
import os
import pickle
import subprocess
import threading
import warnings

import pytest
import torch

import nebulite
import nebulite._serialization
import nebulite.api
from nebulite import (
    CorruptCheckpointError,
    InvalidArgumentError,
    NebuliteError,
    NotFoundError,
    NotInitializedError,
    PersistError,
    StorageError,
    StorageFullError,
    UnsupportedVersionError,
)


class CustomState:
    """A user class: not allowed by weights_only loading unless registered."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CustomState) and other.value == self.value


def _state(value: float) -> dict:
    return {"w": torch.full((64, 64), float(value)), "step": int(value)}


def _data_file(store: str, tag: str, name: str = "model") -> str:
    (path,) = glob.glob(os.path.join(store, tag, "*", "rank0", name))
    return path


def _manifest(store: str, tag: str) -> str:
    (path,) = glob.glob(os.path.join(store, tag, "*", "rank0.manifest"))
    return path


def _two_persisted_tags(store: str) -> None:
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    nebulite.Checkpoint("good").save("model", _state(1))
    nebulite.Checkpoint("damaged").save("model", _state(2))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()


def _flip_bit(path: str, offset: int | None = None, bit: int = 0) -> None:
    data = bytearray(open(path, "rb").read())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 1 << bit
    with open(path, "wb") as f:
        f.write(data)


def _open_stored_handle(store: str, tag: str) -> nebulite.Checkpoint:
    """A handle on a stored version that bypasses get_checkpoint's verification."""
    (entry,) = [e for e in nebulite.api._store_entries(store) if e["tag"] == tag]
    return nebulite.api._handle(entry)


# -- initialisation and arguments ----------------------------------------------------


def test_save_before_init():
    with pytest.raises(NotInitializedError):
        nebulite.Checkpoint("t").save("model", _state(1))
    with pytest.raises(NotInitializedError):
        nebulite.Checkpoint("t", -2).commit()
    with pytest.raises(NotInitializedError):
        nebulite.flush_persistence()
    assert issubclass(NotInitializedError, NebuliteError)
    assert issubclass(NotInitializedError, RuntimeError)


BAD_COMPONENTS = ["../x", "/abs", "a/b", "x\x00y", "", ".", ".."]


@pytest.mark.parametrize("bad", BAD_COMPONENTS, ids=repr)
def test_invalid_tag(store, bad):
    nebulite.init(persistent_storage_path=store)
    with pytest.raises(InvalidArgumentError):
        nebulite.Checkpoint(bad).save("model", _state(1))
    assert not os.path.exists(os.path.join(os.path.dirname(store), "x"))


@pytest.mark.parametrize("bad", BAD_COMPONENTS, ids=repr)
def test_invalid_name(store, bad):
    nebulite.init(persistent_storage_path=store)
    ckpt = nebulite.Checkpoint("t", -2)
    with pytest.raises(InvalidArgumentError):
        ckpt.save(bad, _state(1))
    ckpt.save("model", _state(1))
    assert ckpt.commit() is True
    latest = nebulite.get_latest_checkpoint()
    with pytest.raises(InvalidArgumentError):
        latest.load(bad)
    nebulite.flush_persistence()
    with pytest.raises(InvalidArgumentError):
        nebulite.get_latest_checkpoint_path(bad, store)
    assert issubclass(InvalidArgumentError, ValueError)


def test_non_string_tag_and_name(store):
    nebulite.init(persistent_storage_path=store)
    with pytest.raises(InvalidArgumentError):
        nebulite.Checkpoint(5)
    with pytest.raises(InvalidArgumentError):
        nebulite.Checkpoint("t").save(b"model", _state(1))


def test_unusual_but_valid_names(store):
    nebulite.init(persistent_storage_path=store)
    names = ["mp_rank_00_model_states.pt", "with space", "unicodé", "last.ckpt", "a..b"]
    ckpt = nebulite.Checkpoint("global_step5", -2)
    for i, n in enumerate(names):
        ckpt.save(n, _state(i))
    ckpt.commit()
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert sorted(latest.list_names()) == sorted(names)
    for i, n in enumerate(names):
        assert latest.load(n)["step"] == i


def test_invalid_init_options(store):
    with pytest.raises(InvalidArgumentError):
        nebulite.init(persistent_storage_path=store, persistent_time_interval=-1)
    with pytest.raises(InvalidArgumentError):
        nebulite.init(persistent_storage_path=store, num_of_version_in_retention="many")
    with pytest.raises(InvalidArgumentError):
        nebulite.init(persistent_storage_path="")
    with pytest.raises(InvalidArgumentError):
        nebulite.init(persistent_storage_path="memory://bucket/run")  # no driver for it
    with pytest.warns(UserWarning, match="unknown options"):
        nebulite.init(persistent_storage_path=store, no_such_option=1)


@pytest.mark.parametrize("bad", [lambda: 1, threading.Lock()], ids=["lambda", "lock"])
def test_unpicklable_object(store, bad):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("before").save("model", _state(1))
    with pytest.raises(InvalidArgumentError, match="not picklable"):
        nebulite.Checkpoint("broken").save("model", {"w": torch.ones(3), "bad": bad})
    # The engine keeps working.
    assert nebulite.get_latest_checkpoint().tag == "before"
    nebulite.Checkpoint("after").save("model", _state(2))
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "after"
    assert latest.load("model")["step"] == 2
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    assert nebulite.get_latest_checkpoint(persist_path=store).tag == "after"


def test_unpicklable_save_then_retry_same_tag(store):
    nebulite.init(persistent_storage_path=store)
    with pytest.raises(InvalidArgumentError):
        nebulite.Checkpoint("t").save("model", {"bad": threading.Lock()})
    nebulite.Checkpoint("t").save("model", _state(3))
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "t"
    assert latest.list_names() == ["model"]
    assert latest.load("model")["step"] == 3


def test_failed_save_then_commit_does_not_commit_empty_checkpoint(store):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("good").save("model", _state(1))
    with pytest.raises(InvalidArgumentError):
        nebulite.Checkpoint("bad", -2).save("model", {"bad": threading.Lock()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nebulite.Checkpoint("bad", -2).commit()
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "good"
    assert latest.load("model")["step"] == 1


def test_persistent_path_under_a_regular_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError) as info:
        nebulite.init(persistent_storage_path=str(blocker / "sub"))
    assert isinstance(info.value, OSError)
    assert str(blocker) in str(info.value)
    # A failed init leaves no half-configured session behind.
    with pytest.raises(NotInitializedError):
        nebulite.Checkpoint("t").save("model", _state(1))


# -- not found -------------------------------------------------------------------------


def test_load_missing_name(store):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t").save("model", _state(1))
    latest = nebulite.get_latest_checkpoint()
    with pytest.raises(NotFoundError):
        latest.load("optimizer")
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    stored = nebulite.get_latest_checkpoint(persist_path=store)
    with pytest.raises(NotFoundError):
        stored.load("optimizer")
    assert issubclass(NotFoundError, LookupError)


def test_load_missing_tag(store):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t").save("model", _state(1))
    with pytest.raises(NotFoundError):
        nebulite.Checkpoint("nope").load("model")
    # A writing handle of a committed tag loads that tag.
    assert nebulite.Checkpoint("t").load("model")["step"] == 1


def test_load_uncommitted_tag(store):
    nebulite.init(persistent_storage_path=store)
    writer = nebulite.Checkpoint("pending", -2)
    writer.save("model", _state(1))
    with pytest.raises(NotFoundError):
        nebulite.Checkpoint("pending").load("model")
    writer.commit()
    assert nebulite.Checkpoint("pending").load("model")["step"] == 1


# -- damaged stores --------------------------------------------------------------------


def _assert_falls_back(store: str) -> None:
    with pytest.warns(UserWarning, match="damaged"):
        latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert latest.tag == "good"
    assert latest.load("model")["step"] == 1


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_data_file_falls_back(store, damage):
    _two_persisted_tags(store)
    path = _data_file(store, "damaged")
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 4000)
    else:
        _flip_bit(path)
    _assert_falls_back(store)

    with pytest.raises(CorruptCheckpointError) as info:
        _open_stored_handle(store, "damaged").load("model")
    assert os.path.relpath(path, store) in str(info.value)

    # Asking for the damaged tag by name: no intact version of it.
    nebulite.api._reset_for_tests()
    with pytest.warns(UserWarning, match="damaged"):
        assert nebulite.get_checkpoint(tag="damaged", persist_path=store).tag == ""
    # get_latest_checkpoint_path skips it too.
    nebulite.api._reset_for_tests()
    with pytest.warns(UserWarning, match="damaged"):
        path_good = nebulite.get_latest_checkpoint_path("model", store)
    assert torch.load(path_good)["step"] == 1


def test_bitflip_detected_by_handle_taken_before_damage(store):
    _two_persisted_tags(store)
    handle = nebulite.get_checkpoint(tag="damaged", persist_path=store)
    assert handle.tag == "damaged"
    path = _data_file(store, "damaged")
    _flip_bit(path)
    # Finding the checkpoint read and verified its file into the buffers of the first
    # load, so that load returns the intact bytes it verified...
    assert handle.load("model")["step"] == 2
    # ...and every later read of the file detects the damage.
    with pytest.raises(CorruptCheckpointError) as info:
        handle.load("model")
    assert os.path.relpath(path, store) in str(info.value)


def test_bitflip_in_pickle_record_detected(store):
    _two_persisted_tags(store)
    path = _data_file(store, "damaged")
    blob = open(path, "rb").read()
    offset = blob.index(b"collections")  # inside data.pkl
    _flip_bit(path, offset, bit=1)
    _assert_falls_back(store)
    with pytest.raises(CorruptCheckpointError):
        _open_stored_handle(store, "damaged").load("model")


def test_bitflip_in_manifest_falls_back(store):
    _two_persisted_tags(store)
    _flip_bit(_manifest(store, "damaged"), bit=2)
    _assert_falls_back(store)


def test_missing_data_file_falls_back(store):
    _two_persisted_tags(store)
    os.remove(_data_file(store, "damaged"))
    _assert_falls_back(store)


def test_uncommitted_version_in_store_is_invisible(store):
    _two_persisted_tags(store)
    (marker,) = glob.glob(os.path.join(store, "damaged", "*", "COMMITTED"))
    os.remove(marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert latest.tag == "good"
    assert [c["tag"] for c in nebulite.list_checkpoints(persist_path=store)] == ["good"]


def test_all_damaged_gives_empty_tag(store):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("only").save("model", _state(1))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    _flip_bit(_data_file(store, "only"))
    with pytest.warns(UserWarning, match="damaged"):
        assert nebulite.get_latest_checkpoint(persist_path=store).tag == ""


def test_newer_format_version_is_rejected(store, monkeypatch):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("old").save("model", _state(1))
    monkeypatch.setattr(nebulite._serialization, "FORMAT_VERSION", 2)
    nebulite.Checkpoint("future").save("model", _state(2))
    monkeypatch.setattr(nebulite._serialization, "FORMAT_VERSION", 1)

    with pytest.raises(UnsupportedVersionError, match="version 2"):
        nebulite.get_latest_checkpoint().load("model")
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert latest.tag == "future"
    with pytest.raises(UnsupportedVersionError) as info:
        latest.load("model")
    assert _data_file(store, "future") in str(info.value)
    assert isinstance(info.value, CorruptCheckpointError)
    assert nebulite.get_checkpoint(tag="old", persist_path=store).load("model")["step"] == 1


# -- weights_only ------------------------------------------------------------------------


@pytest.fixture
def _clean_safe_globals():
    yield
    torch.serialization.clear_safe_globals()


def test_weights_only_rejects_custom_class(store, _clean_safe_globals):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t").save("extra", {"obj": CustomState(7), "w": torch.ones(2)})
    for tier in ("memory", "store"):
        if tier == "store":
            nebulite.flush_persistence()
            nebulite.api._reset_for_tests()
        latest = nebulite.get_latest_checkpoint(persist_path=store)
        with pytest.raises(pickle.UnpicklingError, match="weights_only"):
            latest.load("extra")
        full = latest.load("extra", weights_only=False)
        assert full["obj"] == CustomState(7)
        assert torch.equal(full["w"], torch.ones(2))
        torch.serialization.add_safe_globals([CustomState])
        try:
            allowed = latest.load("extra")
            assert allowed["obj"] == CustomState(7)
        finally:
            torch.serialization.clear_safe_globals()


def test_weights_only_applies_to_torch_load_of_stored_file(store):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t").save("extra", {"obj": CustomState(3)})
    nebulite.flush_persistence()
    path = nebulite.get_latest_checkpoint_path("extra", store)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert torch.load(path, weights_only=False)["obj"] == CustomState(3)


# -- disk full ---------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {r.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        nebulite.api._reset_for_tests()
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill_disk(store: str) -> torch.Tensor:
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    small = torch.randn(256 * 1024)  # 1 MiB
    nebulite.Checkpoint("small").save("model", {"w": small})
    nebulite.flush_persistence()

    nebulite.Checkpoint("big").save("model", {"w": torch.randn(5 * 1024 * 1024)})  # 20 MiB
    with pytest.raises((StorageFullError, PersistError)) as info:
        nebulite.flush_persistence()
    assert "No space" in str(info.value)
    rows = nebulite.history()
    assert any(r["tag"] == "big" and r["outcome"].startswith("failed") for r in rows)
    assert any(r["tag"] == "small" and r["outcome"] == "committed" for r in rows)
    return small


def test_disk_full_during_persist(small_tmpfs):
    store = os.path.join(small_tmpfs, "ckpt")
    small = _fill_disk(store)
    nebulite.api._reset_for_tests()
    latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert latest.tag == "small"
    assert torch.equal(latest.load("model")["w"], small)
    assert nebulite.get_checkpoint(tag="big", persist_path=store).tag == ""
    with open(os.path.join(store, "checkpointHistories.csv")) as f:
        rows = [line for line in f.read().splitlines() if ",big," in line]
    assert rows and all("failed" in line for line in rows)


def test_disk_full_then_engine_recovers(small_tmpfs):
    store = os.path.join(small_tmpfs, "ckpt")
    small = _fill_disk(store)
    # The failure was reported once; a checkpoint that fits persists fine afterwards.
    nebulite.Checkpoint("after").save("model", {"w": torch.ones(1024)})
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    latest = nebulite.get_latest_checkpoint(persist_path=store)
    assert latest.tag == "after"
    assert torch.equal(latest.load("model")["w"], torch.ones(1024))
    assert torch.equal(nebulite.get_checkpoint(tag="small", persist_path=store).load("model")["w"], small)

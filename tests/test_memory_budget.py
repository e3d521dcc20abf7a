"""Checkpoints larger than the memory budget (NEBULA_MEMORY_BUFFER_SIZE), embedded and
through the node agent: what does not fit streams to the store, a failed save gives back
everything its checkpoint took, and a streamed checkpoint is readable once committed."""

from __future__ import annotations

import pytest
import torch

import nebulite
from nebulite.errors import InvalidArgumentError, MemoryBudgetError

MIB = 1 << 20
BUDGET = 8 * MIB


@pytest.fixture(params=["embedded", "agent"])
def mode(request):
    if request.param == "agent":
        request.getfixturevalue("agent_env")
    return request.param


def _init(mode: str, store: str | None, **more) -> None:
    nebulite.init(persistent_storage_path=store, agent=mode == "agent",
                  memory_buffer_size=BUDGET, persistent_time_interval=3600, **more)


def _state(mib: int, seed: int) -> dict:
    """About `mib` MiB of tensors whose every bit matters: random floats and integers."""
    g = torch.Generator().manual_seed(seed)
    n = mib * MIB // 8
    return {"f": torch.randn(n, generator=g),
            "i": torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g),
            "step": seed}


def _same(got: dict, want: dict) -> bool:
    return (got["step"] == want["step"] and torch.equal(got["f"], want["f"])
            and torch.equal(got["i"], want["i"]))


def _memory_used() -> int:
    return int(nebulite.session_info()["memory_used"])


def _save(tag: str, objects: dict[str, dict]) -> None:
    ckpt = nebulite.Checkpoint(tag, num_files=-2)
    for name, obj in objects.items():
        ckpt.save(name, obj)
    assert ckpt.commit()


def _expect_latest(tag: str, objects: dict[str, dict]) -> None:
    """Read-your-writes: the committed checkpoint is the latest, listed first, and loads."""
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == tag
    listed = nebulite.list_checkpoints()
    assert listed[0]["tag"] == tag and sorted(listed[0]["names"]) == sorted(objects)
    for name, obj in objects.items():
        assert _same(latest.load(name), obj), name
        assert _same(nebulite.get_checkpoint(tag).load(name), obj), name


def test_objects_that_fit_one_by_one_but_not_together_stream(mode, store):
    _init(mode, store)
    for step in range(3):  # every later checkpoint works too
        objects = {"model": _state(5, 10 * step), "optimizer": _state(5, 10 * step + 1)}
        _save(f"step{step}", objects)
        _expect_latest(f"step{step}", objects)
    nebulite.flush_persistence()
    nebulite.api._verified.clear()
    assert [e["tag"] for e in nebulite._core.read_catalog(store)[0]][-1] == "step2"
    assert _same(nebulite.get_checkpoint("step2").load("optimizer"), objects["optimizer"])


def test_a_state_larger_than_the_whole_budget_is_readable_once_committed(mode, store):
    _init(mode, store)
    small = {"model": _state(1, 1)}
    _save("before", small)
    objects = {"model": _state(2, 2), "optimizer": _state(12, 3)}  # 24 MiB > 8 MiB
    _save("big", objects)
    _expect_latest("big", objects)
    assert _same(nebulite.get_checkpoint("before").load("model"), small["model"])


def test_a_streamed_checkpoint_saved_with_num_files_is_readable_at_once(mode, store):
    _init(mode, store)
    objects = {"model": _state(5, 4), "optimizer": _state(5, 5)}
    ckpt = nebulite.Checkpoint("counted", num_files=2)
    for name, obj in objects.items():
        ckpt.save(name, obj)
    _expect_latest("counted", objects)


def test_a_save_over_the_budget_without_a_store_releases_its_checkpoint(mode):
    _init(mode, None)
    ckpt = nebulite.Checkpoint("failed", num_files=-2)
    ckpt.save("model", _state(5, 1))
    with pytest.raises(MemoryBudgetError):
        ckpt.save("optimizer", _state(5, 2))  # nowhere to stream it
    assert _memory_used() == 0  # the model saved before went back too
    with pytest.warns(UserWarning, match="nothing to commit"):
        assert not ckpt.commit()
    objects = {"model": _state(5, 3)}
    _save("next", objects)
    _expect_latest("next", objects)
    assert [e["tag"] for e in nebulite.list_checkpoints()] == ["next"]


def test_any_failed_save_releases_its_checkpoint(mode, store):
    _init(mode, store)
    ckpt = nebulite.Checkpoint("partial", num_files=-2)
    ckpt.save("model", _state(5, 1))  # in memory
    with pytest.raises(InvalidArgumentError):
        ckpt.save("optimizer", {"w": torch.ones(3), "f": lambda: None})  # cannot be pickled
    assert _memory_used() == 0
    objects = {"model": _state(5, 3), "optimizer": _state(5, 4)}
    _save("partial", objects)  # the same tag, a new version
    _expect_latest("partial", objects)
    assert [e["tag"] for e in nebulite.list_checkpoints()] == ["partial"]
    nebulite.flush_persistence()


def test_a_long_run_of_checkpoints_keeps_bookkeeping_bounded(mode, store):
    """What a session remembers of the versions it committed (get_latest_checkpoint_path
    waits for those still on their way to the store) follows what retention keeps, not
    every checkpoint since init(): a trainer that checkpoints every step for weeks would
    otherwise grow by one entry per checkpoint."""
    _init(mode, store, num_of_version_in_retention=1)
    for step in range(300):
        ck = nebulite.Checkpoint(f"step{step}")
        ck.save("state", {"step": step})
        assert ck.commit()
    remembered = len(nebulite.api._session.committed)
    assert remembered < 100, f"{remembered} versions remembered with a retention of 1"
    nebulite.flush_persistence()
    path = nebulite.get_latest_checkpoint_path("state")
    assert torch.load(path, weights_only=True) == {"step": 299}

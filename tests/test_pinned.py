"""The memory tier registered with CUDA (nebulite._pinned): the logic with a stand-in
driver on any machine, the real registration where CUDA is available."""

from __future__ import annotations

import pytest
import torch

import nebulite as nm
from nebulite import _pinned


class _Driver:
    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.calls = 0
        self.fail_at = fail_at

    def register(self, address: int, size: int) -> int:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((address, size))
        return 0

    def unregister(self, address: int) -> int:
        self.registered = [r for r in self.registered if r[0] != address]
        return 0


def test_a_range_is_registered_once_as_one_range_and_released():
    # One registration: CUDA refuses a copy whose host bytes span two of them.
    d = _Driver()
    r = _pinned.PinnedRange(1 << 30, (5 << 20) + 7, d.register, d.unregister)
    assert r.ensure() and r.pinned
    assert r.ensure()  # a second call registers nothing more
    assert d.calls == 1 and d.registered == [(1 << 30, (5 << 20) + 7)]
    r.release()
    assert d.registered == [] and not r.pinned
    r.release()  # nothing more to release


def test_a_refused_registration_leaves_the_range_pageable(caplog):
    d = _Driver(fail_at=1)
    r = _pinned.PinnedRange(0, 4 << 20, d.register, d.unregister)
    assert not r.ensure() and not r.pinned
    assert not r.ensure() and d.calls == 1  # not tried again
    assert d.registered == []
    assert "cudaHostRegister" in caplog.text
    r.release()  # nothing to release


@pytest.mark.parametrize("agent", [False, True])
def test_without_cuda_in_use_the_memory_tier_is_not_pinned(store, agent, request, monkeypatch):
    if agent:
        request.getfixturevalue("agent_env")
    monkeypatch.setenv("NEBULITE_AGENT", "1" if agent else "0")
    monkeypatch.setattr(_pinned, "cuda_in_use", lambda: False)
    nm.init(persistent_storage_path=store)
    nm.Checkpoint("a").save("m", {"w": torch.ones(4)})
    assert nm.session_info()["memory_pinned"] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("agent", [False, True])
def test_with_cuda_in_use_the_memory_tier_is_pinned(store, agent, request, monkeypatch):
    if agent:
        request.getfixturevalue("agent_env")
    monkeypatch.setenv("NEBULITE_AGENT", "1" if agent else "0")
    torch.zeros(1, device="cuda")  # CUDA initialised in this process
    nm.init(persistent_storage_path=store)
    assert nm.session_info()["memory_pinned"] is True
    w = torch.randn(1 << 20, device="cuda")
    nm.Checkpoint("a").save("m", {"w": w})
    assert torch.equal(nm.get_latest_checkpoint().load("m", map_location="cuda:0")["w"], w)
    nm.shutdown()  # unregistered before the memory is unmapped: no CUDA error after
    torch.cuda.synchronize()

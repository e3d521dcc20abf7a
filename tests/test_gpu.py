"""CUDA tensors round-trip (skipped on machines without a CUDA device)."""

from __future__ import annotations

import pytest
import torch

import nebulite as nm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_state_round_trips_through_both_tiers(store):
    nm.init(persistent_storage_path=store)
    model = torch.nn.Linear(64, 32).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    nm.Checkpoint("gpu").save("state", state)
    got = nm.get_latest_checkpoint().load("state")  # memory tier; default restores to CUDA
    assert got["model"]["weight"].device.type == "cuda"
    assert torch.equal(got["model"]["weight"], model.weight)
    nm.flush_persistence()
    nm.api._reset_for_tests()
    cpu = nm.get_latest_checkpoint(persist_path=store).load("state", map_location="cpu")
    assert cpu["model"]["weight"].device.type == "cpu"
    assert torch.equal(cpu["model"]["weight"], model.weight.cpu())
    exp = opt.state_dict()["state"][0]["exp_avg"].cpu()
    assert torch.equal(cpu["optimizer"]["state"][0]["exp_avg"], exp)


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]


def _cuda_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    state: dict = {}
    for dt in _DTYPES:
        if dt.is_floating_point or dt.is_complex:
            t = torch.randn(257, 33, device="cuda", generator=g).to(dt)
        elif dt == torch.bool:
            t = torch.rand(257, 33, device="cuda", generator=g) > 0.5
        else:
            t = torch.randint(0, 100, (257, 33), device="cuda", generator=g).to(dt)
        state[str(dt)] = t
    base = torch.randn(1 << 20, device="cuda", generator=g)  # 4 MiB, shared by three views
    state["view"] = base[1024:2048].view(32, 32)
    state["transposed"] = base[:4096].view(64, 64).t()  # non-contiguous
    state["strided"] = base[::3]
    state["base"] = base
    return state


def _assert_bit_exact(got: dict, want: dict) -> None:
    for k, t in want.items():
        g = got[k]
        assert g.device == t.device and g.dtype == t.dtype and g.shape == t.shape, k
        assert g.stride() == t.stride(), k
        assert torch.equal(g.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), k
    # views of one storage still share it
    ptr = got["base"].untyped_storage().data_ptr()
    for k in ("view", "transposed", "strided"):
        assert got[k].untyped_storage().data_ptr() == ptr, k


@pytest.mark.parametrize("agent", [False, True], ids=["embedded", "agent"])
@pytest.mark.parametrize("async_staging", [False, True], ids=["blocking", "async"])
def test_cuda_state_is_bit_exact_in_every_mode(store, agent, async_staging, request, monkeypatch):
    if agent:
        request.getfixturevalue("agent_env")
    monkeypatch.setenv("NEBULITE_AGENT", "1" if agent else "0")
    nm.init(persistent_storage_path=store, async_staging=async_staging, persistent_time_interval=0)
    state = _cuda_state()
    nm.Checkpoint("s").save("state", state)
    nm.wait_staged()
    _assert_bit_exact(nm.get_latest_checkpoint().load("state", map_location="cuda:0"), state)
    nm.flush_persistence()
    nm.api._reset_for_tests()
    got = nm.get_latest_checkpoint(persist_path=store).load("state", map_location="cuda:0")
    _assert_bit_exact(got, state)


@pytest.mark.parametrize("agent", [False, True], ids=["embedded", "agent"])
def test_an_optimizer_step_right_after_an_async_save_keeps_the_saved_values(store, agent, request,
                                                                            monkeypatch):
    if agent:
        request.getfixturevalue("agent_env")
    monkeypatch.setenv("NEBULITE_AGENT", "1" if agent else "0")
    nm.init(persistent_storage_path=store, async_staging=True, num_of_version_in_retention=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.randn(4, 2048, device="cuda")).square().mean().backward()
    opt.step()
    opt.step()
    expected = {}
    for k in range(3):
        expected[k] = {n: t.clone() for n, t in model.state_dict().items()}
        ck = nm.Checkpoint(f"s{k}", 2)
        ck.save("model", model.state_dict())
        ck.save("optimizer", opt.state_dict())
        opt.step()  # issued at once: changes every weight on the device
    for k, state in expected.items():
        got = nm.get_checkpoint(tag=f"s{k}").load("model", map_location="cuda:0")
        for n, t in state.items():
            assert torch.equal(got[n], t), (k, n)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_load_maps_to_the_device_asked_for(store):
    nm.init(persistent_storage_path=store)
    w = torch.randn(1000, device="cuda:0")
    nm.Checkpoint("m").save("m", {"w": w})
    got = nm.get_latest_checkpoint().load("m", map_location="cuda:1")["w"]
    assert got.device == torch.device("cuda:1") and torch.equal(got.cpu(), w.cpu())

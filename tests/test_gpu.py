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

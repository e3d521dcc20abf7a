"""CUDA tensors: staged by DMA, loaded straight to the device, in every mode and through
DeepSpeed and Lightning (skipped on machines without a CUDA device; the device-independent
logic is tested on the CPU in tests/test_device.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

import nebulite as nm
from nebulite import _device, _serialization
from nebulite.errors import TornCheckpointError

from conftest import wait_ranks
from test_device import save_each_step_and_check

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
    # Each step is issued at once after the saves: it changes every weight on the device.
    save_each_step_and_check(model, opt, opt.step, map_location="cuda:0")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_load_maps_to_the_device_asked_for(store):
    nm.init(persistent_storage_path=store)
    w = torch.randn(1000, device="cuda:0")
    nm.Checkpoint("m").save("m", {"w": w})
    got = nm.get_latest_checkpoint().load("m", map_location="cuda:1")["w"]
    assert got.device == torch.device("cuda:1") and torch.equal(got.cpu(), w.cpu())


# -- device-to-host staging (nebulite._device) --------------------------------------------


def test_a_cuda_state_is_staged_by_dma_never_through_pageable_memory(store, monkeypatch):
    nm.init(persistent_storage_path=store)
    state = _cuda_state()

    def no_pageable_copy(self, *args, **kwargs):
        raise AssertionError("a CUDA storage was copied to pageable memory")

    monkeypatch.setattr(torch.UntypedStorage, "cpu", no_pageable_copy)
    records = _serialization.flatten(state, tag="t", name="s", rank=0, version="v")
    assert records.device_copies and len(records.on_device) == len(
        {t.untyped_storage().data_ptr() for t in state.values()})
    nm.Checkpoint("dma").save("state", state)
    nm.Checkpoint("dma-again").save("state", state)  # the plan of the first save is reused
    monkeypatch.undo()
    _assert_bit_exact(nm.get_latest_checkpoint().load("state"), state)
    assert nm.session_info()["memory_pinned"]


@pytest.mark.parametrize("async_staging", [False, True], ids=["blocking", "async"])
def test_a_storage_larger_than_a_chunk_is_copied_in_chunks(store, async_staging, monkeypatch):
    nm.init(persistent_storage_path=store, async_staging=async_staging)
    copied: list[int] = []
    original = _device.CudaBackend.copy

    def copy(self, stream, pairs):
        copied.extend(int(src.numel()) for _, src in pairs)
        original(self, stream, pairs)

    monkeypatch.setattr(_device.CudaBackend, "copy", copy)
    big = torch.randn((_device.CHUNK_BYTES + (1 << 20)) // 4 + 3, device="cuda")
    nm.Checkpoint("big").save("big", {"big": big})
    assert max(copied) <= _device.CHUNK_BYTES and sum(copied) == big.untyped_storage().nbytes()
    assert len(copied) == 2
    got = nm.get_latest_checkpoint().load("big", map_location="cuda:0")["big"]
    assert torch.equal(got, big)


def test_loads_restore_cuda_tensors_from_the_memory_tier_without_a_host_buffer(store, monkeypatch):
    nm.init(persistent_storage_path=store)
    state = _cuda_state()
    nm.Checkpoint("m").save("state", state)

    def no_host_buffer(nbytes):
        raise AssertionError("a record went through a host buffer")

    monkeypatch.setattr(_serialization, "new_buffer", no_host_buffer)
    _assert_bit_exact(nm.get_latest_checkpoint().load("state"), state)  # where it was saved
    _assert_bit_exact(nm.get_latest_checkpoint().load("state", map_location="cuda:0"), state)
    _assert_bit_exact(nm.get_latest_checkpoint().load("state", map_location=torch.device("cuda")),
                      state)
    monkeypatch.undo()
    cpu = nm.get_latest_checkpoint().load("state", map_location="cpu")
    assert all(t.device.type == "cpu" and torch.equal(t, state[k].cpu()) for k, t in cpu.items())


@pytest.mark.parametrize("agent", [False, True], ids=["embedded", "agent"])
def test_async_staging_commits_only_once_the_bytes_landed(store, agent, request, monkeypatch):
    if agent:
        request.getfixturevalue("agent_env")
    monkeypatch.setenv("NEBULITE_AGENT", "1" if agent else "0")
    gate = threading.Event()
    original = _device.CudaBackend.synchronize

    def synchronize(self, event):
        assert gate.wait(600)
        original(self, event)

    monkeypatch.setattr(_device.CudaBackend, "synchronize", synchronize)
    nm.init(persistent_storage_path=store, async_staging=True)
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(4, 1024, device="cuda")).sum().backward()
    opt.step()
    want = model.weight.detach().clone()
    nm.Checkpoint("held").save("model", model.state_dict())  # returns: nothing waits on the host
    opt.step()  # ordered after the copies on the device
    assert not any(v["tag"] == "held" for v in nm.api._session.engine.versions()) or gate.is_set()
    gate.set()
    got = nm.get_checkpoint(tag="held").load("model", map_location="cuda:0")
    assert torch.equal(got["weight"], want) and not torch.equal(got["weight"], model.weight)


def test_an_async_save_of_safe_cuda_state_leaves_its_copies_to_the_staging_thread(
        store, monkeypatch):
    issued_on: set[str] = set()
    original = _device.CudaBackend.copy

    def copy(self, stream, pairs):
        issued_on.add(threading.current_thread().name)
        original(self, stream, pairs)

    monkeypatch.setattr(_device.CudaBackend, "copy", copy)
    nm.init(persistent_storage_path=store, async_staging=True, num_of_version_in_retention=0)
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    model(torch.randn(4, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.step()  # the state the first step made is known to be safe from now on
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ck = nm.Checkpoint("scanned", 2)
    ck.save("model", model.state_dict())
    ck.save("optimizer", opt.state_dict())
    opt.step()  # ordered after the copies on the device
    assert issued_on == {"nebulite-stager"}
    got = nm.get_checkpoint(tag="scanned").load("model", map_location="cuda:0")
    for k, t in want.items():
        assert got[k].device == t.device and torch.equal(got[k], t), k
    # A CUDA buffer (which forward may change) is copied before save() returns, from here.
    issued_on.clear()
    bn = torch.nn.BatchNorm1d(16).cuda()
    nm.Checkpoint("buffer").save("model", {"weight": model.weight, "mean": bn.running_mean})
    assert issued_on == {threading.current_thread().name}
    nm.wait_staged()


def test_async_staging_detects_a_cuda_tensor_changed_before_the_barrier(store):
    nm.init(persistent_storage_path=store, async_staging=True)
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(4, 1024, device="cuda")).sum().backward()
    opt.step()
    nm.Checkpoint("torn").save("model", model.state_dict())
    with torch.no_grad():
        model.weight.add_(1)  # races with the copy: not allowed with async_staging
    with pytest.raises(TornCheckpointError, match="weight"):
        nm.wait_staged()
    assert nm.get_checkpoint(tag="torn").tag == ""


@pytest.mark.parametrize("async_staging", [False, True], ids=["blocking", "async"])
def test_cpu_and_cuda_tensors_of_one_object_round_trip(store, async_staging):
    nm.init(persistent_storage_path=store, async_staging=async_staging)
    state = {"gpu": torch.randn(1 << 18, device="cuda"), "cpu": torch.randn(1 << 18),
             "step": 7, "view": None}
    state["view"] = state["gpu"][5:100]
    nm.Checkpoint("mixed").save("state", state)
    got = nm.get_latest_checkpoint().load("state")
    assert got["gpu"].device.type == "cuda" and got["cpu"].device.type == "cpu"
    assert torch.equal(got["gpu"], state["gpu"]) and torch.equal(got["cpu"], state["cpu"])
    assert torch.equal(got["view"], state["view"]) and got["step"] == 7
    nm.flush_persistence()
    got = torch.load(nm.get_latest_checkpoint_path("state"), map_location="cuda:0", weights_only=True)
    assert torch.equal(got["gpu"], state["gpu"]) and torch.equal(got["cpu"].cpu(), state["cpu"])


# -- DeepSpeed and Lightning on the GPU ------------------------------------------------------

WORKER = os.path.join(os.path.dirname(__file__), "workers", "gpu_worker.py")
_WORLDS = [1, pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                        reason="needs two CUDA devices"))]


def _launch(mode: str, workdir, world: int) -> list[dict]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(nm.__file__)))
    env = dict(os.environ, NEBULITE_AGENT="0", OMP_NUM_THREADS="1", DS_ACCELERATOR="cuda",
               PYTHONPATH=os.pathsep.join([pkg_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    for key in ("NEBULITE_RUN_ID", "NEBULA_PERSISTENT_STORAGE_PATH", "NEBULA_PERSISTENT_TIME_INTERVAL"):
        env.pop(key, None)
    procs = [subprocess.Popen([sys.executable, WORKER, mode, str(workdir), str(r), str(world), str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = [out for out, _ in wait_ranks(procs)]
    failed = [f"rank {r} exited {p.returncode}:\n{log[-4000:]}" for r, (p, log) in enumerate(zip(procs, logs))
              if p.returncode]
    assert not failed, "\n".join(failed)
    results = []
    for r, log in enumerate(logs):
        lines = [line for line in log.splitlines() if line.startswith("RESULT ")]
        assert lines, f"rank {r} printed no result:\n{log[-4000:]}"
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


@pytest.mark.parametrize("world", _WORLDS)
def test_deepspeed_zero_1_to_3_with_the_nebula_block(tmp_path, world):
    pytest.importorskip("deepspeed.runtime.checkpoint_engine.nebula_checkpoint_engine",
                        reason="needs DeepSpeed with its Nebula engine")
    for r in _launch("deepspeed", tmp_path, world):
        for stage in (1, 2, 3):
            got = r[f"z{stage}"]
            assert got["engine"] == "NebulaCheckpointEngine", (stage, got)
            assert got["device"].startswith("cuda"), (stage, got)
            assert got["loaded"] == "ok", (stage, r["rank"], got["loaded"])
    for stage in (1, 2, 3):
        entries, problems = nm._core.read_catalog(str(tmp_path / f"z{stage}" / "nebula"))
        assert not problems and {e["tag"] for e in entries} >= {"global_step2", "global_step4"}


def _check_lightning(results: list[dict]) -> None:
    first = next(r for r in results if r["rank"] == 0)
    assert first["paths"] and "last.ckpt" in first["paths"]
    assert first["loaded_device"] == ["cuda:0"]
    end = first["end_weights"]
    assert {k: first["loaded_weights"][k] for k in end} == end
    assert end != first["start_weights"]


@pytest.mark.parametrize("world", _WORLDS)
def test_lightning_ddp_with_nebula_checkpoint_io(tmp_path, world):
    pytest.importorskip("lightning")
    _check_lightning(_launch("ddp", tmp_path, world))


@pytest.mark.parametrize("world", _WORLDS)
def test_lightning_nebula_deepspeed_strategy(tmp_path, world):
    pytest.importorskip("lightning")
    pytest.importorskip("deepspeed.runtime.checkpoint_engine.nebula_checkpoint_engine",
                        reason="needs DeepSpeed with its Nebula engine")
    _check_lightning(_launch("lightning_deepspeed", tmp_path, world))

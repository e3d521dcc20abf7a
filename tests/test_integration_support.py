"""API behaviours the framework integrations rely on: a single-rank session inside a
torch.distributed job, loading one version of a tag, paths of checkpoints still being
persisted, torch's weights_only switches, and Azure's documented init() spelling."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import JOB_TIMEOUT, wait_ranks
import torch

import nebulite
import nebulite.api


class Opaque:
    """A user class: not allowed by weights_only loading."""

    def __init__(self, value: int) -> None:
        self.value = value


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_single_rank_session_never_waits_for_the_other_ranks(store):
    """Lightning saves on global rank 0 alone: a session initialised there with
    world_size=1 must commit without any collective, while rank 1 does something else."""
    code = textwrap.dedent(f"""
        import datetime, sys, torch, torch.distributed as dist
        import nebulite
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{_free_port()}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=60))
        if rank == 0:
            nebulite.init(persistent_storage_path={store!r}, rank=0, world_size=1)
            for step in range(3):
                nebulite.Checkpoint(f"step{{step}}").save("state", {{"w": torch.full((3,), float(step))}})
            nebulite.flush_persistence()
            print("TAG", nebulite.get_latest_checkpoint().tag)
        dist.barrier()  # rank 1 waits here the whole time: no collective may be pending
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = wait_ranks(procs, JOB_TIMEOUT)
    failed = [f"rank {r}:\n{err[-3000:]}" for r, (p, (_, err)) in enumerate(zip(procs, outs)) if p.returncode]
    assert not failed, "\n".join(failed)
    assert "TAG step2" in outs[0][0]
    committed = [e["tag"] for e in nebulite._core.read_catalog(store)[0]]
    assert committed == ["step1", "step2"]  # retention 2


def test_get_checkpoint_of_one_version(store):
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    for value in (1.0, 2.0):
        nebulite.Checkpoint("last").save("state", {"w": torch.full((2,), value)})
    nebulite.flush_persistence()
    versions = [e["version"] for e in nebulite.list_checkpoints() if e["tag"] == "last"]
    assert len(versions) == 2  # newest first
    newest, older = versions
    assert nebulite.get_checkpoint(tag="last").version == newest
    got = nebulite.get_checkpoint(tag="last", version=older)
    assert got.version == older and torch.equal(got.load("state")["w"], torch.full((2,), 1.0))
    assert nebulite.get_checkpoint(tag="last", version="v000000000000-999999").tag == ""
    with pytest.raises(nebulite.InvalidArgumentError):
        nebulite.get_checkpoint(version=older)


def test_get_latest_checkpoint_path_waits_for_checkpoints_on_their_way(store):
    nebulite.init(persistent_storage_path=store, persistent_time_interval=0)
    for step in range(3):
        nebulite.Checkpoint(f"step{step}").save("checkpoint", {"step": step, "w": torch.randn(1 << 16)})
    # No flush: the newest is still being persisted when the path is asked for.
    path = nebulite.get_latest_checkpoint_path("checkpoint", store)
    assert torch.load(path)["step"] == 2


@pytest.mark.parametrize("switch", ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD"])
def test_load_follows_torch_weights_only_switches(store, monkeypatch, switch):
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("t").save("obj", {"o": Opaque(5)})
    latest = nebulite.get_latest_checkpoint()
    with pytest.raises(pickle.UnpicklingError):
        latest.load("obj")  # torch.load's default: weights only
    monkeypatch.setenv(switch, "1")
    if switch == "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD":
        assert latest.load("obj")["o"].value == 5  # an unset weights_only becomes False
        with pytest.raises(pickle.UnpicklingError):
            latest.load("obj", weights_only=True)  # an explicit one stands
    else:
        with pytest.raises(pickle.UnpicklingError):
            latest.load("obj", weights_only=False)  # forced


def test_init_accepts_azures_documented_spelling(tmp_path):
    # Azure's example reads `persistent_storage_path="/tmp/test",` (a one-element tuple).
    persistent_storage_path = str(tmp_path / "test"),
    nebulite.init(persistent_storage_path, persistent_time_interval=2)
    assert nebulite.session_info()["persistent_storage_path"] == str(tmp_path / "test")

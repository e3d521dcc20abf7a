"""The node agent among hostile or broken neighbours: a stopped agent, a same-user client
sending absurd numbers, clients that come and go with new ranks, another user's files in
the runtime directory or on the store's lock files."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
import types
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch

import nebulite
from nebulite import errors
from nebulite._config import Config
from nebulite.agent import client, protocol

from conftest import kill_agents_of


@pytest.fixture
def tmp_base(monkeypatch):
    """$TMPDIR for the runtime directory's default place (short: socket paths are
    limited), with neither NEBULITE_RUNTIME_DIR nor XDG_RUNTIME_DIR set."""
    tmp = Path(tempfile.mkdtemp(prefix="nbtmp-"))
    monkeypatch.delenv("NEBULITE_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp))
    yield tmp
    nebulite.api._reset_for_tests()
    for d in tmp.glob("nebulite-*"):
        if d.is_dir() and not d.is_symlink():
            kill_agents_of(d)
    shutil.rmtree(tmp, ignore_errors=True)


def _taken(path: Path, how: str) -> None:
    """Makes `path` a directory that must not be used: open to others, a symlink to a
    private directory, or (as root) another user's."""
    if how == "mode":
        path.mkdir()
        os.chmod(path, 0o777)
    elif how == "symlink":
        target = path.parent / "elsewhere"
        target.mkdir(mode=0o700)
        path.symlink_to(target)
    else:
        path.mkdir(mode=0o700)
        os.chown(path, 65534, 65534)


@pytest.mark.parametrize("how", ["mode", "symlink"] + (["owner"] if os.getuid() == 0 else []))
def test_a_runtime_directory_taken_by_someone_else_is_passed_over(tmp_base, store, how):
    base = tmp_base / f"nebulite-{os.getuid()}"
    _taken(base, how)
    before = os.lstat(base)
    chosen = client.runtime_dir()
    assert chosen == f"{base}.1"
    st = os.lstat(chosen)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.getuid()
    after = os.lstat(base)  # left as it was
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)
    assert client.runtime_dir() == chosen  # every process finds the same one
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    nebulite.Checkpoint("a").save("x", torch.ones(10))
    assert nebulite.get_latest_checkpoint().load("x").sum() == 10
    assert any(Path(chosen).glob("agent-*.sock"))


def test_the_runtime_directory_is_under_xdg_runtime_dir_when_set(tmp_base, monkeypatch):
    xdg = tmp_base / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert client.runtime_dir() == str(xdg / "nebulite")
    assert stat.S_IMODE(os.lstat(xdg / "nebulite").st_mode) == 0o700


def _save_in_thread(tag: str) -> list:
    """Saves a checkpoint on a thread; the list gets its outcome (None or the exception)."""
    outcome: list = []

    def run() -> None:
        try:
            nebulite.Checkpoint(tag).save("x", torch.ones(10))
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=120)  # a bound on a hang, not a timing: the deadline is 1 s
    if t.is_alive():
        outcome.append(TimeoutError("save() still blocked"))
    return outcome


def _stop(pid: int) -> None:
    """Stops process `pid` (SIGSTOP) and returns once every thread of it has stopped: the
    signal takes effect asynchronously, and a thread still running could answer one more
    request."""
    os.kill(pid, signal.SIGSTOP)

    def stopped(tid: str) -> bool:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] in ("T", "t")
        except FileNotFoundError:  # the thread ended
            return True

    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    while not all(stopped(tid) for tid in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, f"agent {pid} did not stop"
        time.sleep(0.001)


@pytest.mark.parametrize("fallback", [False, True])
def test_a_stopped_agent_fails_save_with_agent_lost(agent_env, store, fallback):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20,
                  agent_fallback=fallback)
    pid = nebulite.api._session.engine.agent_pid
    nebulite.Checkpoint("before").save("x", torch.ones(10))
    # A deadline of 1 s only while the agent is stopped: a live agent on a busy machine may
    # take longer than that to answer, and must not count as lost.
    nebulite.api._session.engine._timeout = 1.0
    _stop(pid)
    try:
        outcome = _save_in_thread("during")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert len(outcome) == 1 and isinstance(outcome[0], errors.AgentLostError), outcome
    message = str(outcome[0])
    assert f"pid {pid}" in message and "stopped" in message and "agent=False" in message
    if not fallback:
        with pytest.raises(errors.AgentLostError):  # and every later call, at once
            nebulite.Checkpoint("after").save("x", torch.ones(10))
        return
    with pytest.warns(RuntimeWarning, match="embedded"):
        nebulite.Checkpoint("after").save("x", torch.full((10,), 2.0))
    assert nebulite.api._session.engine.__class__.__name__ == "Engine"
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "after" and torch.equal(latest.load("x"), torch.full((10,), 2.0))
    nebulite.flush_persistence()
    assert "after" in [e["tag"] for e in nebulite._core.read_catalog(store)[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning only
        nebulite.Checkpoint("later").save("x", torch.ones(10))


@pytest.mark.parametrize("text,value", [("1", True), ("yes", True), ("False", False),
                                        ("no", False), ("0", False)])
def test_agent_fallback_is_parsed_strictly(monkeypatch, text, value):
    monkeypatch.setenv("NEBULITE_AGENT_FALLBACK", text)
    assert Config.resolve(None, None, None, {}).agent_fallback is value


@pytest.mark.parametrize("text", ["on", "2", "", "maybe"])
def test_agent_fallback_refuses_anything_else(monkeypatch, text):
    monkeypatch.setenv("NEBULITE_AGENT_FALLBACK", text)
    with pytest.raises(errors.InvalidArgumentError):
        Config.resolve(None, None, None, {})


def test_the_agent_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("NEBULITE_AGENT_TIMEOUT", "2.5")
    assert Config.resolve(None, None, None, {}).agent_timeout == 2.5
    monkeypatch.setenv("NEBULITE_AGENT_TIMEOUT", "0")
    with pytest.raises(errors.InvalidArgumentError):
        Config.resolve(None, None, None, {})


class _Raw:
    """A same-user client speaking the protocol by hand to the agent of `store`."""

    def __init__(self, store: str, rank: int = 0, world_size: int = 1) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(client.socket_path(store))
        self.reply = self.request({"op": "hello", "version": protocol.VERSION, "rank": rank,
                                   "world_size": world_size})

    def request(self, message: dict) -> dict:
        protocol.send(self.sock, message)
        reply, fds = protocol.recv(self.sock, with_fds=True)
        for fd in fds:
            os.close(fd)
        return reply

    def close(self) -> None:
        self.sock.close()


def test_a_commit_number_at_the_end_of_the_range_harms_no_later_trainer(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20,
                  persistent_time_interval=3600)
    nebulite.Checkpoint("first").save("x", torch.ones(10))
    hostile = _Raw(store)
    key = {"tag": "evil", "version": "v1", "name": "x"}
    assert hostile.request(dict(key, op="reserve", records=[["data.pkl", 16]]))["ok"]
    assert hostile.request(dict(key, op="seal", crcs=[0]))["ok"]
    reply = hostile.request({"op": "commit", "tag": "evil", "version": "v1",
                             "seq": (1 << 63) - 1, "persist": False})
    assert reply["ok"], reply
    hostile.close()
    nebulite.shutdown()
    # Every later trainer of this agent goes on, and its checkpoints are the newest.
    for tag in ("second", "third"):
        nebulite.init(persistent_storage_path=store, agent=True, persistent_time_interval=0)
        nebulite.Checkpoint(tag).save("x", torch.full((10,), 2.0))
        nebulite.flush_persistence()
        assert nebulite.get_latest_checkpoint().tag == tag
        nebulite.shutdown()
    nebulite.init(persistent_storage_path=store, agent=True)
    seqs = {e["tag"]: e["seq"] for e in nebulite.list_checkpoints()}
    assert seqs["second"] < seqs["third"] and all(v < 1 << 32 for v in seqs.values()), seqs
    assert nebulite._core.newest_claimed_seq(store) < 1 << 32


def test_numbers_out_of_bounds_get_an_error_and_the_agent_serves_on(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    for hello in ({"rank": 0, "world_size": 1 << 40}, {"rank": 5, "world_size": 5},
                  {"rank": -1, "world_size": 2}):
        c = _Raw(store, **hello)
        assert c.reply["ok"] is False and c.reply["error"]["type"] == "InvalidArgumentError"
        c.close()
    c = _Raw(store)
    for bad in ({"op": "adopt", "tag": "t", "version": "v", "name": "x", "size": 1,
                 "crc32": 1 << 40},
                {"op": "flush", "timeout": -1},
                {"op": "unpin", "lease": -1},
                {"op": "reserve", "tag": "t", "version": "v", "name": "x",
                 "records": [["a", 1 << 64]]}):
        reply = c.request(bad)
        assert reply["ok"] is False and reply["error"]["type"] == "InvalidArgumentError", reply
    assert c.request({"op": "memory"})["ok"]
    c.close()
    nebulite.Checkpoint("a").save("x", torch.ones(10))
    assert nebulite.get_latest_checkpoint().load("x").sum() == 10


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_engines_of_departed_trainers_are_released(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    pid = nebulite.api._session.engine.agent_pid
    nebulite.Checkpoint("a").save("x", torch.ones(10))
    nebulite.flush_persistence()
    baseline = _threads(pid)
    for world in range(2, 12):
        c = _Raw(store, rank=world - 1, world_size=world)
        assert c.reply["ok"], c.reply
        c.close()
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    while _threads(pid) > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _threads(pid) <= baseline
    nebulite.Checkpoint("b").save("x", torch.ones(10))  # the trainer's own engine serves on
    assert nebulite.get_latest_checkpoint().tag == "b"


def _model_and_step() -> tuple[torch.nn.Module, Callable[[], None]]:
    """A model and a training step of it (SGD with momentum: the optimizer has state)."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    return model, step


@pytest.mark.parametrize("fallback", [False, True])
def test_an_agent_stopped_between_checkpoints_fails_the_next_one_not_the_step(agent_env, store,
                                                                             fallback):
    """With asynchronous staging a save may return before anything asked the agent: an agent
    stopped since the last checkpoint is found by the staging thread. That checkpoint fails;
    the optimizer's step raises nothing; the next call raises AgentLostError, or, with
    agent_fallback, switches to the embedded engine and reports the failed checkpoint, and
    the saves after it go on there."""
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20,
                  async_staging=True, agent_fallback=fallback)
    model, step = _model_and_step()

    step()
    step()
    nebulite.Checkpoint("before").save("model", model.state_dict())
    step()
    nebulite.flush_persistence()
    pid = nebulite.api._session.engine.agent_pid
    nebulite.api._session.engine._timeout = 1.0  # see the test above
    _stop(pid)
    try:
        nebulite.Checkpoint("during").save("model", model.state_dict())
        step()  # its barrier: the staging thread found the agent lost
    finally:
        os.kill(pid, signal.SIGCONT)
    if not fallback:
        with pytest.raises(errors.AgentLostError):
            nebulite.Checkpoint("after").save("model", model.state_dict())
        return
    with pytest.warns(RuntimeWarning, match="embedded"):
        with pytest.raises(errors.PersistError, match="'during'.*has not answered 'reserve'"):
            nebulite.Checkpoint("after").save("model", model.state_dict())
    nebulite.Checkpoint("after").save("model", model.state_dict())
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    step()
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "after"
    for k, v in expected.items():
        assert torch.equal(latest.load("model")[k], v), k


@pytest.mark.parametrize("fallback", [False, True])
def test_an_agent_stopped_while_it_seals_deferred_copies_fails_the_checkpoint_not_the_step(
        agent_env, store, monkeypatch, fallback):
    """An object that save() stages on the caller's thread (one the scan does not take: here
    it holds a types.SimpleNamespace, a class defined in C) leaves the copies of its optimizer-held storages, and its
    seal, to the client's copy thread. The agent stops while that thread seals: the step's
    barrier raises nothing; that checkpoint fails, and the next call says so (AgentLostError,
    or, with agent_fallback, PersistError naming the checkpoint once the embedded engine took
    over; the saves after it go on there)."""
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20,
                  async_staging=True, agent_fallback=fallback)
    model, step = _model_and_step()

    def state() -> dict:
        return {"model": model.state_dict(), "args": types.SimpleNamespace(lr=0.1)}

    step()
    step()
    assert nebulite._staging.scan(state()) is None  # staged on the caller's thread
    nebulite.Checkpoint("before").save("state", state())
    step()
    nebulite.flush_persistence()
    engine = nebulite.api._session.engine
    pid = engine.agent_pid
    engine._timeout = 1.0  # see the tests above
    copy_many = client._core.copy_many
    saved = threading.Event()
    stopped = []

    def stop_then_copy(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            return copy_many(*args, **kwargs)  # the copies save() makes itself
        saved.wait(60)  # a bound on a hang, not a timing
        _stop(pid)  # once save() returned, before the seal
        stopped.append(pid)
        return copy_many(*args, **kwargs)

    monkeypatch.setattr(client._core, "copy_many", stop_then_copy)
    try:
        nebulite.Checkpoint("during").save("state", state())
        saved.set()
        step()  # its barrier waits for the seal, which found the agent lost
    finally:
        saved.set()
        if stopped:
            os.kill(pid, signal.SIGCONT)
        monkeypatch.setattr(client._core, "copy_many", copy_many)
    assert stopped, "the copies were not deferred to the client's thread"
    if not fallback:
        with pytest.raises(errors.AgentLostError):
            nebulite.Checkpoint("after").save("state", state())
        return
    with pytest.warns(RuntimeWarning, match="embedded"):
        with pytest.raises(errors.PersistError, match="'during'.*has not answered 'seal'"):
            nebulite.Checkpoint("after").save("state", state())
    nebulite.Checkpoint("after").save("state", state())
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    step()
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "after"
    loaded = latest.load("state", weights_only=False)  # it holds a SimpleNamespace
    assert loaded["args"].lr == 0.1
    for k, v in expected.items():
        assert torch.equal(loaded["model"][k], v), k

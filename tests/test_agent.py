"""The node agent (init(agent=True)): a shared-memory tier that outlives the trainer."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import nebulite
from nebulite.agent import client, protocol

from conftest import HANG_TIMEOUT


def _child(code: str, env_extra: dict[str, str] | None = None, timeout: float = HANG_TIMEOUT):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _committed(store: str) -> list[str]:
    return [e["tag"] for e in nebulite._core.read_catalog(store)[0]]


def test_init_uses_the_agent_by_default(agent_env, store, monkeypatch):
    monkeypatch.delenv("NEBULITE_AGENT")
    nebulite.init(persistent_storage_path=store, memory_buffer_size=64 << 20)
    pid = nebulite.session_info()["agent_pid"]
    assert pid and pid != os.getpid()
    nebulite.shutdown()
    monkeypatch.setenv("NEBULITE_AGENT", "0")  # the embedded engine, on request
    nebulite.init(persistent_storage_path=store, memory_buffer_size=64 << 20)
    assert nebulite.session_info()["agent_pid"] is None
    nebulite.shutdown()
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    assert nebulite.session_info()["agent_pid"] == pid


def test_the_agent_a_trainer_starts_does_not_load_torch(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    pid = nebulite.session_info()["agent_pid"]
    nebulite.Checkpoint("a").save("x", torch.ones(4))
    nebulite.flush_persistence()
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "_core" in maps and "libtorch" not in maps
    nebulite.shutdown()


def test_an_agent_started_by_hand_serves_the_trainers(agent_env, store):
    cmd = [sys.executable, "-m", "nebulite.cli", "agent", "--root", store,
           "--memory", str(64 << 20), "--idle-exit", "1"]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        path = client.socket_path(store)
        deadline = time.monotonic() + HANG_TIMEOUT
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_TIMEOUT)
        assert second.returncode == 1 and "already serves" in second.stderr
        nebulite.init(persistent_storage_path=store, agent=True)
        assert nebulite.session_info()["agent_pid"] == agent.pid
        assert nebulite.session_info()["memory_capacity"] == 64 << 20
        nebulite.Checkpoint("a").save("x", torch.ones(4))
        nebulite.shutdown()
        assert agent.wait(timeout=HANG_TIMEOUT) == 0  # idle: nothing left to persist, nobody attached
        assert _committed(store) == ["a"]
    finally:
        if agent.poll() is None:
            agent.kill()


def test_jobs_without_a_persistent_path_share_an_agent_only_in_one_directory(
        agent_env, tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    monkeypatch.chdir(a)
    nebulite.init(agent=True, memory_buffer_size=64 << 20)
    first = nebulite.session_info()["agent_pid"]
    nebulite.Checkpoint("t").save("x", torch.ones(3))
    nebulite.shutdown()
    monkeypatch.chdir(b)  # another job: another agent, which knows nothing of "t"
    nebulite.init(agent=True, memory_buffer_size=64 << 20)
    assert nebulite.session_info()["agent_pid"] not in (None, first)
    assert nebulite.get_latest_checkpoint().tag == ""
    nebulite.shutdown()
    monkeypatch.chdir(a)  # the first job restarted: its checkpoint is still in memory
    nebulite.init(agent=True, memory_buffer_size=64 << 20)
    assert nebulite.session_info()["agent_pid"] == first
    assert nebulite.get_latest_checkpoint().load("x").sum() == 3


def test_save_and_load_through_the_agent(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    state = {"w": torch.arange(100_000, dtype=torch.float32), "step": 3}
    nebulite.Checkpoint("a").save("state", state)
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "a" and latest._committed["tier"] == "memory"
    got = latest.load("state")
    assert got["step"] == 3 and torch.equal(got["w"], state["w"])
    nebulite.flush_persistence()
    assert _committed(store) == ["a"]
    assert torch.equal(torch.load(nebulite.get_latest_checkpoint_path("state"))["w"], state["w"])


def test_a_restarted_trainer_loads_from_the_agents_memory(agent_env, store):
    # Interval of an hour: the first checkpoint is persisted, the second stays in memory.
    code = f"""
        import torch, nebulite
        nebulite.init(persistent_storage_path={store!r}, persistent_time_interval=3600,
                      agent=True, memory_buffer_size=64 << 20)
        nebulite.Checkpoint("first").save("x", torch.full((1000,), 1.0))
        nebulite.flush_persistence()
        nebulite.Checkpoint("second").save("x", torch.full((1000,), 2.0))
    """
    r = _child(code)
    assert r.returncode == 0, r.stderr
    assert _committed(store) == ["first"]  # "second" exists only in the agent's memory
    nebulite.init(persistent_storage_path=store, persistent_time_interval=3600, agent=True)
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "second" and latest._committed["tier"] == "memory"
    assert torch.equal(latest.load("x"), torch.full((1000,), 2.0))


def test_the_agent_commits_after_the_trainer_is_killed(agent_env, store):
    code = f"""
        import os, signal, torch, nebulite
        nebulite.init(persistent_storage_path={store!r}, agent=True, memory_buffer_size=128 << 20)
        ck = nebulite.Checkpoint("last", 2)
        ck.save("a", torch.full((4_000_000,), 7, dtype=torch.int32))
        ck.save("b", {{"step": 9, "t": torch.ones(10)}})
        os.kill(os.getpid(), signal.SIGKILL)  # right after save() returned
    """
    r = _child(code)
    assert r.returncode == -signal.SIGKILL
    deadline = time.monotonic() + HANG_TIMEOUT
    while "last" not in _committed(store) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _committed(store) == ["last"]
    nebulite.api._reset_for_tests()
    ck = nebulite.get_latest_checkpoint(persist_path=store)
    assert torch.equal(ck.load("a"), torch.full((4_000_000,), 7, dtype=torch.int32))
    assert ck.load("b")["step"] == 9


def test_one_agent_for_many_trainers_starting_at_once(agent_env, store):
    # Eight independent jobs (eight run ids) on one store at once: they opt into sharing it.
    code = f"""
        import json, nebulite
        nebulite.init(persistent_storage_path={store!r}, agent=True, memory_buffer_size=64 << 20,
                      shared_store=True)
        print(json.dumps(nebulite.api._session.engine.agent_pid))
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(8)]
    pids = set()
    for p in procs:
        out, err = p.communicate(timeout=HANG_TIMEOUT)
        assert p.returncode == 0, err
        pids.add(int(out.strip().splitlines()[-1]))
    assert len(pids) == 1


def test_a_trainer_dying_mid_staging_leaves_nothing(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    engine = nebulite.api._session.engine
    sock = client.connect_or_start(store, 0, 2, 600.0, 0, 60.0)
    other = client.AgentEngine(sock, 0, 1)
    other._call("reserve", tag="t", version="vdead-000001", name="x",
                records=[["data.pkl", 10], ["data/0", 1 << 20]])
    assert engine.memory_used > 1 << 20
    sock.close()  # the writer dies before sealing
    deadline = time.monotonic() + HANG_TIMEOUT
    while engine.memory_used and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.memory_used == 0
    assert nebulite.get_latest_checkpoint().tag == ""


def test_a_trainer_killed_between_the_saves_of_a_checkpoint_leaves_nothing(agent_env, store):
    """Its first object was sealed (and persisted eagerly), the second never came: the
    agent gives the memory back and removes the files; the previous checkpoint stays."""
    code = f"""
        import os, signal, torch, nebulite as nm
        nm.init(persistent_storage_path={store!r}, agent=True, memory_buffer_size=64 << 20)
        nm.Checkpoint("good").save("x", torch.ones(1000))
        nm.flush_persistence()
        ck = nm.Checkpoint("half", 2)
        ck.save("model", torch.arange(1 << 20, dtype=torch.float32))
        print(nm.session_info()["agent_pid"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    out = _child(code)
    assert out.returncode == -signal.SIGKILL, out.stderr
    agent_pid = int(out.stdout.split()[0])
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    assert nebulite.session_info()["agent_pid"] == agent_pid
    deadline = time.monotonic() + HANG_TIMEOUT
    while os.path.exists(os.path.join(store, "half")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(os.path.join(store, "half"))
    assert nebulite.session_info()["memory_used"] < 1 << 20  # only "good" is held
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "good" and latest.load("x").sum() == 1000
    assert _committed(store) == ["good"]


def test_a_dead_run_is_alive_while_its_agent_works_for_it(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    run = nebulite.api._session.run_id
    assert nebulite._core.run_is_alive(store, run)
    nebulite.shutdown()  # this trainer lets go; the agent lets go once it is idle
    deadline = time.monotonic() + HANG_TIMEOUT
    while nebulite._core.run_is_alive(store, run) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not nebulite._core.run_is_alive(store, run)


def test_malformed_messages_are_refused_and_others_keep_being_served(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    path = os.path.join(agent_env, f"agent-{client.scope_name(store)}.sock")
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(path)
    raw.sendall(struct.pack("<I", 5) + b"nope!")
    reply, _ = protocol.recv(raw)
    assert reply["ok"] is False
    protocol.send(raw, {"op": "reserve", "tag": "t"})  # before hello
    assert protocol.recv(raw)[0]["ok"] is False
    protocol.send(raw, {"op": "hello", "version": 1, "rank": 5, "world_size": 2})
    assert protocol.recv(raw, with_fds=True)[0]["ok"] is False
    raw.sendall(struct.pack("<I", protocol.MAX_MESSAGE + 1))  # cannot be resynchronised
    assert protocol.recv(raw)[0]["ok"] is False
    raw.close()
    nebulite.Checkpoint("fine").save("x", torch.ones(3))
    assert nebulite.get_latest_checkpoint().load("x").sum() == 3


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_another_user_cannot_attach(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    path = os.path.join(agent_env, f"agent-{client.scope_name(store)}.sock")
    assert (os.stat(agent_env).st_mode & 0o777) == 0o700
    assert (os.stat(path).st_mode & 0o777) == 0o600
    code = f"""
        import os, socket
        os.setgid(65534); os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect({path!r})
        except PermissionError:
            print("refused")
    """
    r = _child(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "refused"


def test_the_agent_exits_when_idle(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20,
                  agent_idle_exit=0.5)
    pid = nebulite.api._session.engine.agent_pid
    nebulite.Checkpoint("a").save("x", torch.ones(3))
    nebulite.shutdown()  # the trainer detaches; the agent persists, then leaves
    deadline = time.monotonic() + HANG_TIMEOUT
    while time.monotonic() < deadline:
        if client._process_state(pid) in (None, "Z", "X"):
            break  # exited (a zombie until the subreaper, here this process, reaps it)
        time.sleep(0.05)
    else:
        pytest.fail("the agent did not exit")
    assert _committed(store) == ["a"]


def test_killing_the_agent_mid_persist_never_exposes_a_torn_checkpoint(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=512 << 20)
    pid = nebulite.api._session.engine.agent_pid
    nebulite.Checkpoint("good").save("x", torch.full((1000,), 1.0))
    nebulite.flush_persistence()
    big = torch.full((60_000_000,), 2.0)  # 240 MB: persisting takes a while
    nebulite.Checkpoint("big").save("x", big)
    deadline = time.monotonic() + HANG_TIMEOUT
    killed = False
    while time.monotonic() < deadline:
        # The data file is being written (under its temporary name; it gets its own name
        # only once complete and synced).
        dirs = list(Path(store, "big").glob("*/rank0/.x.*.partial"))
        if dirs and not (dirs[0].parent.parent / "COMMITTED").exists():
            os.kill(pid, signal.SIGKILL)
            killed = True
            break
        if list(Path(store, "big").glob("*/COMMITTED")):
            break  # it committed before we could kill it: still a valid outcome
        time.sleep(0.001)
    committed_anyway = False
    if killed:
        while client._process_state(pid) not in (None, "Z", "X") and time.monotonic() < deadline + 30:
            time.sleep(0.01)
        with pytest.raises(nebulite.AgentLostError, match="lost the node agent"):
            nebulite.Checkpoint("lost").save("x", torch.ones(5))
        # (The write may have finished, and the commit followed, before the signal landed.)
        committed_anyway = bool(list(Path(store, "big").glob("*/COMMITTED")))
        partial = sorted(p.name for p in Path(store, "big").iterdir())
    nebulite.api._reset_for_tests()
    ck = nebulite.get_latest_checkpoint(persist_path=store)
    assert ck.tag in ("good", "big")
    if killed and not committed_anyway:
        assert ck.tag == "good"
    expected = torch.full((1000,), 1.0) if ck.tag == "good" else big
    assert torch.equal(ck.load("x"), expected)
    for e in nebulite._core.read_catalog(store)[0]:
        m = nebulite._core.read_manifest(store, e["tag"], e["version"], 0)
        for name, size, crc in m["files"]:
            rel = nebulite._core.data_file_path(e["tag"], e["version"], 0, name)
            nebulite._core.verify_data_file(store, rel, name, size, crc)
    # A new trainer starts a new agent and goes on.
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=512 << 20,
                  dead_run_grace=0)
    assert nebulite.api._session.engine.agent_pid != pid
    if killed and not committed_anyway:  # the dead run's partial version was removed
        assert partial and not any(Path(store, "big", v).exists() for v in partial)
    nebulite.Checkpoint("after").save("x", torch.ones(5))
    nebulite.flush_persistence()
    assert nebulite.get_latest_checkpoint().tag == "after"


def test_a_state_larger_than_the_node_budget_streams_through_it(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=16 << 20)
    big = {"w": torch.arange(24_000_000, dtype=torch.int32), "b": torch.ones(1000)}  # 96 MB
    nebulite.Checkpoint("big").save("state", big)
    nebulite.flush_persistence()
    assert _committed(store) == ["big"]
    got = nebulite.get_latest_checkpoint().load("state")
    assert torch.equal(got["w"], big["w"]) and torch.equal(got["b"], big["b"])
    # Small saves still go through the agent's memory.
    nebulite.Checkpoint("small").save("x", torch.ones(10))
    assert nebulite.get_latest_checkpoint()._committed["tier"] == "memory"


def test_one_agent_per_node_identity(agent_env, store, monkeypatch):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=32 << 20)
    first = nebulite.api._session.engine.agent_pid
    monkeypatch.setenv("NEBULITE_NODE_ID", "node-b")
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=32 << 20)
    second = nebulite.api._session.engine.agent_pid
    assert first != second  # a simulated second node has its own agent (and memory)
    monkeypatch.delenv("NEBULITE_NODE_ID")
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=32 << 20)
    assert nebulite.api._session.engine.agent_pid == first


def test_retention_and_time_interval_through_the_agent(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20,
                  num_of_version_in_retention=2, persistent_time_interval=3600)
    for i in range(4):
        nebulite.Checkpoint(f"s{i}").save("x", torch.full((100,), float(i)))
    # Only the first was due for the store; the others live in the agent's memory.
    nebulite.flush_persistence()  # persists the newest one
    assert _committed(store) == ["s0", "s3"]
    memory = [e["tag"] for e in nebulite.list_checkpoints() if e["tier"] == "memory"]
    assert len(memory) <= 2 and "s3" in memory  # retention bounds the memory tier too
    assert torch.equal(nebulite.get_latest_checkpoint().load("x"), torch.full((100,), 3.0))


def test_a_one_gib_state_through_a_64_mib_budget(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    state = {"a": torch.arange(1 << 28, dtype=torch.int32)}  # 1 GiB
    nebulite.Checkpoint("huge").save("state", state)
    nebulite.flush_persistence()
    got = nebulite.get_latest_checkpoint().load("state")
    assert torch.equal(got["a"], state["a"])


def test_a_checkpoint_asks_the_agent_for_errors_only_once_one_was_counted(agent_env, store):
    """With asynchronous staging, a checkpoint's saves make no request of the agent on the
    caller's thread while nothing failed in the background: the agent counts each engine's
    errors in memory its trainers map, and the first save asks for them only when the count
    moved. A failure is still raised by that save."""
    nebulite.init(persistent_storage_path=store, agent=True, async_staging=True,
                  persistent_time_interval=0, memory_buffer_size=64 << 20)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    step()  # the optimizer's state is known from here on
    engine = nebulite.api._session.engine
    caller, asked = threading.get_ident(), []
    call = engine._call

    def recording(op, *args, **kwargs):
        if threading.get_ident() == caller:
            asked.append(op)
        return call(op, *args, **kwargs)

    engine._call = recording
    nebulite.flush_persistence()  # takes the errors (none): the count is known from here on
    asked.clear()
    for i in range(3):
        ck = nebulite.Checkpoint(f"good{i}", num_files=2)
        ck.save("model", model.state_dict())
        ck.save("optimizer", opt.state_dict())
        assert asked == [], (i, asked)
        step()  # the barrier commits it
        nebulite.flush_persistence()  # (asks: this is not a save)
        asked.clear()
    with open(os.path.join(store, "bad"), "w") as f:  # where its folder would go
        f.write("in the way")
    nebulite.Checkpoint("bad").save("model", model.state_dict())
    step()
    deadline = time.monotonic() + HANG_TIMEOUT
    while not any(r["tag"] == "bad" and r["outcome"].startswith("failed")
                  for r in nebulite.history()):
        assert time.monotonic() < deadline, nebulite.history()
        time.sleep(0.05)
    asked.clear()
    with pytest.raises(nebulite.PersistError, match="bad"):
        nebulite.Checkpoint("next").save("model", model.state_dict())
    assert asked == ["take_errors"]
    asked.clear()
    nebulite.Checkpoint("after").save("model", model.state_dict())
    assert asked == []
    step()
    assert nebulite.get_latest_checkpoint().tag == "after"


def test_a_trainer_with_more_than_1024_descriptors_open_talks_to_the_agent(agent_env, store):
    """Large jobs hold many descriptors (data loader workers, pipes, collectives' sockets):
    the connection to the agent may be numbered 1024 or more, past what select() takes."""
    code = f"""
        import os, resource, torch, nebulite
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 2048 and (hard == resource.RLIM_INFINITY or hard >= 2048):
            resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        nebulite.init(persistent_storage_path={store!r}, agent=True, async_staging=True,
                      memory_buffer_size=64 << 20)
        assert nebulite.api._session.engine._sock.fileno() >= 1024
        nebulite.Checkpoint("a").save("x", torch.full((10,), 3.0))
        nebulite.flush_persistence()
        assert torch.equal(nebulite.get_latest_checkpoint().load("x"), torch.full((10,), 3.0))
        nebulite.shutdown()
    """
    r = _child(code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _committed(store) == ["a"]

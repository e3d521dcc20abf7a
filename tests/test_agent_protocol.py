"""The node agent's control protocol, served in-process over a socket pair: every request
gets a reply and the connection survives it; only a length over the limit ends it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zlib
from pathlib import Path

import pytest
from conftest import HANG_TIMEOUT

from nebulite import _core, errors
from nebulite.agent import client, protocol, server


def _wait_for_cleanups(agent: server.Agent) -> None:
    deadline = time.monotonic() + 60
    while agent.cleanups and time.monotonic() < deadline:
        time.sleep(0.01)
    assert agent.cleanups == 0


class _Served:
    """One trainer connection to `agent`, served by the agent's own loop on a thread."""

    def __init__(self, agent: server.Agent) -> None:
        self.agent = agent
        self.sock, end = socket.socketpair()
        with agent.lock:
            agent.clients += 1  # as serve_forever counts an accepted connection
        self.thread = threading.Thread(target=agent._serve, args=(end,))
        self.thread.start()

    def request(self, message: dict) -> dict:
        protocol.send(self.sock, message)
        return self.reply()

    def send_raw(self, body: bytes) -> dict:
        self.sock.sendall(struct.pack("<I", len(body)) + body)
        return self.reply()

    def reply(self) -> dict:
        reply, fds = protocol.recv(self.sock, with_fds=True)
        for fd in fds:
            os.close(fd)
        return reply

    def hello(self) -> dict:
        reply = self.request({"op": "hello", "version": protocol.VERSION, "rank": 0,
                              "world_size": 1})
        assert reply["ok"], reply
        return reply

    def alive(self) -> bool:
        """The connection still serves requests."""
        try:
            return "ok" in self.request({"op": "memory"})
        except ConnectionError:
            return False

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=HANG_TIMEOUT)
        assert not self.thread.is_alive()


@pytest.fixture
def make_agent(tmp_path):
    """Builds in-process agents (memory only unless given a store); closes them after."""
    made: list[tuple[server.Agent, Path]] = []

    def make(root: str = "", agent_class: type = server.Agent,
             commit_timeout: float = 30.0) -> server.Agent:
        rt = Path(tempfile.mkdtemp(prefix="nbap-"))  # short: Unix socket paths are limited
        agent = agent_class(str(rt / "agent.sock"), root, 16 << 20, retention=2,
                            commit_timeout=commit_timeout, io_threads=1, idle_exit=0)
        made.append((agent, rt))
        return agent

    yield make
    for agent, rt in made:
        _wait_for_cleanups(agent)
        agent.close()
        shutil.rmtree(rt, ignore_errors=True)


@pytest.fixture
def connect():
    opened: list[_Served] = []

    def connect(agent: server.Agent) -> _Served:
        opened.append(_Served(agent))
        return opened[-1]

    yield connect
    for c in opened:
        c.close()


def _save(c: _Served, tag: str, persist: bool = False) -> int:
    """A checkpoint of one small object, committed (its bytes are zeros)."""
    key = {"tag": tag, "version": "v1", "name": "x"}
    assert c.request(dict(key, op="reserve", records=[["data.pkl", 16]]))["ok"]
    assert c.request(dict(key, op="seal", crcs=[0]))["ok"]
    reply = c.request({"op": "commit", "tag": tag, "version": "v1", "persist": persist})
    assert reply["ok"], reply
    return reply["seq"]


@pytest.mark.parametrize("raw, answer", [
    (b'{"op": "flush", "timeout": 1' + b"0" * 400 + b"}", True),  # longer than forever
    (b'{"op": "flush", "timeout": NaN}', "InvalidArgumentError"),
    (b'{"op": "flush", "timeout": -1}', "InvalidArgumentError"),
    (b'{"op": "reserve", "tag": "t", "version": "v", "name": "x", "records": [["a", 1e400]]}',
     "InvalidArgumentError"),
    (b'{"op": "reserve", "tag": "t", "version": "v", "name": "x", "records": [["a", 1.5]]}',
     "InvalidArgumentError"),
    (b'{"op": "reserve", "tag": "t", "version": "v", "name": "x", "records": {"a": 1}}',
     "InvalidArgumentError"),
])
def test_numbers_out_of_range_are_answered_and_the_connection_survives(
        make_agent, connect, raw, answer):
    c = connect(make_agent())
    c.hello()
    reply = c.send_raw(raw)
    if answer is True:
        assert reply == {"ok": True}
    else:
        assert reply["ok"] is False and reply["error"]["type"] == answer, reply
    assert c.alive()


class _FaultyAgent(server.Agent):
    """An agent whose pin fails with the exception a test puts in `fault`."""

    fault: BaseException

    def _pin_any_rank(self, engine, tag, version, name):
        raise self.fault


@pytest.mark.parametrize("fault_type", [RuntimeError, OSError, OverflowError, AttributeError])
def test_any_exception_of_a_request_is_answered_and_the_connection_survives(
        make_agent, connect, fault_type, caplog):
    agent = make_agent(agent_class=_FaultyAgent)
    agent.fault = fault = fault_type("injected")
    c = connect(agent)
    c.hello()
    _save(c, "t")
    reply = c.request({"op": "pin", "tag": "t", "version": "v1", "name": "x"})
    assert reply["ok"] is False
    assert reply["error"]["type"] == "NebuliteError"
    assert "injected" in reply["error"]["message"]
    assert c.alive()
    # What it had staged is still its own: committing another checkpoint works.
    _save(c, "u")
    assert [v["tag"] for v in c.request({"op": "versions"})["versions"]] == ["t", "u"]
    assert any(r.exc_info and r.exc_info[1] is fault for r in caplog.records)  # logged


def test_a_deeply_nested_message_is_refused_and_the_connection_survives(make_agent, connect):
    c = connect(make_agent())
    c.hello()
    reply = c.send_raw(b"[" * 100_000)
    assert reply["ok"] is False and "nests too deeply" in reply["error"]["message"]
    reply = c.send_raw(b'{"op": "memory", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert reply["ok"] is False
    assert c.alive()


def test_the_history_reply_is_bounded_to_the_newest_rows(make_agent, connect, monkeypatch):
    c = connect(make_agent())
    c.hello()
    for seq in range(1, 21):
        _save(c, f"t{seq}")
    everything = c.request({"op": "history"})
    assert everything["ok"] and everything["omitted"] == 0
    rows = everything["rows"]
    assert rows[-1]["tag"] == "t20"
    limit = len(json.dumps(everything)) // 3
    monkeypatch.setattr(protocol, "MAX_MESSAGE", limit)
    reply = c.request({"op": "history"})
    assert reply["ok"] is True, reply
    assert len(json.dumps(reply)) <= limit
    kept = reply["rows"]
    assert 0 < len(kept) < len(rows) and reply["omitted"] == len(rows) - len(kept)
    assert kept == rows[-len(kept):]  # the newest ones, in order
    assert c.alive()


def test_the_trainer_is_told_when_history_rows_were_left_out(make_agent, monkeypatch):
    agent = make_agent()
    trainer, end = socket.socketpair()
    with agent.lock:
        agent.clients += 1
    serving = threading.Thread(target=agent._serve, args=(end,))
    serving.start()
    try:
        engine = client.AgentEngine(trainer, rank=0, world_size=1)
        for seq in range(1, 11):
            engine._call("reserve", tag=f"t{seq}", version="v1", name="x",
                         records=[["data.pkl", 16]])
            engine._call("seal", tag=f"t{seq}", version="v1", name="x", crcs=[0])
            engine._call("commit", tag=f"t{seq}", version="v1", persist=False)
        rows = engine.history()
        monkeypatch.setattr(protocol, "MAX_MESSAGE", len(json.dumps(rows)) // 2)
        with pytest.warns(UserWarning, match="older ones were left out"):
            newest = engine.history()
        assert newest and newest == rows[-len(newest):]
        engine.close(10)
    finally:
        trainer.close()
        serving.join(timeout=HANG_TIMEOUT)


def test_any_reply_over_the_limit_becomes_an_error_reply(make_agent, connect, monkeypatch):
    c = connect(make_agent())
    c.hello()
    for seq in range(1, 4):
        _save(c, f"t{seq}")
    size = len(json.dumps(c.request({"op": "versions"})))
    monkeypatch.setattr(protocol, "MAX_MESSAGE", size - 1)
    reply = c.request({"op": "versions"})
    assert reply["ok"] is False and "too large" in reply["error"]["message"]
    assert c.alive()


def test_only_a_length_over_the_limit_ends_the_connection(make_agent, connect):
    c = connect(make_agent())
    for body in (b"nope", b"[1, 2]", b'"op"', b"\xff\xfe", b'{"op": 5}', b"{}"):
        assert c.send_raw(body)["ok"] is False
    assert c.alive()
    c.sock.sendall(struct.pack("<I", protocol.MAX_MESSAGE + 1))
    assert c.reply()["ok"] is False
    with pytest.raises(ConnectionError):
        c.reply()


def test_a_connection_that_never_said_hello_leaves_no_error_behind(
        make_agent, connect, tmp_path, monkeypatch):
    raised: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    agent = make_agent(root=str(tmp_path / "store"))
    connect(agent).close()
    _wait_for_cleanups(agent)
    assert raised == []
    assert agent.clients == 0



def test_a_pin_of_an_object_still_being_staged_is_refused(make_agent, connect):
    c = connect(make_agent())
    c.hello()
    key = {"tag": "t", "version": "v1", "name": "x"}
    assert c.request(dict(key, op="reserve", records=[["data.pkl", 16]]))["ok"]
    reply = c.request(dict(key, op="pin"))  # it would wait for this very trainer's seal
    assert reply["ok"] is False and reply["error"]["type"] == "NotFoundError", reply
    assert c.request(dict(key, op="seal", crcs=[0]))["ok"]
    assert c.request({"op": "commit", "tag": "t", "version": "v1", "seq": 1})["ok"]
    reply = c.request(dict(key, op="pin"))
    assert reply["ok"] is True and reply["records"][0][0] == "data.pkl"


def test_a_pin_never_waits_for_a_writer():
    """Only committed versions are pinned: an object reserved but not sealed is refused at
    once (its writer may never seal it), from any thread."""
    code = """
        import threading
        from nebulite import _core, errors
        e = _core.Engine.open("", memory_bytes=8 << 20)
        e.reserve("t", "v", "x", [("data.pkl", 16)])
        out = []
        def pin():
            try:
                e.pin("t", "v", "x")
                out.append("pinned")
            except errors.NotFoundError:
                out.append("refused")
        reader = threading.Thread(target=pin)
        reader.start()
        reader.join(60)
        print(out[0] if out else "waiting")
        e.discard("t", "v", "x")
        e.close(10)
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=HANG_TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "refused"


def test_must_persist_foresees_what_the_ranks_of_the_node_still_stage(make_agent, connect):
    """A coordinated trainer asks, at the commit, whether what its staging thread still has
    to stage fits in memory; the agent counts the same for each rank of the run it serves
    (they share its memory and stage alike)."""
    agent = make_agent()  # 16 MiB
    ranks = [connect(agent) for _ in range(2)]
    for rank, conn in enumerate(ranks):
        assert conn.request({"op": "hello", "version": protocol.VERSION, "rank": rank,
                             "world_size": 2})["ok"]

    def must(conn: _Served, unstaged: object) -> object:
        reply = conn.request({"op": "must_persist", "tag": "t", "version": "v1",
                              "unstaged_bytes": unstaged})
        return reply["value"] if reply["ok"] else reply["error"]["type"]

    assert must(ranks[1], 0) is False
    assert must(ranks[1], 7 << 20) is False  # 14 MiB for both ranks
    assert must(ranks[1], 9 << 20) is True  # 18 MiB
    assert must(ranks[1], -1) == "InvalidArgumentError"
    assert must(ranks[1], "9") == "InvalidArgumentError"
    ranks[0].close()
    _wait_for_cleanups(agent)
    assert must(ranks[1], 9 << 20) is False  # alone now
    assert must(ranks[1], 17 << 20) is True


def test_a_second_hello_is_refused(make_agent, connect):
    agent = make_agent()
    c = connect(agent)
    c.hello()
    key = {"tag": "t", "version": "v1", "name": "x"}
    assert c.request(dict(key, op="reserve", records=[["data.pkl", 16]]))["ok"]
    assert agent.arena.used > 0
    reply = c.request({"op": "hello", "version": protocol.VERSION, "rank": 1, "world_size": 2})
    assert reply["ok"] is False and reply["error"]["type"] == "FailedPreconditionError"
    c.close()  # what it reserved and never sealed is discarded, in the engine it was in
    _wait_for_cleanups(agent)
    assert agent.arena.used == 0


def test_closing_the_agent_closes_every_engine_whatever_failed(make_agent, connect, tmp_path):
    agent = make_agent(root=str(tmp_path / "store"), commit_timeout=0.5)
    waiting = connect(agent)  # rank 0 of 2: rank 1 never comes, persisting fails
    assert waiting.request({"op": "hello", "version": protocol.VERSION, "rank": 0,
                            "world_size": 2})["ok"]
    _save(waiting, "never", persist=True)
    alone = connect(agent)
    alone.hello()
    _save(alone, "fine", persist=True)
    agent.close()  # logs the failure, and closes the other engine too
    assert len(agent.engines) == 2
    for engine in agent.engines.values():
        with pytest.raises(errors.FailedPreconditionError, match="closed"):
            engine.reserve("t", "v", "x", [("data.pkl", 16)])


def test_a_version_whose_rank_0_died_before_committing_lets_the_agent_exit(
        make_agent, connect, tmp_path, caplog):
    """Rank 1 persisted a version that rank 0 never committed (its trainer died between
    save and commit): once rank 1's trainer is gone too and the commit timeout passed,
    the agent stops waiting for the marker, keeps rank 1's files (rank 0 could still
    commit them), reports the failure, and can finish and exit."""
    store = tmp_path / "store"
    agent = make_agent(root=str(store), commit_timeout=0.5)
    rank1 = connect(agent)
    assert rank1.request({"op": "hello", "version": protocol.VERSION, "rank": 1,
                          "world_size": 2})["ok"]
    key = {"tag": "t", "version": "v1", "name": "x"}
    assert rank1.request(dict(key, op="reserve", records=[["data.pkl", 16]]))["ok"]
    assert rank1.request(dict(key, op="seal", crcs=[zlib.crc32(bytes(16))]))["ok"]  # zeros
    assert rank1.request({"op": "commit", "tag": "t", "version": "v1", "persist": True})["ok"]
    rank0 = connect(agent)
    assert rank0.request({"op": "hello", "version": protocol.VERSION, "rank": 0,
                          "world_size": 2})["ok"]
    assert rank0.request(dict(key, op="reserve", records=[["data.pkl", 16]]))["ok"]
    rank0.close()  # killed mid-save: its part is discarded, the version never committed
    deadline = time.monotonic() + 60
    while not (store / "t" / "v1" / "rank1.manifest").exists():
        assert time.monotonic() < deadline, "rank 1 never persisted its manifest"
        time.sleep(0.01)
    rank1.close()
    _wait_for_cleanups(agent)
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    while not agent._idle():
        assert time.monotonic() < deadline, f"the agent never got idle: {agent.status()}"
        time.sleep(0.05)
    assert (store / "t" / "v1" / "rank1.manifest").exists()
    assert not (store / "t" / "v1" / "COMMITTED").exists()
    assert agent.status()["pending"] == 0
    assert "rank 1 persisted version v1 of 't', but rank 0 did not commit it" in caplog.text


def test_a_version_rank_0_left_uncommitted_in_this_agent_is_not_waited_for(
        make_agent, connect, tmp_path, caplog):
    """Both ranks of a run served by one agent: once rank 0's trainer left without
    committing a version that rank 1 committed and persisted, rank 1's wait for its marker
    ends once no rank 0 trainer of the run is attached, not the commit timeout later:
    nothing would ever commit it. A version rank 0 committed is committed in the store as
    usual."""
    store = tmp_path / "store"
    agent = make_agent(root=str(store), commit_timeout=3600)
    ranks = [connect(agent) for _ in range(2)]
    for rank, conn in enumerate(ranks):
        assert conn.request({"op": "hello", "version": protocol.VERSION, "rank": rank,
                             "world_size": 2, "run": "run0001"})["ok"]

    def save(conn: _Served, version: str) -> None:
        key = {"tag": "t", "version": version, "name": "x"}
        assert conn.request(dict(key, op="reserve", records=[["data.pkl", 16]]))["ok"]
        assert conn.request(dict(key, op="seal", crcs=[zlib.crc32(bytes(16))]))["ok"]

    for conn in ranks:
        save(conn, "v1")
        assert conn.request({"op": "commit", "tag": "t", "version": "v1", "persist": True})["ok"]
    save(ranks[1], "v2")
    assert ranks[1].request({"op": "commit", "tag": "t", "version": "v2", "persist": True})["ok"]
    ranks[0].request(dict({"tag": "t", "version": "v2", "name": "x"}, op="reserve",
                          records=[["data.pkl", 16]]))
    ranks[0].close()  # killed mid-save: v2 never committed on rank 0
    # While a rank 0 trainer of the run is attached (one restarted with the same run id),
    # it may still commit what rank 1 committed: nothing is given up.
    rank_0_again = connect(agent)
    assert rank_0_again.request({"op": "hello", "version": protocol.VERSION, "rank": 0,
                                 "world_size": 2, "run": "run0001"})["ok"]
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing
    while not (store / "t" / "v2" / "rank1.manifest").exists():
        assert time.monotonic() < deadline, "rank 1 never persisted its manifest"
        time.sleep(0.01)
    ranks[1].close()
    time.sleep(0.5)  # the clean-up's chance to give up too early (it looks every 50 ms)
    assert agent.cleanups == 1 and "but rank 0" not in caplog.text
    rank_0_again.close()
    _wait_for_cleanups(agent)  # within a minute, against a commit timeout of an hour
    assert (store / "t" / "v1" / "COMMITTED").exists()
    assert (store / "t" / "v2" / "rank1.manifest").exists()
    assert not (store / "t" / "v2" / "COMMITTED").exists()
    assert agent.status()["pending"] == 0
    assert ("rank 1 persisted version v2 of 't', but rank 0's trainer left without "
            "committing it" in caplog.text)
    assert "version v1" not in caplog.text


def test_engine_waits_refuse_nan_and_cap_what_never_ends(tmp_path):
    e = _core.Engine.open(str(tmp_path / "store"), memory_bytes=8 << 20)
    with pytest.raises(errors.InvalidArgumentError, match="NaN"):
        e.flush(float("nan"))
    e.flush(float("inf"))  # nothing to wait for: returns at once
    e.flush(1e300)
    with pytest.raises(errors.InvalidArgumentError, match="NaN"):
        _core.Engine.open("", memory_bytes=8 << 20, reserve_timeout=float("nan"))
    e.close(float("inf"))


class _WatchedAgent(server.Agent):
    """An agent that keeps, per connection, how much it remembered when it ended."""

    remembered: list[tuple[int, int]]

    def _detach(self, c):
        self.remembered.append((len(c.staged), len(c.committed)))
        super()._detach(c)


def test_a_trainer_committing_for_long_leaves_the_agent_bounded(make_agent, connect):
    """The versions the agent remembers per trainer (to abandon what it never committed,
    and to stop waiting for what its rank 0 never will) follow what the engine still holds,
    not every checkpoint the trainer made: one entry per checkpoint would grow for weeks."""
    agent = make_agent(agent_class=_WatchedAgent)
    agent.remembered = []
    c = connect(agent)
    c.hello()
    for i in range(300):
        _save(c, f"t{i}")
    used = agent.status()["used"]
    # Staged but not committed when the trainer went: still abandoned, its memory freed.
    assert c.request({"op": "reserve", "tag": "open", "version": "v1", "name": "x",
                      "records": [["data.pkl", 16]]})["ok"]
    c.close()
    _wait_for_cleanups(agent)
    (staged, committed), = agent.remembered
    assert staged == 1 and committed < 100, agent.remembered
    assert agent.status()["used"] == used
    assert "open" not in {v["tag"] for v in agent.status()["versions"]}

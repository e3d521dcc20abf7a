"""The trainer's side of the agent: an engine whose state lives in the node agent.

`AgentEngine` offers the methods of the embedded `_core.Engine` that the API uses, so the
rest of nebulite does not care where the engine runs. Tensor bytes never cross the
socket: the trainer maps the agent's arena and copies straight into it.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import mmap
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from typing import Any

from .. import _core, errors
from . import protocol

#: How long a trainer waits for an agent it started to listen.
START_TIMEOUT = 60.0


def runtime_dir() -> str:
    """A per-user directory (0700) for agent sockets, locks and logs."""
    base = os.environ.get("NEBULITE_RUNTIME_DIR") or f"/tmp/nebulite-{os.getuid()}"
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.stat(base)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise errors.StoragePermissionError(
            f"{base} must belong to uid {os.getuid()} and be private (mode 0700)")
    return base


def node_id() -> str:
    """This node's identity: $NEBULITE_NODE_ID (to run several simulated nodes on one
    machine), else the host name."""
    return os.environ.get("NEBULITE_NODE_ID") or socket.gethostname()


def scope_name(root: str | None) -> str:
    """One agent per node and storage scope."""
    return hashlib.sha1(f"{node_id()}\0{root or '<memory>'}".encode()).hexdigest()[:16]


def _connect(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return s
    except OSError:
        s.close()
        return None


def connect_or_start(root: str | None, memory: int, retention: int, commit_timeout: float,
                     io_threads: int, idle_exit: float) -> socket.socket:
    """Connects to the agent of this node and scope, starting it if there is none.
    Concurrent callers agree on one agent through a lock file."""
    base = runtime_dir()
    scope = scope_name(root)
    path = os.path.join(base, f"agent-{scope}.sock")
    if len(os.fsencode(path)) > 107:  # sockaddr_un.sun_path
        raise errors.InvalidArgumentError(
            f"the agent's socket path {path!r} is longer than a Unix socket allows; "
            "set NEBULITE_RUNTIME_DIR to a shorter directory")
    s = _connect(path)
    if s is not None:
        return s
    with open(os.path.join(base, f"agent-{scope}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        s = _connect(path)
        if s is not None:
            return s
        log = open(os.path.join(base, f"agent-{scope}.log"), "ab")
        agent = subprocess.Popen(
            [sys.executable, "-m", "nebulite.agent", "--socket", path, "--root", root or "",
             "--memory", str(memory), "--retention", str(retention),
             "--commit-timeout", str(commit_timeout), "--io-threads", str(io_threads),
             "--idle-exit", str(idle_exit)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            close_fds=True)
        log.close()
        # Reap it if it exits before this process does (else it lingers as a zombie).
        threading.Thread(target=agent.wait, name="nebulite-agent-reaper", daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            s = _connect(path)
            if s is not None:
                return s
            time.sleep(0.02)
    raise errors.NebuliteError(f"the nebulite agent did not start; see {base}/agent-{scope}.log")


def attach(root: str | None, memory: int, retention: int, commit_timeout: float,
           io_threads: int, idle_exit: float, rank: int, world_size: int) -> "AgentEngine":
    """Connects to (or starts) the agent and says hello. An agent that is dying while we
    connect (killed, or leaving when idle) is replaced by a new one."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        sock = connect_or_start(root, memory, retention, commit_timeout, io_threads, idle_exit)
        try:
            return AgentEngine(sock, rank, world_size, root)
        except (ConnectionError, OSError):
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class _Lease:
    """A pinned object in the agent's arena, read through this process's mapping."""

    def __init__(self, engine: "AgentEngine", lease_id: int, address: int,
                 records: list[list[Any]]) -> None:
        self._engine = engine
        self._id = lease_id
        self.address = address
        self._records = {str(n): (int(o), int(s)) for n, o, s in records}
        self._order = [(str(n), int(o), int(s)) for n, o, s in records]

    def records(self) -> list[tuple[str, int, int]]:
        return list(self._order)

    def read(self, name: str) -> bytes:
        off, size = self._records[name]
        return ctypes.string_at(self.address + off, size)

    def copy_to(self, name: str, dst: int) -> None:
        off, size = self._records[name]
        _core.copy_bytes(dst, self.address + off, size)

    def __del__(self) -> None:
        # Never talk from a finalizer (it may run inside another call): the next call
        # tells the agent.
        self._engine._unpins.append(self._id)


class AgentEngine:
    """Drop-in for `_core.Engine`, backed by the node agent."""

    def __init__(self, sock: socket.socket, rank: int, world_size: int,
                 root: str | None = None) -> None:
        self._sock = sock
        self._rank = rank
        self._root = root
        self._lock = threading.Lock()
        self._unpins: list[int] = []
        with self._lock:
            protocol.send(sock, {"op": "hello", "version": protocol.VERSION, "rank": rank,
                                 "world_size": world_size, "pid": os.getpid()})
            reply, fds = protocol.recv(sock, with_fds=True)
        _raise_if_error(reply)
        if not fds:
            raise errors.NebuliteError("the agent sent no memory to map")
        fd = fds[0]
        self.memory_capacity = int(reply["capacity"])
        self.agent_pid = int(reply["pid"])
        # Map every page now (the agent has already allocated them), so that copies into
        # the arena never take a page fault in this process.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(fd, self.memory_capacity, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            while self._unpins:
                protocol.send(self._sock, {"op": "unpin", "lease": self._unpins.pop()})
                protocol.recv(self._sock)
            protocol.send(self._sock, dict(fields, op=op))
            reply, _ = protocol.recv(self._sock)
        _raise_if_error(reply)
        return reply

    # -- what the API uses ----------------------------------------------------

    def stage(self, tag: str, version: str, name: str, records: list[tuple], persist_now: bool = False):
        t0 = time.perf_counter()
        try:
            r = self._call("reserve", tag=tag, version=version, name=name,
                           records=[(n, size) for n, _, size, *_ in records])
        except errors.MemoryBudgetError:
            if not self._root:
                raise
            # Larger than the node's whole budget: this trainer streams it to the store
            # through a bounded window, and the agent adopts the durable file.
            size, crc = _core.stream_object(self._root, tag, version, self._rank, name, records)
            self._call("adopt", tag=tag, version=version, name=name, size=size, crc32=crc)
            return size, time.perf_counter() - t0, True, False
        image = self._base + int(r["offset"])
        try:
            _core.copy_many([(image + int(off), src, size)
                             for (_, src, size, *_), (_, off, _) in zip(records, r["records"])
                             if size])
        except BaseException:
            self._call("discard", tag=tag, version=version, name=name)
            raise
        self._call("seal", tag=tag, version=version, name=name, persist_now=persist_now)
        return int(r["bytes"]), time.perf_counter() - t0, False, False

    def must_persist(self, tag: str, version: str) -> bool:
        return bool(self._call("must_persist", tag=tag, version=version)["value"])

    def commit(self, tag: str, version: str, seq: int, persist: bool) -> None:
        self._call("commit", tag=tag, version=version, seq=seq, persist=persist)

    def persist(self, tag: str, version: str) -> None:
        self._call("persist", tag=tag, version=version)

    def flush(self, timeout: float) -> None:
        self._call("flush", timeout=timeout)

    def abandon(self, tag: str, version: str) -> None:
        self._call("abandon", tag=tag, version=version)

    def versions(self) -> list[dict[str, Any]]:
        return list(self._call("versions")["versions"])

    def pin(self, tag: str, version: str, name: str) -> _Lease:
        r = self._call("pin", tag=tag, version=version, name=name)
        return _Lease(self, int(r["lease"]), self._base + int(r["offset"]), r["records"])

    def take_errors(self) -> list[tuple[str, str]]:
        return [tuple(e) for e in self._call("take_errors")["errors"]]

    def history(self) -> list[dict[str, Any]]:
        return list(self._call("history")["rows"])

    @property
    def memory_used(self) -> int:
        return int(self._call("memory")["used"])

    def wait_staged(self) -> None:  # staging through the agent is synchronous
        pass

    def wait_prefaulted(self) -> None:
        self._call("wait_prefaulted")

    def close(self, timeout: float) -> None:
        """Detaches; the agent goes on persisting what was committed."""
        try:
            with self._lock:
                protocol.send(self._sock, {"op": "bye"})
        except OSError:
            pass
        self._sock.close()


def _raise_if_error(reply: dict[str, Any]) -> None:
    if reply.get("ok"):
        return
    err = reply.get("error") or {}
    cls = getattr(errors, str(err.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.NebuliteError)):
        cls = errors.NebuliteError
    raise cls(str(err.get("message", "the agent reported an error")))

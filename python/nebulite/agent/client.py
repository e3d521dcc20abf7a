"""The trainer's side of the agent: an engine whose state lives in the node agent.

`AgentEngine` offers the methods of the embedded `_core.Engine` that the API uses, so the
rest of nebulite does not care where the engine runs. Tensor bytes never cross the
socket: the trainer maps the agent's arena and copies straight into it.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import hashlib
import logging
import math
import mmap
import os
import select
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

from .. import _core, _pinned, errors
from . import error_counts, protocol

log = logging.getLogger("nebulite.agent")

#: How long a trainer waits for an agent it started to listen.
START_TIMEOUT = 60.0
#: Seconds a request may go unanswered before the agent counts as lost (init option
#: agent_timeout, $NEBULITE_AGENT_TIMEOUT).
DEFAULT_TIMEOUT = 60.0
#: How long the agent may legitimately take to answer, on top of the timeout, for the
#: requests that wait by design: a reservation waits for memory (the agent's reserve
#: timeout), a flush for as long as it was asked to.
_WAITS = {"reserve": 600.0, "wait_prefaulted": 600.0}
_MAX_WAIT = 1e9  # seconds: longer never ends anyway, and stays within select()'s range


#: How many numbered alternatives to /tmp/nebulite-<uid> are tried (see runtime_dir()).
RUNTIME_DIR_CANDIDATES = 16


def _private_dir(path: str, create: bool = True) -> bool:
    """Creates `path` as a private directory, or accepts it if it already is one of this
    user's: a real directory (not a symlink), owned by this uid, mode 0700. Anything else
    is left untouched (never chmod'ed, never followed). Without `create`, a missing `path`
    is accepted as it is: it would be created there, and nothing lives in it yet."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return False
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return not create
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and stat.S_IMODE(st.st_mode) == 0o700)


def runtime_dir(create: bool = True) -> str:
    """A per-user directory (0700) for agent sockets, locks and logs. Every process of one
    user on a node finds the same one, so the ranks of a job share one agent (`create`:
    False to only look for agents, leaving a missing directory missing):

    1. ``$NEBULITE_RUNTIME_DIR`` when set (it must be private: it is never replaced);
    2. ``$XDG_RUNTIME_DIR/nebulite`` when ``$XDG_RUNTIME_DIR`` is set;
    3. the first of ``$TMPDIR/nebulite-<uid>``, ``...-<uid>.1``, ``...-<uid>.2``, ... that is
       (or can be created as) this user's private directory: one that another user created
       first, a symlink, or one open to others is passed over, never changed.
    """
    uid = os.getuid()
    explicit = os.environ.get("NEBULITE_RUNTIME_DIR")
    if explicit:
        if create:
            os.makedirs(os.path.dirname(os.path.abspath(explicit)), exist_ok=True)
        if not _private_dir(explicit, create):
            raise errors.StoragePermissionError(
                f"NEBULITE_RUNTIME_DIR={explicit} must be a directory of uid {uid} with "
                "mode 0700 (not a symlink)")
        return explicit
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        path = os.path.join(xdg, "nebulite")
        if _private_dir(path, create):
            return path
    base = os.path.join(os.environ.get("TMPDIR") or "/tmp", f"nebulite-{uid}")
    tried = []
    for i in range(RUNTIME_DIR_CANDIDATES):
        path = base if i == 0 else f"{base}.{i}"
        if _private_dir(path, create):
            if i:
                log.warning("nebulite: %s is not a private directory of uid %d; using %s",
                            base, uid, path)
            return path
        tried.append(path)
    raise errors.StoragePermissionError(
        f"no private runtime directory for the node agent: {', '.join(tried)} all belong to "
        "another user, are symlinks or are open to others; set NEBULITE_RUNTIME_DIR to a "
        "directory of your own (mode 0700)")


def node_id() -> str:
    """This node's identity: $NEBULITE_NODE_ID (to run several simulated nodes on one
    machine), else the host name."""
    return os.environ.get("NEBULITE_NODE_ID") or socket.gethostname()


def scope_name(root: str | None) -> str:
    """One agent per node and storage scope: the persistent path, or, for jobs without
    one, the working directory (so that unrelated memory-only jobs never share tags)."""
    scope = root or f"<memory>\0{os.getcwd()}"
    return hashlib.sha1(f"{node_id()}\0{scope}".encode()).hexdigest()[:16]


def socket_path(root: str | None, create: bool = True) -> str:
    """Where the agent of this node and storage scope listens (`create`: as runtime_dir())."""
    path = os.path.join(runtime_dir(create), f"agent-{scope_name(root)}.sock")
    if len(os.fsencode(path)) > 107:  # sockaddr_un.sun_path
        raise errors.InvalidArgumentError(
            f"the agent's socket path {path!r} is longer than a Unix socket allows; "
            "set NEBULITE_RUNTIME_DIR to a shorter directory")
    return path


def _connect(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return s
    except OSError:
        s.close()
        return None


def connect_or_start(root: str | None, memory: int, retention: int, commit_timeout: float,
                     io_threads: int, idle_exit: float, prefault: bool = False,
                     file_mode: int = 0) -> socket.socket:
    """Connects to the agent of this node and scope, starting it if there is none.
    Concurrent callers agree on one agent through a lock file."""
    base = runtime_dir()
    scope = scope_name(root)
    path = socket_path(root)
    s = _connect(path)
    if s is not None:
        return s
    with open(os.path.join(base, f"agent-{scope}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        s = _connect(path)
        if s is not None:
            return s
        log = open(os.path.join(base, f"agent-{scope}.log"), "ab")
        # --detach: the agent forks and its first process exits at once, so the agent is
        # no child of this process (nothing here has to reap it, no thread waits for it)
        # and it outlives the trainer as the node's daemon.
        launcher = subprocess.Popen(
            [sys.executable, "-m", "nebulite.agent", "--detach", "--socket", path,
             "--root", root or "", "--memory", str(memory), "--retention", str(retention),
             "--commit-timeout", str(commit_timeout), "--io-threads", str(io_threads),
             "--idle-exit", str(idle_exit), "--file-mode", f"{file_mode:o}"]
            + (["--prefault"] if prefault else []),
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            close_fds=True)
        log.close()
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while time.monotonic() < deadline:
                s = _connect(path)
                if s is not None:
                    return s
                if launcher.poll() not in (None, 0):
                    break  # it failed before it could fork
                time.sleep(0.02)
        finally:
            try:
                launcher.wait(timeout=START_TIMEOUT)  # it exits right after forking
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
    raise errors.NebuliteError(f"the nebulite agent did not start; see {base}/agent-{scope}.log")


def attach(root: str | None, memory: int, retention: int, commit_timeout: float,
           io_threads: int, idle_exit: float, rank: int, world_size: int,
           prefault: bool = False, run_id: str | None = None,
           timeout: float = DEFAULT_TIMEOUT, file_mode: int = 0) -> "AgentEngine":
    """Connects to (or starts) the agent and says hello. An agent that is dying while we
    connect (killed, or leaving when idle) is replaced by a new one; one that does not
    answer within `timeout` raises AgentLostError."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        sock = connect_or_start(root, memory, retention, commit_timeout, io_threads, idle_exit,
                                prefault, file_mode)
        try:
            return AgentEngine(sock, rank, world_size, root, run_id, timeout)
        except errors.AgentLostError:
            sock.close()
            raise
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
                 root: str | None = None, run_id: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self._sock = sock
        self._timeout = min(float(timeout), _MAX_WAIT)
        self._lost: str | None = None  # why the agent counts as lost: every call raises it
        # The peer's pid from the kernel, before the agent says anything (it may never).
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        self.agent_pid = struct.unpack("3i", creds)[0]
        self._rank = rank
        self._root = root
        self._lock = threading.Lock()
        self._unpins: list[int] = []
        # Asynchronous staging: deferred copies and the seals (and commits) behind them run
        # in order on one thread; queries wait until it is idle.
        self._jobs: collections.deque[tuple[Any, ...]] = collections.deque()
        self._jobs_cv = threading.Condition()
        self._worker: threading.Thread | None = None
        self._job_error: BaseException | None = None
        with self._lock:
            hello = {"op": "hello", "version": protocol.VERSION, "rank": rank,
                     "world_size": world_size, "pid": os.getpid(), "error_counts": True}
            if run_id and run_id.isascii() and run_id.isalnum() and len(run_id) <= 64:
                hello["run"] = run_id  # the agent keeps the run alive while it works for it
            sock.settimeout(self._timeout)  # bounds each send and receive
            protocol.send(sock, hello)
            try:
                self._await_reply("hello", 0.0)
            except errors.AgentLostError:
                sock.close()
                raise
            reply, fds = protocol.recv(sock, with_fds=True)
        _raise_if_error(reply)
        if not fds:
            raise errors.NebuliteError("the agent sent no memory to map")
        fd = fds[0]
        # The page where the agent counts this engine's errors: take_errors asks only when
        # the count moved (see nebulite.agent.error_counts).
        self._error_counts: error_counts.Reader | None = None
        self._errors_seen: int | None = None  # the count before the last take_errors
        slot = reply.get("error_slot")
        if len(fds) > 1 and isinstance(slot, int) and not isinstance(slot, bool):
            try:
                self._error_counts = error_counts.Reader(fds[1], slot)
            except (ValueError, OSError) as e:  # it asks every time
                log.warning("nebulite: cannot map the agent's error counts: %s", e)
        for extra in fds[1:]:
            os.close(extra)
        self.memory_capacity = int(reply["capacity"])
        self.agent_pid = int(reply["pid"])
        # Pages are mapped as copies first touch them (populating the whole mapping now
        # would make the agent's memory as large as its budget); a range reused by later
        # saves stays mapped, so only a save that needs new memory takes page faults.
        self._map = mmap.mmap(fd, self.memory_capacity, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        # Registered with CUDA by the session when this process uses it (nebulite._pinned).
        self.pinned = _pinned.PinnedRange(self._base, self.memory_capacity)

    @property
    def lost(self) -> bool:
        """True once the agent stopped answering (or went away): every call then raises
        AgentLostError."""
        return self._lost is not None

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        wait = _WAITS.get(op, 0.0) if fields.get("wait", True) else 0.0
        if op == "flush":
            wait = float(fields.get("timeout", 0.0))
        try:
            with self._lock:
                if self._lost is not None:
                    raise errors.AgentLostError(self._lost)
                while self._unpins:
                    protocol.send(self._sock, {"op": "unpin", "lease": self._unpins.pop()})
                    self._await_reply("unpin", 0.0)
                    protocol.recv(self._sock)
                protocol.send(self._sock, dict(fields, op=op))
                self._await_reply(op, wait)
                reply, _ = protocol.recv(self._sock)
        except errors.AgentLostError:
            raise
        except OSError as e:  # ConnectionError included
            self._lose(f"lost the node agent (pid {self.agent_pid}) during {op!r}: {e}; "
                       "checkpoints it had committed to the store are safe; call "
                       "nebulite.init() to attach to a new agent")
            raise errors.AgentLostError(self._lost) from e
        _raise_if_error(reply)
        return reply

    def _await_reply(self, op: str, wait: float) -> None:
        """Returns once the reply to `op` starts arriving. The agent has `wait` seconds
        plus the timeout to answer; past the timeout it counts as lost at once if it is
        stopped (SIGSTOP, a debugger) or gone. Lost: raises AgentLostError, and the
        connection is closed (the stream cannot be resynchronised)."""
        start = time.monotonic()
        deadline = start + min(wait + self._timeout, _MAX_WAIT)
        while True:
            now = time.monotonic()
            if _readable(self._sock, min(self._timeout, deadline - now)):
                return
            state = _process_state(self.agent_pid)
            if time.monotonic() >= deadline or state in ("T", "t", "Z", "X", None):
                break
        waited = time.monotonic() - start
        what = {"T": "it is stopped (SIGSTOP, or suspended by job control)",
                "t": "it is stopped by a debugger", "Z": "it has exited",
                "X": "it has exited", None: "it has exited"}.get(
                    state, "it may be stopped, or its node overloaded or swapping")
        pid = self.agent_pid or "unknown"
        self._lose(
            f"the node agent (pid {pid}) has not answered {op!r} for {waited:.0f} s: {what}. "
            f"Checkpoints it committed to the store are safe. Resume it (kill -CONT {pid}) or "
            "end it and call nebulite.init() again; to go on without an agent, use "
            "init(agent=False) or NEBULITE_AGENT=0, or let nebulite switch by itself with "
            "init(agent_fallback=True) or NEBULITE_AGENT_FALLBACK=1; to wait longer, raise "
            "agent_timeout (NEBULITE_AGENT_TIMEOUT)")
        raise errors.AgentLostError(self._lost)

    def _lose(self, why: str) -> None:
        self._lost = why
        self._sock.close()

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
        # Each record's CRC-32 is computed while it is copied and handed over with the seal;
        # the agent checks it again when it writes the file (a stray write into the shared
        # memory between the two is caught there).
        crcs = [0] * len(records)
        now, now_index, later, later_index = [], [], [], []
        for i, ((_, src, size, *flags), (_, off, _)) in enumerate(zip(records, r["records"])):
            if size:
                if flags and flags[0]:
                    later.append((image + int(off), src, size))
                    later_index.append(i)
                else:
                    now.append((image + int(off), src, size))
                    now_index.append(i)
        try:
            for i, crc in zip(now_index, _core.copy_many(now, crc=True)):
                crcs[i] = crc
        except BaseException:
            self._call("discard", tag=tag, version=version, name=name)
            raise
        seal = {"tag": tag, "version": version, "name": name, "persist_now": persist_now,
                "crcs": crcs}
        if later:
            # Copied after save() returns; the next optimizer step waits for it (the
            # trainer's sources stay alive until then). Sealed once copied.
            self._submit(("copy_and_seal", later, later_index, seal))
            return int(r["bytes"]), time.perf_counter() - t0, False, True
        if self._jobs:
            self._submit(("call", "seal", seal))
        else:
            self._call("seal", **seal)
        return int(r["bytes"]), time.perf_counter() - t0, False, False

    @property
    def arena_address(self) -> int:
        """Where this process maps the agent's memory tier."""
        return self._base

    def reserve(self, tag: str, version: str, name: str, records: list[tuple[str, int]],
                wait: bool = True) -> tuple[int, int, list[tuple[str, int, int]]]:
        """As `_core.Engine.reserve`: (arena offset, bytes, [(record, offset, size)])."""
        r = self._call("reserve", tag=tag, version=version, name=name, records=records,
                       wait=wait)
        return int(r["offset"]), int(r["bytes"]), [(str(n), int(o), int(z)) for n, o, z in r["records"]]

    def seal(self, tag: str, version: str, name: str, persist_now: bool, crcs: list[int]) -> None:
        self._call("seal", tag=tag, version=version, name=name, persist_now=persist_now,
                   crcs=list(crcs))

    def discard(self, tag: str, version: str, name: str) -> None:
        self._call("discard", tag=tag, version=version, name=name)

    def _submit(self, job: tuple[Any, ...]) -> None:
        with self._jobs_cv:
            self._jobs.append(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="nebulite-agent-stager",
                                                daemon=True)
                self._worker.start()
            self._jobs_cv.notify_all()

    def _work(self) -> None:
        """Runs the queued jobs; the thread ends as soon as none is left (the next
        _submit starts another), so no thread outlives the work."""
        while True:
            with self._jobs_cv:
                if not self._jobs:
                    self._worker = None
                    self._jobs_cv.notify_all()
                    return
                job = self._jobs[0]
            try:
                if self._job_error is None:  # after a failure, the rest is dropped
                    if job[0] == "copy_and_seal":
                        _, spans, index, seal = job
                        try:
                            for i, crc in zip(index, _core.copy_many(spans, crc=True)):
                                seal["crcs"][i] = crc
                        except BaseException:
                            self._call("discard", tag=seal["tag"], version=seal["version"],
                                       name=seal["name"])
                            raise
                        self._call("seal", **seal)
                    else:
                        self._call(job[1], **job[2])
            except BaseException as e:  # raised to the trainer by its next call
                self._job_error = e
            with self._jobs_cv:
                self._jobs.popleft()
                self._jobs_cv.notify_all()

    def wait_staged(self) -> None:
        """Blocks until deferred copies (and the seals and commits queued behind them)
        reached the agent; raises what failed among them."""
        with self._jobs_cv:
            while self._jobs:
                self._jobs_cv.wait()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join()  # it is ending: nothing is queued
        if self._job_error is not None:
            e, self._job_error = self._job_error, None
            raise e

    def must_persist(self, tag: str, version: str, unstaged_bytes: int = 0) -> bool:
        fields: dict[str, Any] = {"tag": tag, "version": version}
        if unstaged_bytes:
            fields["unstaged_bytes"] = unstaged_bytes
        return bool(self._call("must_persist", **fields)["value"])

    def commit(self, tag: str, version: str, seq: int, persist: bool) -> None:
        """Commits on this rank. `seq` is not sent: the agent numbers commits itself."""
        fields = {"tag": tag, "version": version, "persist": persist}
        if self._jobs:  # after the seals it depends on; commit() does not wait for them
            self._submit(("call", "commit", fields))
        else:
            self._call("commit", **fields)

    def rename_version(self, tag: str, old: str, new: str) -> None:
        self.wait_staged()
        self._call("rename_version", tag=tag, old=old, new=new)

    def persist(self, tag: str, version: str) -> None:
        self.wait_staged()
        self._call("persist", tag=tag, version=version)

    def flush(self, timeout: float) -> None:
        self.wait_staged()
        self._call("flush", timeout=timeout)

    def flush_version(self, tag: str, version: str, timeout: float) -> None:
        self.wait_staged()
        self._call("flush", timeout=timeout, tag=tag, version=version)

    def abandon(self, tag: str, version: str) -> None:
        self.wait_staged()
        self._call("abandon", tag=tag, version=version)

    def versions(self) -> list[dict[str, Any]]:
        self.wait_staged()
        return list(self._call("versions")["versions"])

    def pin(self, tag: str, version: str, name: str) -> _Lease:
        self.wait_staged()
        r = self._call("pin", tag=tag, version=version, name=name)
        return _Lease(self, int(r["lease"]), self._base + int(r["offset"]), r["records"])

    def take_errors(self) -> list[tuple[str, str]]:
        """What failed in the background. Asks the agent only when its count of this
        engine's errors moved since the last take, or the connection has something to
        read (the agent went away: the request says so)."""
        if self._job_error is not None:  # a deferred copy or seal failed
            e, self._job_error = self._job_error, None
            raise e
        counts = self._error_counts
        count = counts.count() if counts is not None else None
        if count is not None and count == self._errors_seen and self._quiet():
            return []
        taken = [tuple(e) for e in self._call("take_errors")["errors"]]
        self._errors_seen = count  # counted before the take: a later error moves it
        return taken  # type: ignore[return-value]

    def _quiet(self) -> bool:
        """True if the agent is not known lost and nothing waits to be read on its
        connection: an agent that went away reads as its end (and a reply to another
        thread's request as something too: then the caller asks, and learns the same)."""
        if self._lost is not None:
            return False
        try:
            return not _readable(self._sock, 0.0)
        except (OSError, ValueError):  # closed meanwhile: lost
            return False

    def history(self) -> list[dict[str, Any]]:
        r = self._call("history")
        if r.get("omitted"):  # the reply is bounded; the oldest rows did not fit
            warnings.warn(f"nebulite: history() holds the newest {len(r['rows'])} rows; "
                          f"{r['omitted']} older ones were left out", stacklevel=3)
        return list(r["rows"])

    @property
    def memory_used(self) -> int:
        return int(self._call("memory")["used"])

    @property
    def memory_resident(self) -> int:
        return int(self._call("memory")["resident"])

    def wait_prefaulted(self) -> None:
        self._call("wait_prefaulted")

    def close(self, timeout: float) -> None:
        """Detaches; the agent goes on persisting what was committed."""
        try:
            self.wait_staged()
        finally:
            self._detach()

    def _detach(self) -> None:
        self.pinned.release()  # before the mapping goes
        try:
            with self._lock:
                if self._lost is None:
                    protocol.send(self._sock, {"op": "bye"})
        except OSError:
            pass
        self._sock.close()


def _readable(sock: socket.socket, timeout: float) -> bool:
    """True once `sock` has something to read, or its peer closed it, within `timeout`
    seconds. poll(), not select(): a trainer may hold more than 1024 descriptors, and
    select() takes none numbered past 1023."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(timeout * 1000))))


def _process_state(pid: int) -> str | None:
    """The state letter of process `pid` (R, S, D, T, t, Z, ...): None if there is none.
    The agent runs on this node (its socket is local), so /proc tells."""
    if pid <= 0:
        return "?"
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None if not os.path.exists(f"/proc/{pid}") else "?"


def _raise_if_error(reply: dict[str, Any]) -> None:
    if reply.get("ok"):
        return
    err = reply.get("error") or {}
    cls = getattr(errors, str(err.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.NebuliteError)):
        cls = errors.NebuliteError
    raise cls(str(err.get("message", "the agent reported an error")))

"""The agent process: serves the trainers of one node and storage scope.

It owns one shared arena (a memfd handed to each trainer at ``hello``, which maps it and
copies tensor bytes straight into it) and one engine per rank, all drawing on that arena.
The control channel carries only reservations, seals, commits and queries. When a
trainer disconnects, whatever it had reserved but not sealed is discarded; what it had
sealed is persisted and committed as if it were still there. The agent exits by itself
once no trainer has been attached for ``idle_exit`` seconds and nothing is left to persist.
Only processes of the agent's own user may connect (the socket is 0600 in a 0700
directory, and the peer's uid is checked). Two requests need no hello (agent/control.py,
``nebulite agent status|stop``): ``status`` (what it holds) and ``stop`` (persist the
newest checkpoint held only in memory, refuse new trainers, exit once the store has it).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
from typing import Any

from .. import _core, _room, errors
from .._committed import CommittedVersions
from .._config import parse_path
from . import error_counts, protocol

log = logging.getLogger("nebulite.agent")


#: The largest world size a trainer may announce (engines keep per-rank state).
MAX_WORLD_SIZE = 1 << 20

_RUN_ID = re.compile(r"^[0-9a-zA-Z]{1,64}$")


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.engine: Any = None
        self.key: tuple[int, int] | None = None  # the engine's (rank, world size)
        self.rank = 0
        self.run: str | None = None
        self.reserved: set[tuple[str, str, str]] = set()
        # Versions this trainer put objects in and has not committed (abandoned when it
        # goes), and those it committed that the engine still holds.
        self.staged: set[tuple[str, str]] = set()
        self.committed = CommittedVersions()
        self.leases: dict[int, tuple[tuple[int, int], Any]] = {}  # id -> (engine key, lease)
        self.next_lease = 1


class Agent:
    def __init__(self, socket_path: str, root: str, memory: int, retention: int,
                 commit_timeout: float, io_threads: int, idle_exit: float,
                 prefault: bool = False, reserve_timeout: float = 600.0,
                 file_mode: int = 0) -> None:
        self.socket_path = socket_path
        self.root = root
        self.file_mode = file_mode  # of what it persists: the first trainer's file_mode
        if root:
            _core.set_file_mode(root, file_mode)
        self.retention = retention
        self.commit_timeout = commit_timeout
        self.reserve_timeout = reserve_timeout  # how long a save waits for memory
        self.io_threads = io_threads
        self.idle_exit = idle_exit
        # Memory is taken as saves need it (and reused), unless asked to pre-fault it all.
        self.arena = _core.Arena.create(memory or _core.default_memory_bytes(), prefault, True)
        self.error_counts = error_counts.counts()  # what each engine reported, for trainers
        self.engines: dict[tuple[int, int], Any] = {}
        self.users: dict[tuple[int, int], int] = {}  # trainers attached to each engine
        self.pinned: dict[tuple[int, int], int] = {}  # leases held on each engine's objects
        self.lock = threading.Lock()
        # Commits are numbered here, one at a time (see _commit): the newest number given.
        self.commit_lock = threading.Lock()
        self.newest_seq = 0
        self.runs: dict[str, list[int]] = {}  # run id -> [lock fd, references]
        # (run id, world size) -> rank 0 trainers of that run attached here now (0 once the
        # last one left: what rank 0 had not committed then, it never will; see
        # _left_uncommitted_by_rank_0)
        self.rank_0_trainers: dict[tuple[str, int], int] = {}
        self.cleanups = 0  # detached trainers whose leftovers are still being removed
        self.clients = 0
        self.stopping = False  # asked to stop: no new trainer, exit once persisted
        self.closed = False  # close() began: what its engines did not write stays unwritten
        self.last_detach = time.monotonic()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            if os.path.exists(socket_path):
                os.unlink(socket_path)
            self.listener.bind(socket_path)
        finally:
            os.umask(old)
        os.chmod(socket_path, 0o600)
        self.socket_inode = os.stat(socket_path).st_ino
        self.listener.listen(64)
        self.listener.settimeout(0.5)

    def engine_for(self, rank: int, world_size: int) -> Any:
        """The engine of (rank, world size), counted as used until release_engine()."""
        with self.lock:
            key = (rank, world_size)
            self.users[key] = self.users.get(key, 0) + 1
            if key not in self.engines:
                self.engines[key] = _core.Engine.open(
                    self.root, rank=rank, world_size=world_size, arena=self.arena,
                    io_threads=self.io_threads, retention=self.retention,
                    commit_timeout=self.commit_timeout, reserve_timeout=self.reserve_timeout,
                    file_mode=self.file_mode,
                    error_count=self.error_counts.address(self.error_counts.slot(key)))
            return self.engines[key]

    def release_engine(self, key: tuple[int, int]) -> None:
        with self.lock:
            self.users[key] -= 1
            if not self.users[key]:
                del self.users[key]

    def release_unused_engines(self) -> None:
        """Closes the engines no trainer uses that hold nothing more to do: nothing is left
        to persist, no checkpoint is held in their memory (a trainer restarted on this node
        loads the newest from there, persisted or not), and no trainer has one of their
        objects pinned. Their threads end; a later trainer of that rank gets a new engine."""
        with self.lock:
            unused = [(k, e) for k, e in self.engines.items()
                      if not self.users.get(k) and not self.pinned.get(k)]
        for key, e in unused:
            try:
                e.flush(0.01)  # raises while anything is still to be persisted
            except errors.NebuliteError:
                continue
            if any(v["in_memory"] and not v["failed"] for v in e.versions()):
                continue  # a trainer restarted on this node loads it from memory
            with self.lock:
                if self.users.get(key) or self.pinned.get(key) or self.engines.get(key) is not e:
                    continue
                del self.engines[key]
            with self.commit_lock:  # the numbers it claimed still count
                self.newest_seq = max(self.newest_seq, int(e.newest_seq()))
            try:
                e.close(self.commit_timeout)
            except errors.NebuliteError as ex:
                log.warning("closing the engine of rank %d of %d: %s", key[0], key[1], ex)

    def _idle(self) -> bool:
        with self.lock:
            if not self.stopping and (self.clients or self.cleanups
                                      or time.monotonic() - self.last_detach < self.idle_exit):
                return False
            engines = list(self.engines.values())
        for e in engines:
            try:
                e.flush(0.01)  # raises while anything is still to be persisted
            except errors.NebuliteError:
                return False
        return True

    def serve_forever(self) -> None:
        log.info("nebulite agent %d serving %s", os.getpid(), self.socket_path)
        try:
            while not self._idle():
                try:
                    conn, _ = self.listener.accept()
                except socket.timeout:
                    self.release_unused_engines()
                    continue
                with self.lock:
                    self.clients += 1  # counted before idleness is judged again
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
        finally:
            self.close()

    def close(self) -> None:
        """Stops listening and closes every engine, once it persisted what it holds (up
        to the commit timeout); what failed is logged (trainers were told already)."""
        self.closed = True
        self.listener.close()
        try:  # unless a successor already bound the path anew
            if os.stat(self.socket_path).st_ino == self.socket_inode:
                os.unlink(self.socket_path)
        except OSError:
            pass
        with self.lock:
            engines = list(self.engines.values())
        for e in engines:
            try:
                e.close(self.commit_timeout)
            except errors.NebuliteError as ex:
                log.warning("closing an engine: %s", ex)

    # -- control (``nebulite agent status`` / ``stop``) --------------------------

    def status(self) -> dict[str, Any]:
        """What this agent holds: its memory, its trainers, and each version in memory."""
        with self.lock:
            engines = list(self.engines.items())
            trainers = sum(self.users.values())
        versions = []
        for (rank, world), e in engines:
            for v in e.versions():
                versions.append({k: v[k] for k in (
                    "tag", "version", "seq", "in_memory", "persist_requested", "persisted",
                    "failed", "store_committed")} | {"rank": rank, "world_size": world})
        return {"pid": os.getpid(), "root": self.root, "socket": self.socket_path,
                "capacity": self.arena.capacity, "used": self.arena.used,
                "trainers": trainers, "stopping": self.stopping, "versions": versions,
                "pending": sum(1 for v in versions if _pending(v))}

    def stop(self, force: bool) -> None:
        """Persists the newest committed version each engine holds only in memory, then
        lets serve_forever() end once everything queued is in the store. Refused while
        trainers are attached, unless `force` (they are then told the agent is gone)."""
        with self.lock:
            trainers = sum(self.users.values())
            if trainers and not force:
                raise errors.FailedPreconditionError(
                    f"{trainers} trainer(s) attached; stop them first or force it")
            engines = list(self.engines.values())
        for e in engines if self.root else []:
            held = [v for v in e.versions()
                    if v["seq"] and v["in_memory"] and not v["failed"]
                    and not v["store_committed"]]
            if held:
                newest = max(held, key=lambda v: v["seq"])
                if not newest["persist_requested"]:
                    e.persist(newest["tag"], newest["version"])
        with self.lock:  # once queued: serve_forever() ends when the queue is empty
            self.stopping = True

    def _learn_store_order(self) -> None:
        """Reads the newest commit number claimed in the store (another node's agent, or a
        run without one, may have committed since this agent last looked): once per
        trainer that says hello, so that committing never has to."""
        if not self.root:
            return
        try:
            newest = int(_core.newest_claimed_seq(self.root))
        except errors.NebuliteError as ex:
            log.warning("reading the store's commit numbers: %s", ex)
            return
        with self.commit_lock:
            self.newest_seq = max(self.newest_seq, newest)

    def _commit(self, engine: Any, tag: str, version: str, persist: bool) -> int:
        """Commits a version on one rank under the number the agent gives it: the one
        another rank's commit of that version already got, else one more than every number
        this agent gave, its engines claimed in the store, or found claimed there when a
        trainer last said hello. Committing makes no request to the store, so a trainer
        never waits for it. Trainers send no number (one from a client could be anything,
        up to the end of the range, and every later commit would have to come after it);
        the store's coordinator claims its own, at least this one and above every
        writer's, when the version is committed there."""
        with self.commit_lock:
            with self.lock:
                engines = list(self.engines.values())
            newest, seq = self.newest_seq, 0
            for e in engines:
                for v in e.versions():
                    if v["tag"] == tag and v["version"] == version:
                        seq = int(v["seq"])
                newest = max(newest, int(e.newest_seq()))
            if not seq:
                seq = newest + 1
            engine.commit(tag, version, seq, persist)
            self.newest_seq = max(self.newest_seq, seq)
            return seq

    def _pin_any_rank(self, engine: Any, tag: str, version: str,
                      name: str) -> tuple[tuple[int, int], Any]:
        """Any local rank may load any object of a version: DeepSpeed saves the model on
        rank 0 and every rank loads it straight after commit(). Only committed versions
        are pinned (all that trainers load): an object still being staged would make the
        pin wait for its writer, for ever if that is the trainer asking. Returns the key of
        the engine holding it, and the lease, counted in `pinned` until unpinned."""
        with self.lock:
            engines = sorted(self.engines.items(), key=lambda ke: ke[1] is not engine)
        for key, e in engines:
            if not any(v["tag"] == tag and v["version"] == version for v in e.versions()):
                continue
            try:
                lease = e.pin(tag, version, name)
            except errors.NotFoundError:
                continue
            with self.lock:
                self.pinned[key] = self.pinned.get(key, 0) + 1
            return key, lease
        raise errors.NotFoundError(
            f"{name!r} of version {version!r} of {tag!r} is not in memory, or not committed")

    # -- runs ------------------------------------------------------------------

    def _hold_run(self, run: str) -> None:
        """Marks the trainer's run as alive in the store (a shared lock on the file the
        trainers lock too) for as long as this agent has work of it: a trainer starting
        later removes uncommitted versions only of runs nobody holds."""
        if not self.root:
            return
        with self.lock:
            if run in self.runs:
                self.runs[run][1] += 1
                return
            lock = None
            for _ in range(100):  # None while a clean-up decides about the run: retry
                try:
                    lock = _core.hold_run(self.root, run)
                except errors.NebuliteError as e:
                    log.warning("cannot lock run %s: %s", run, e)
                    break
                if lock is not None:
                    break
                time.sleep(0.01)
            self.runs[run] = [lock, 1]

    def _release_run(self, run: str) -> None:
        with self.lock:
            held = self.runs.get(run)
            if held is None:
                return
            held[1] -= 1
            if held[1] == 0:
                del self.runs[run]
                self.rank_0_trainers = {k: n for k, n in self.rank_0_trainers.items()
                                        if k[0] != run}
                if held[0] is not None:
                    held[0].release()

    def _clean_up_after(self, c: _Connection) -> None:
        """Keeps a departed trainer's run alive until what it committed is in the store
        (the engine removes what it wrote of versions it never committed), up to the
        commit timeout, and then until its versions are written and no longer awaited.
        On a rank other than 0 whose rank 0 served here too, a version that rank 0 does not
        hold committed is not waited for once no rank 0 trainer of the run is attached:
        nothing would commit it (see _left_uncommitted_by_rank_0)."""
        try:
            if self.root and c.engine is not None:  # what it committed must reach the store first
                deadline = time.monotonic() + self.commit_timeout
                while True:
                    try:
                        c.engine.flush(0.05)
                        break
                    except errors.NebuliteError:
                        pass
                    if time.monotonic() < deadline:
                        self._stop_awaiting_commits(c, self._left_uncommitted_by_rank_0(c))
                    elif not self._stop_awaiting_commits(c):
                        break
        finally:
            if c.run:
                self._release_run(c.run)
            if c.key is not None:
                self.release_engine(c.key)
            self.release_unused_engines()
            with self.lock:
                self.cleanups -= 1

    def _left_uncommitted_by_rank_0(self, c: _Connection) -> set[tuple[str, str]]:
        """Of the versions departed trainer `c` (not rank 0) committed, those that rank 0
        of its run does not hold committed, once every rank 0 trainer of that run left this
        agent; else none (rank 0 may still commit them, or serves on another node)."""
        if c.rank == 0 or c.run is None or c.key is None:
            return set()
        with self.lock:
            left = self.rank_0_trainers.get((c.run, c.key[1])) == 0
            rank_0 = self.engines.get((0, c.key[1]))
        if not left or rank_0 is None:
            return set()
        return c.committed - {(v["tag"], v["version"]) for v in rank_0.versions()}

    def _stop_awaiting_commits(self, c: _Connection,
                               only: set[tuple[str, str]] | None = None) -> bool:
        """On a rank other than 0, stops waiting for rank 0 to commit the versions that
        departed trainer `c` committed and this rank persisted: all of them once its commit
        timeout passed (rank 0's trainer may have died before committing them, and nothing
        else would end the wait), or `only` those. True while some of them are still being
        written (until the agent closes)."""
        wanted = c.committed if only is None else c.committed & only
        if not wanted:
            return False
        writing = False
        for v in c.engine.versions():
            if (v["tag"], v["version"]) not in wanted or not _pending(v):
                continue
            if not v["persisted"]:
                writing = True
            elif c.engine.give_up_commit(v["tag"], v["version"]):
                why = ("rank 0's trainer left without committing it" if only is not None else
                       f"rank 0 did not commit it within {self.commit_timeout:g} s of the "
                       f"trainer leaving")
                log.warning("rank %d persisted version %s of '%s', but %s; it stays "
                            "uncommitted", c.rank, v["version"], v["tag"], why)
        return writing and not self.closed

    # -- one trainer ---------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        c = _Connection(sock)
        if uid != os.getuid():
            log.warning("refusing a connection from uid %d", uid)
            self._detach(c)
            return
        # Every request gets a reply and the connection goes on, whatever the request:
        # ending it would abandon the trainer's uncommitted checkpoints. It ends when the
        # trainer says bye or goes away, or after a length over the limit, which leaves
        # the rest of the stream unreadable.
        try:
            while True:
                try:
                    request, _ = protocol.recv(sock)
                except protocol.ProtocolError as e:
                    protocol.send(sock, _error(e))
                    if isinstance(e, protocol.MessageTooLarge):
                        return
                    continue
                if request.get("op") == "bye":
                    return
                reply, fds = self._dispatch(c, request)
                try:
                    protocol.send(sock, reply, fds)
                except protocol.MessageTooLarge as e:  # raised before anything was sent
                    protocol.send(sock, _error(errors.NebuliteError(
                        f"the reply to {request.get('op')!r} is too large: {e}")))
        except OSError:  # the trainer went away (ConnectionError included)
            pass
        finally:
            self._detach(c)

    def _detach(self, c: _Connection) -> None:
        for tag, version, name in c.reserved:  # its writer died mid-staging
            try:
                c.engine.discard(tag, version, name)
            except errors.NebuliteError:
                pass
        # Versions it never committed can never be: their memory goes back at once.
        abandoned = sorted(c.staged)
        for tag, version in abandoned:
            try:
                c.engine.abandon(tag, version)
            except errors.NebuliteError:
                pass
        for lease_id in list(c.leases):
            self._unpin(c, lease_id)
        c.sock.close()
        with self.lock:
            if c.rank == 0 and c.run is not None and c.key is not None:
                self.rank_0_trainers[(c.run, c.key[1])] -= 1
            self.clients -= 1
            self.cleanups += 1
            self.last_detach = time.monotonic()
        threading.Thread(target=self._clean_up_after, args=(c,), daemon=True).start()

    def _unpin(self, c: _Connection, lease_id: int) -> None:
        held = c.leases.pop(lease_id, None)  # an unknown id is no one's: nothing to do
        if held is None:
            return
        key, lease = held
        del lease
        with self.lock:
            self.pinned[key] -= 1
            if not self.pinned[key]:
                del self.pinned[key]

    def _dispatch(self, c: _Connection, r: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        op = r.get("op")
        try:
            if op == "status":
                return {"ok": True} | self.status(), []
            if op == "stop":
                self.stop(bool(r.get("force")))
                return {"ok": True, "pid": os.getpid()}, []
            if op == "hello":
                if self.stopping:
                    raise errors.FailedPreconditionError("the agent is stopping")
                if c.engine is not None:  # what it staged belongs to the engine it has
                    raise errors.FailedPreconditionError("this connection already said hello")
                if r.get("version") != protocol.VERSION:
                    raise errors.UnsupportedVersionError(f"protocol version {r.get('version')!r}")
                rank, world = _int(r, "rank"), _int(r, "world_size")
                if not 1 <= world <= MAX_WORLD_SIZE or not 0 <= rank < world:
                    raise errors.InvalidArgumentError(f"rank {rank} outside world size {world}")
                run = r.get("run")
                if run is not None:
                    if not isinstance(run, str) or not _RUN_ID.match(run):
                        raise errors.InvalidArgumentError(f"run id {run!r} is not valid")
                    if c.run is None:
                        c.run = run
                        self._hold_run(run)
                c.engine = self.engine_for(rank, world)
                self._learn_store_order()
                c.key = (rank, world)
                c.rank = rank
                if rank == 0 and c.run is not None:
                    with self.lock:
                        key = (c.run, world)
                        self.rank_0_trainers[key] = self.rank_0_trainers.get(key, 0) + 1
                reply = {"ok": True, "capacity": self.arena.capacity, "pid": os.getpid()}
                slot = self.error_counts.slot(c.key)
                if r.get("error_counts") is True and slot is not None:
                    reply["error_slot"] = slot  # its count, in the page of the second fd
                    return reply, [self.arena.fd, self.error_counts.fd]
                return reply, [self.arena.fd]
            if c.engine is None:
                raise errors.FailedPreconditionError("say hello first")
            e = c.engine
            if op == "reserve":
                key = (_str(r, "tag"), _str(r, "version"), _str(r, "name"))
                specs = _records(r)
                offset, nbytes, records = e.reserve(*key, specs, wait=bool(r.get("wait", True)))
                c.reserved.add(key)
                c.staged.add(key[:2])
                return {"ok": True, "offset": offset, "bytes": nbytes, "records": records}, []
            if op == "seal":
                key = (_str(r, "tag"), _str(r, "version"), _str(r, "name"))
                crcs = r.get("crcs")
                if not isinstance(crcs, list) or not all(
                        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 32
                        for x in crcs):
                    raise errors.InvalidArgumentError("crcs must be a list of CRC-32 values")
                e.seal(*key, bool(r.get("persist_now")), crcs)
                c.reserved.discard(key)
                return {"ok": True}, []
            if op == "rename_version":
                tag, old, new = _str(r, "tag"), _str(r, "old"), _str(r, "new")
                e.rename_version(tag, old, new)
                if (tag, old) in c.staged:
                    c.staged.discard((tag, old))
                    c.staged.add((tag, new))
                return {"ok": True}, []
            if op == "discard":
                key = (_str(r, "tag"), _str(r, "version"), _str(r, "name"))
                e.discard(*key)
                c.reserved.discard(key)
                return {"ok": True}, []
            if op == "adopt":
                crc = _int(r, "crc32")
                if crc >= 1 << 32:
                    raise errors.InvalidArgumentError("crc32 must be a CRC-32 value")
                e.adopt(_str(r, "tag"), _str(r, "version"), _str(r, "name"), _int(r, "size"), crc)
                c.staged.add((_str(r, "tag"), _str(r, "version")))
                return {"ok": True}, []
            if op == "commit":
                tag, version = _str(r, "tag"), _str(r, "version")
                seq = self._commit(e, tag, version, bool(r.get("persist")))
                c.staged.discard((tag, version))  # nothing of it is abandoned when c goes
                c.committed.remember(tag, version, e.versions)
                return {"ok": True, "seq": seq}, []
            if op == "persist":
                e.persist(_str(r, "tag"), _str(r, "version"))
                return {"ok": True}, []
            if op == "flush":  # with a tag and version, of that version only
                if "tag" in r:
                    e.flush_version(_str(r, "tag"), _str(r, "version"),
                                    _seconds(r, "timeout", 600.0))
                else:
                    e.flush(_seconds(r, "timeout", 600.0))
                return {"ok": True}, []
            if op == "abandon":
                e.abandon(_str(r, "tag"), _str(r, "version"))
                c.staged.discard((_str(r, "tag"), _str(r, "version")))
                return {"ok": True}, []
            if op == "must_persist":
                unstaged = _count(r.get("unstaged_bytes", 0), "unstaged_bytes")
                must = e.must_persist(_str(r, "tag"), _str(r, "version"))
                if not must and unstaged:
                    # The run's other ranks this agent serves stage alike, into the same
                    # memory, at the same time, each evicting its own versions.
                    world = c.key[1] if c.key is not None else 0
                    with self.lock:
                        engines = [x for key, x in self.engines.items()
                                   if key[1] == world and self.users.get(key)]
                    must = _room.will_not_fit(unstaged * max(1, len(engines)), engines or [e])
                return {"ok": True, "value": must}, []
            if op == "versions":
                return {"ok": True, "versions": list(e.versions())}, []
            if op == "pin":
                key, lease = self._pin_any_rank(e, _str(r, "tag"), _str(r, "version"),
                                                _str(r, "name"))
                lease_id = c.next_lease
                c.next_lease += 1
                c.leases[lease_id] = (key, lease)
                return {"ok": True, "lease": lease_id,
                        "offset": lease.address - self.arena.address,
                        "records": lease.records()}, []
            if op == "unpin":
                self._unpin(c, _int(r, "lease"))
                return {"ok": True}, []
            if op == "take_errors":
                return {"ok": True, "errors": e.take_errors()}, []
            if op == "history":
                rows, omitted = _newest_that_fit(list(e.history()))
                return {"ok": True, "rows": rows, "omitted": omitted}, []
            if op == "wait_prefaulted":
                self.arena.wait_prefaulted()
                return {"ok": True}, []
            if op == "memory":
                return {"ok": True, "capacity": self.arena.capacity, "used": self.arena.used,
                        "resident": self.arena.resident}, []
            raise errors.InvalidArgumentError(f"unknown op {op!r}")
        except (errors.NebuliteError, ValueError, TypeError, KeyError) as ex:
            return _error(ex), []
        except Exception as ex:  # a bug of the agent: the trainer is told, and goes on
            log.exception("request %.200r failed", op)
            return _error(errors.NebuliteError(
                f"the agent failed on {op!r}: {type(ex).__name__}: {ex}")), []


def _pending(v: dict[str, Any]) -> bool:
    """A committed version queued for the store and not there yet."""
    return bool(v["seq"] and v["persist_requested"] and not v["store_committed"]
                and not v["failed"])


def _error(ex: BaseException) -> dict[str, Any]:
    kind = type(ex).__name__ if isinstance(ex, errors.NebuliteError) else "InvalidArgumentError"
    return {"ok": False, "error": {"type": kind, "message": str(ex)}}


def _newest_that_fit(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The newest of `rows` whose reply stays within the protocol's limit (the engine
    keeps every row for its whole life), and how many older ones were left out."""
    budget = protocol.MAX_MESSAGE - 256  # the rest of the reply
    kept = 0
    for row in reversed(rows):
        budget -= len(json.dumps(row).encode()) + 2  # ", " between rows
        if budget < 0:
            break
        kept += 1
    return rows[len(rows) - kept:], len(rows) - kept


def _str(r: dict[str, Any], key: str) -> str:
    v = r.get(key)
    if not isinstance(v, str):
        raise errors.InvalidArgumentError(f"{key} must be a string")
    return v


def _int(r: dict[str, Any], key: str) -> int:
    return _count(r.get(key), key)


def _count(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 1 << 63:
        raise errors.InvalidArgumentError(f"{what} must be a non-negative integer")
    return v


_MAX_WAIT = 1e9  # seconds: a longer wait never ends anyway, and stays within the clock's range


def _seconds(r: dict[str, Any], key: str, default: float) -> float:
    v = r.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:  # NaN too
        raise errors.InvalidArgumentError(f"{key} must be a non-negative number of seconds")
    return float(min(v, _MAX_WAIT))


def _records(r: dict[str, Any]) -> list[tuple[str, int]]:
    records = r.get("records", [])
    if not isinstance(records, list):
        raise errors.InvalidArgumentError("records must be a list of [name, size] pairs")
    specs = []
    for rec in records:
        if not (isinstance(rec, list) and len(rec) == 2 and isinstance(rec[0], str)):
            raise errors.InvalidArgumentError("records must be a list of [name, size] pairs")
        specs.append((rec[0], _count(rec[1], "a record's size")))
    return specs


#: The agent's log (beside its socket) is rotated at this size, keeping LOG_BACKUPS old ones.
LOG_BYTES = 4 << 20
LOG_BACKUPS = 2


def log_path(socket_path: str) -> str:
    """The agent's log file: beside its socket, agent-<scope>.log."""
    return socket_path[: -len(".sock")] + ".log"


def _log_beside(socket_path: str) -> None:
    """Logs the ``nebulite`` loggers of this process to the rotated file beside the socket
    (and to a terminal, when the agent was started by hand in one)."""
    from logging.handlers import RotatingFileHandler

    fmt = logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s")
    handlers: list[logging.Handler] = [
        RotatingFileHandler(log_path(socket_path), maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS)]
    if sys.stderr.isatty():
        handlers.append(logging.StreamHandler())
    top = logging.getLogger("nebulite")
    for h in handlers:
        h.setFormatter(fmt)
        top.addHandler(h)
    top.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nebulite agent", description=__doc__)
    p.add_argument("--root", default="",
                   help="persistent storage path, as the trainers pass it to init() "
                        "('' = memory only)")
    p.add_argument("--socket", default=None,
                   help="socket to listen on (default: the one trainers of this node and "
                        "root look for, in their runtime directory: see client.runtime_dir())")
    p.add_argument("--memory", type=int, default=0, help="bytes of shared memory (0 = default)")
    p.add_argument("--retention", type=int, default=2)
    p.add_argument("--commit-timeout", type=float, default=600.0)
    p.add_argument("--io-threads", type=int, default=0)
    p.add_argument("--idle-exit", type=float, default=60.0)
    p.add_argument("--file-mode", type=lambda text: int(text, 8), default=0,
                   help="octal mode of the files it persists (0: 0666 less the umask)")
    p.add_argument("--prefault", action="store_true",
                   help="touch the whole memory budget at start instead of as saves need it")
    p.add_argument("--detach", action="store_true",
                   help="fork and let the first process exit at once, so that the agent is "
                        "no child of the process that started it (trainers pass it)")
    a = p.parse_args(argv)
    if a.detach and os.fork() != 0:
        os._exit(0)  # before any thread is started: the child goes on alone
    if a.root:
        a.root = parse_path("--root", a.root)
    def make() -> Agent:
        return Agent(a.socket, a.root, a.memory, a.retention, a.commit_timeout, a.io_threads,
                     a.idle_exit, a.prefault, file_mode=a.file_mode)

    if a.socket is not None:  # started by a trainer, which holds the start lock
        _log_beside(a.socket)
        agent = make()
    else:  # by hand: the trainers' socket, unless an agent already serves it
        from .client import _connect, socket_path

        a.socket = socket_path(a.root or None)
        with open(a.socket[: -len(".sock")] + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            other = _connect(a.socket)
            if other is not None:
                other.close()
                print(f"nebulite agent: an agent already serves {a.socket}", file=sys.stderr)
                return 1
            _log_beside(a.socket)
            agent = make()
    agent.serve_forever()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The Nebula-compatible API: init, Checkpoint, get_latest_checkpoint and friends.

A checkpoint is identified by its tag; each save of a tag is a new *version*. The
life of a version: ``save()`` stages each object in the memory tier and returns;
the version completes when ``num_files`` objects were saved or ``commit()`` is
called; it is then loadable from memory at once, and, when it is due (see
``persistent_time_interval``), persisted in the background and committed in the
store. Readers only ever see committed versions.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from . import _core, _device, _dist, _pinned, _room, _stager, _staging, _waiting
from ._committed import CommittedVersions
from ._save_dir import Placeholders
from ._config import Config, is_store_url, parse_path, parse_seconds, read_threads, store_exists
from ._serialization import (ArchiveSource, flatten, load_archive, new_buffer, resolve_weights_only,
                             skeleton_matches_torch)
from .errors import (
    AgentLostError,
    CorruptCheckpointError,
    FailedPreconditionError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    MemoryBudgetError,
    NebuliteError,
    NotFoundError,
    NotInitializedError,
    PersistError,
    StorageFullPersistError,
    StoreInUseError,
    TagMismatchError,
    TornCheckpointError,
)

log = logging.getLogger("nebulite")

#: num_files value meaning "complete when commit() is called" (what DeepSpeed passes).
COMMIT_EXPLICITLY = -2

_lock = threading.RLock()

#: Callers of Checkpoint.load() that get full unpickling when they pass no weights_only.
#: DeepSpeed's Nebula engine loads DeepSpeed's own state: ZeRO optimizer states hold its
#: loss scaler objects, and client states hold whatever the training script put there
#: (an argparse.Namespace, enums). DeepSpeed reads the same files with
#: torch.load(weights_only=False) when Nebula is off; nebulite follows the framework.
_FULL_UNPICKLING_CALLERS = frozenset({"deepspeed.runtime.checkpoint_engine.nebula_checkpoint_engine"})


def _hold_run_lock(root: str, run_id: str) -> Any:
    """Marks run `run_id` alive in the store (a shared lock that the kernel drops when the
    process dies, even by SIGKILL) while the returned lock is held. Node agents working
    for the run hold it too."""
    deadline = time.monotonic() + 5
    while True:
        try:
            lock = _core.hold_run(root, run_id)
        except NebuliteError as e:  # a store without locks: dead runs' leftovers are kept
            log.warning("nebulite: cannot lock %s (%s); leftovers of dead runs are not removed", root, e)
            return None
        if lock is not None or time.monotonic() > deadline:
            return lock
        time.sleep(0.01)  # a clean-up is deciding about this run id right now


def _take_writer_lease(root: str, run_id: str, rank: int, ttl: float, coordinated: bool) -> Any:
    """Refuses to write a store another live job writes (StoreInUseError naming it; see
    nebulite/lease.h). Rank 0 takes the store's writer lease for the job and renews it on a
    C++ thread until the session closes; the other ranks share its run id and its decision
    (coordinated ranks learn it in one collective; a rank looking at the lease by itself
    could see the previous holder's lease while rank 0 takes it over)."""
    keeper, refused = None, None
    # The job's rank 0 decides: with torch.distributed up, its global rank 0, also for a
    # single-rank session (Lightning's DDP opens one on every rank, saving on rank 0 only).
    if (_dist.rank_and_world()[0] if _dist.initialized() else rank) == 0:
        try:
            keeper = _core.acquire_lease(root, run_id, os.uname().nodename, os.getpid(),
                                         max(1, round(ttl)), ttl / 6)
        except StoreInUseError as e:
            refused = str(e)
            if not coordinated:
                raise
    if coordinated:
        decision = _dist.all_gather(refused)[0]
        if decision is not None:
            if keeper is not None:
                keeper.release()
            raise StoreInUseError(str(decision))
    if keeper is not None:
        for p in keeper.take_warnings():
            warnings.warn(f"nebulite: {p}", stacklevel=5)
    return keeper


def _remove_dead_runs_versions(root: str, run_id: str, grace: float) -> None:
    """Deletes uncommitted versions left by runs that died: their lock is free and nothing
    in them changed for `grace` seconds (see nebulite/runs.h). Versions of live runs,
    another trainer's or this one's, are never touched."""
    try:
        removed, problems = _core.remove_dead_runs(root, run_id, grace)
    except NebuliteError as e:
        log.warning("nebulite: leftovers of dead runs in %s are kept: %s", root, e)
        return
    for path in removed:
        log.info("nebulite: removed %s, left uncommitted by a run that died", path)
    for p in problems:
        log.warning("nebulite: %s", p)
    if is_store_url(root):  # uploads of dead runs that the store keeps hidden
        try:
            from .stores import open_client

            for key in open_client(root).abort_stale_uploads(grace):
                log.info("nebulite: aborted the upload of %s, left by a run that died", key)
        except NebuliteError as e:
            log.warning("nebulite: stale uploads in %s are kept: %s", root, e)


@dataclass
class _OpenVersion:
    tag: str
    version: str
    names: list[str] = field(default_factory=list)


class _Session:
    """Everything init() sets up; one per process."""

    @staticmethod
    def selection(config: Config) -> tuple[Any, ...]:
        """Everything that decides which engine and run a session gets: its configuration,
        the rank and world, and the environment that names the run and the node's agent."""
        env = tuple(os.environ.get(v) for v in (
            "NEBULITE_RUN_ID", "NEBULITE_NODE_ID", "NEBULITE_RUNTIME_DIR", "XDG_RUNTIME_DIR", "TMPDIR"))
        return (config, _dist.rank_and_world(), _dist.initialized(), env)

    def __init__(self, config: Config) -> None:
        self.config = config
        self.selected = self.selection(config)
        rank, world = _dist.rank_and_world()
        self.rank = config.rank if config.rank is not None else rank
        self.world_size = config.world_size if config.world_size is not None else world
        run_id = os.environ.get("NEBULITE_RUN_ID")
        if not run_id and self.world_size > 1 and not _dist.initialized():
            raise InvalidArgumentError(
                "world_size > 1 without torch.distributed: set NEBULITE_RUN_ID, in every rank, "
                "to a value unique to this job (letters and digits, such as the scheduler's job "
                "id), or initialise torch.distributed before nebulite.init"
            )
        # A single-rank session (say, the global rank 0 that saves everything for
        # Lightning's DDP) never talks to the other ranks, even with torch.distributed up.
        self.run_id = run_id or (_dist.agree_on_run_id() if self.world_size > 1 else _dist.new_run_id())
        if config.persistent_storage_path:
            _core.set_file_mode(config.persistent_storage_path, config.file_mode)
        # One job writes a store unless the jobs sharing it say so (shared_store).
        self._lease: Any = None
        if config.persistent_storage_path and not config.shared_store:
            self._lease = _take_writer_lease(config.persistent_storage_path, self.run_id,
                                             self.rank, config.lease_ttl, self.coordinated)
        try:
            if config.agent:
                from .agent import client

                try:
                    self.engine = client.attach(
                        config.persistent_storage_path, config.memory_buffer_size,
                        config.num_of_version_in_retention, config.commit_timeout,
                        config.io_threads, config.agent_idle_exit, self.rank, self.world_size,
                        config.prefault, self.run_id, config.agent_timeout, config.file_mode)
                except AgentLostError as e:
                    if not config.agent_fallback:
                        raise
                    self.engine = self._fall_back(e)
            else:
                self.engine = self._open_embedded(config)
            self._finish_init()
            self.pin_memory_if_cuda()
        except BaseException:
            self._release_lease()
            raise

    def _fall_back(self, why: AgentLostError) -> Any:
        """The embedded engine, in place of an agent that stopped answering (agent_fallback)."""
        warnings.warn(f"nebulite: {why}; agent_fallback is on: checkpoints from now on are "
                      "made by this process itself (embedded mode)", RuntimeWarning, stacklevel=4)
        return self._open_embedded(self.config)

    def healthy(self) -> bool:
        """False once its agent stopped answering or another job took its writer lease."""
        return not getattr(self.engine, "lost", False) and self.lease_lost() is None

    def fall_back_if_agent_lost(self) -> None:
        """With agent_fallback, replaces an agent that stopped answering by the embedded
        engine, once: versions open in the agent are forgotten (their saves failed)."""
        if not (self.config.agent_fallback and getattr(self.engine, "lost", False)):
            return
        lost = self.engine
        self.stager.drain()  # what it stages into the lost engine fails with it
        try:
            lost.close(0)
        except NebuliteError:  # what it still had queued failed with it
            pass
        self.engine = self._fall_back(AgentLostError(lost._lost))
        self.open.clear()
        self.pending.clear()
        self.held_commits.clear()
        self._shared_memory = None

    def pin_memory_if_cuda(self) -> bool:
        """Registers the memory tier with CUDA when this process uses CUDA (see
        nebulite._pinned); True if it is pinned."""
        if not _pinned.cuda_in_use():
            return False
        return self.pinned_range().ensure()

    def pinned_range(self) -> _pinned.PinnedRange:
        """The memory tier as this process maps it (registered with CUDA or not)."""
        pinned = getattr(self.engine, "pinned", None)
        if pinned is None:  # the embedded engine
            pinned = self._embedded_pinned = getattr(self, "_embedded_pinned", None) or \
                _pinned.PinnedRange(self.engine.arena_address, self.engine.memory_capacity)
        return pinned

    def release_pinned(self) -> None:
        if isinstance(self.engine, _core.Engine) and getattr(self, "_embedded_pinned", None):
            self._embedded_pinned.release()  # the agent's client releases its own mapping

    def _open_embedded(self, config: Config) -> Any:
        return _core.Engine.open(
            config.persistent_storage_path or "",
            rank=self.rank,
            world_size=self.world_size,
            memory_bytes=config.memory_buffer_size,
            prefault=config.prefault,
            copy_threads=config.copy_threads,
            io_threads=config.io_threads,
            direct_io=config.direct_io,
            retention=config.num_of_version_in_retention,
            commit_timeout=config.commit_timeout,
            file_mode=config.file_mode,
        )

    def _finish_init(self) -> None:
        self._shared_memory: bool | None = None
        self._run_lock: Any = None
        # Asynchronous staging (see wait_staged): the objects whose deferred copies may be
        # running, (tag, version, name, records), which keep their sources alive; the
        # commits, (tag, version, seq, persist), that wait for them; torn checkpoints.
        self.pending: list[tuple[str, str, str, Any]] = []
        self.held_commits: list[tuple[str, str, int, bool]] = []
        self.staging_errors: list[tuple[str, str]] = []
        self.sealer = _device.Sealer()  # seals objects whose copies from a device landed
        self.stager = _stager.Stager()  # the rest of asynchronous saves (nebulite._staging)
        self.open: dict[str, _OpenVersion] = {}
        self.placeholders = Placeholders()  # DeepSpeed's files in its save_dir
        self.deepspeed_loaded: set[tuple[str, str]] = set()  # versions DeepSpeed loaded
        self.committed = CommittedVersions()  # what this session committed
        self.last_persist: float | None = None
        # Version names continue after every one of this run's in the store and in the
        # agent's memory (a run id may be reused), and are never reused within the run.
        self.counter = 0
        self.seq = 0
        for v in self.engine.versions():
            self.seq = max(self.seq, int(v["seq"]))
            parsed = _core.parse_version_name(v["version"])
            if parsed and parsed[0] == self.run_id:
                self.counter = max(self.counter, parsed[1])
        if self.root:
            # Commit order continues after everything visible.
            entries, _ = _core.read_catalog(self.root)
            self.seq = max([self.seq, _newest_claimed_seq(self.root)] + [e["seq"] for e in entries])
            # Ranks that do not talk to each other (no torch.distributed) must agree without
            # talking: only committed versions count for them (none of this run can commit
            # before every rank started), so give such a job a run id of its own.
            self.counter = max(self.counter, _core.highest_version_counter(
                self.root, self.run_id, committed_only=self.world_size > 1 and not self.coordinated))
            # A run is alive while its trainers live or an agent still works for it (the
            # agent holds the run's lock until what it committed is in the store).
            if self.rank == 0:
                self._run_lock = _hold_run_lock(self.root, self.run_id)
                _remove_dead_runs_versions(self.root, self.run_id, self.config.dead_run_grace)

    @property
    def root(self) -> str | None:
        return self.config.persistent_storage_path

    @property
    def coordinated(self) -> bool:
        """True when several ranks decide together through torch.distributed."""
        return self.world_size > 1 and _dist.initialized()

    def new_version(self, tag: str) -> _OpenVersion:
        self.counter += 1
        v = _OpenVersion(tag, _core.version_name(self.run_id, self.counter))
        self.open[tag] = v
        return v

    def memory_shared_by_all_ranks(self) -> bool:
        """True if every rank uses this node's agent, so memory-only versions are loadable
        by all (learnt once, with one collective)."""
        if self._shared_memory is None:
            if self.config.agent:
                from .agent.client import node_id

                mine = f"agent:{node_id()}"
            else:  # the embedded engine: each process's memory is its own
                mine = f"process:{os.getpid()}:{os.uname().nodename}"
            self._shared_memory = len(set(_dist.all_gather(mine))) == 1
        return self._shared_memory

    def close(self) -> None:
        """Drains pending persistence (for at most the commit timeout), then lets the
        run's lock and the store's writer lease go."""
        try:
            self.wait_staged()  # runs what the staging thread still had
            if self.root and isinstance(self.engine, _core.Engine):  # an agent goes on alone
                _waiting.wait_written(self.engine, self.config.commit_timeout, self.root,
                                      "shutdown")
            elif self.root and self.placeholders.waiting:
                # ... but DeepSpeed's placeholders are replaced by this process: those of
                # versions the agent is writing now are replaced once they are committed.
                _waiting.wait_written(self.engine, self.config.commit_timeout, self.root,
                                      "shutdown", only=self.placeholders.versions())
            self.release_pinned()  # before the engine unmaps its arena
            self.engine.close(self.config.commit_timeout)
            self.replace_placeholders(gone=True)
        finally:
            self.stager.close()
            self.sealer.drain()
            if self._run_lock is not None:
                self._run_lock.release()
                self._run_lock = None
            self._release_lease()

    def replace_placeholders(self, gone: bool = False) -> None:
        """Replaces DeepSpeed's placeholders of versions now committed in the store by the
        committed files (see nebulite._save_dir); with `gone`, forgets the others."""
        if self.placeholders.waiting:
            committed = {(e["tag"], e["version"]) for e in _store_entries(self.root)} if self.root else set()
            alive = None if gone else {(v["tag"], v["version"]) for v in self.engine.versions()}
            self.placeholders.replace_committed(self.root or "", committed, alive)

    def _release_lease(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def lease_lost(self) -> StoreInUseError | None:
        """The error naming the job that took this job's writer lease (None while held)."""
        if self._lease is None:
            return None
        for p in self._lease.take_warnings():
            log.warning("nebulite: %s", p)
        try:
            self._lease.check()
        except StoreInUseError as e:
            return e
        return None

    def wait_staged(self, on_device: bool = False) -> None:
        """The barrier of asynchronous staging (the optimizer's step pre-hook runs it with
        `on_device`, and every call that reads or commits): waits until the deferred copies
        landed (copies from a device: with `on_device`, the device's current stream waits
        for them and the host does not; see nebulite._device), fails
        each checkpoint a deferred tensor of which changed since save() (it is abandoned,
        never committed, and a TornCheckpointError waits in staging_errors for the next
        call), commits the others whose commit waited, and lets the sources go. With
        `on_device` (inside the optimizer's step) it raises no NebuliteError: what fails
        fails its versions, and the next call raises why."""
        if not self.pending and not self.held_commits:
            if not on_device:
                self.sealer.drain()  # its thread, kept across the optimizer's barriers, ends
            return
        pending, self.pending = self.pending, []
        held, self.held_commits = self.held_commits, []
        torn: dict[tuple[str, str], str] = {}
        failed: dict[tuple[str, str], str] = {}
        self.stager.drain(stop=not on_device)
        pending = self._finish_scanned(pending, torn, failed)
        try:
            self.engine.wait_staged()
        except BaseException as e:
            self.sealer.drain()  # no copy may still land in what is abandoned
            if not on_device or not isinstance(e, NebuliteError):
                for tag, version, _, _ in held:
                    self.engine.abandon(tag, version)
                raise
            # The engine's deferred copies or seals failed (its agent was lost, say), and
            # it dropped what was queued behind them: at the optimizer's barrier, every
            # version waiting here fails instead, and the next call raises why.
            for key in dict.fromkeys([(t, v) for t, v, _, _ in pending + held]):
                self._fail_staged(*key, "Torn" if key in torn else "Staging", torn.get(
                    key) or failed.get(key) or (
                    f"checkpoint {key[0]!r} ({key[1]}) was not committed: staging it "
                    f"failed: {e}"))
            return
        for tag, version, name, records in pending:
            if records.job is not None:
                records.job.copies.order_after()  # what the device does next waits for them
            if records.checked:
                continue
            records.checked = True  # ordered after its copies now: checked once
            why = records.watch.changed()
            if why is not None and (tag, version) not in torn:
                torn[(tag, version)] = _torn(tag, version, name, why, "its bytes were copied")
        # Objects copied from a device are sealed once their copies landed: the barrier
        # before an optimizer step waits on the device only; every other call, on the host.
        for tag, version, name, records in pending:
            job = records.job
            if job is None:
                continue
            if not on_device or (tag, version) in torn:
                job.done.wait()
            if job.done.is_set() and job.error is not None and (tag, version) not in torn:
                failed.setdefault((tag, version), (
                    f"checkpoint {tag!r} ({version}) was not committed: staging object "
                    f"{name!r} from the device failed: {job.error}"))
        self._persist_streamed(pending, held, torn, failed)
        # A version goes only once every copy into its memory has landed.
        for tag, version, _, records in pending:
            if records.job is not None and (tag, version) in failed:
                records.job.done.wait()
        landing = [e for e in pending if e[3].job is not None and not e[3].job.done.is_set()]
        for errors, code in ((torn, "Torn"), (failed, "Staging")):
            for (tag, version), why in errors.items():
                self._fail_staged(tag, version, code, why)
        waiting = {(e[0], e[1]) for e in landing}
        for i, (tag, version, seq, persist) in enumerate(held):
            if (tag, version) in waiting:  # commits keep their order: the rest waits too
                self.held_commits = held[i:] + self.held_commits
                break
            if (tag, version) in torn or (tag, version) in failed:
                continue
            try:
                self.commit(tag, version, seq, persist)
            except NebuliteError as e:  # raised by the next call, never inside a step
                self._fail_staged(tag, version, "Staging", (
                    f"checkpoint {tag!r} ({version}) was not committed: {e}"))
        self.pending = landing + self.pending
        if not on_device:
            self.sealer.drain()  # every job is done: its thread ends, as the stager's did

    def _persist_streamed(self, pending: list[tuple[str, str, str, Any]],
                          held: list[tuple[str, str, int, bool]],
                          torn: dict[tuple[str, str], str],
                          failed: dict[tuple[str, str], str]) -> None:
        """A held commit to memory only of a version that the staging thread streamed an
        object of (the memory tier was full) persists it, in `held`: the object is in the
        store only, as a synchronous save's commit does. Coordinated ranks agreed at the
        commit to keep it in memory, the engine having foreseen that it would fit (memory
        that another engine of the node took since, or free memory in pieces too small for
        it, can prove that wrong), and a version is persisted by every rank or none: the
        version fails on this rank, in `failed`. (A version committed after the staging is
        persisted by its commit: the engine's must_persist knows.)"""
        streamed = {(tag, version): name for tag, version, name, records in pending
                    if records.streamed}
        for i, (tag, version, seq, persist) in enumerate(held):
            name = streamed.get((tag, version))
            if name is None or persist or (tag, version) in torn:
                continue
            if self.coordinated:
                failed.setdefault((tag, version), (
                    f"checkpoint {tag!r} ({version}) was not committed on rank {self.rank}: "
                    f"object {name!r} did not fit in the memory tier when it was staged and "
                    "went to the store, and the ranks had committed it to memory only; give "
                    "the memory tier more room (memory_buffer_size) or persist more often "
                    "(persistent_time_interval)"))
            else:
                held[i] = (tag, version, seq, True)
                self.last_persist = time.monotonic()

    def _fail_staged(self, tag: str, version: str, code: str, why: str) -> None:
        """Drops a version that asynchronous staging failed; the next call raises `why`.
        Raises nothing (the optimizer's barrier runs it)."""
        try:
            self.engine.abandon(tag, version)
        except NebuliteError as e:  # an agent lost: the next call raises that too
            log.warning("nebulite: abandoning checkpoint %r (%s): %s", tag, version, e)
        if tag in self.open and self.open[tag].version == version:
            del self.open[tag]
        self.placeholders.abandoned(tag)
        log.error("nebulite: %s", why)
        self.staging_errors.append((code, why))

    def _finish_scanned(self, pending: list[tuple[str, str, str, Any]],
                        torn: dict[tuple[str, str], str],
                        failed: dict[tuple[str, str], str]) -> list[tuple[str, str, str, Any]]:
        """`pending` with each object that save() scanned (its entry holds the staging
        thread's job) replaced by its records once the job is done; a failed job fails its
        checkpoint (in `torn` or `failed`)."""
        out = []
        for tag, version, name, records in pending:
            if isinstance(records, _stager.Job):
                assert records.done  # the stager was drained
                e, records.error = records.error, None
                if e is not None:
                    if isinstance(e, TornCheckpointError):
                        torn.setdefault((tag, version),
                                        _torn(tag, version, name, e, "its structure was read"))
                    else:
                        failed.setdefault((tag, version), (
                            f"checkpoint {tag!r} ({version}) was not committed: staging object "
                            f"{name!r} failed: {e}"))
                    continue
                records = records.result
            out.append((tag, version, name, records))
        return out

    def stage_from_device(self, tag: str, version: str, name: str, records: Any,
                          persist_now: bool) -> None:
        """Stages an object holding CUDA storages by device-to-host copies into the arena
        (see nebulite._device). Blocking staging returns once they landed and the object is
        sealed; with async_staging, once they are issued: the device's current stream waits
        for the copies of storages that may change before the next optimizer step, and the
        barrier orders that step after the rest, and commits once they landed."""
        job = _stage_device(self.engine, self.sealer, tag, version, name, records, persist_now)
        if job is None:
            return
        if not _staging.enabled():
            job.done.wait()
            if job.error is not None:
                raise job.error
            return
        job.copies.order_after(unsafe_only=True)
        records.job = job
        self.pending.append((tag, version, name, records))  # kept alive until sealed

    def waits_for_staging(self, tag: str, version: str) -> bool:
        """True if committing (tag, version) must wait for the barrier: deferred copies of
        it may be running, or earlier commits wait (commits keep their order)."""
        if self.held_commits:
            return True
        for t, v, _, _ in self.pending:
            if t == tag and v == version:
                return True
        return False

    def unstaged_bytes(self) -> int:
        """With coordinated ranks, at most how much memory the staging thread has still to
        stage into (the objects asynchronous saves left to it): what must fit for the
        version committed now to stay in memory only. 0 otherwise (see
        barrier_decides_persist)."""
        if not self.coordinated:
            return 0
        return sum(job.nbytes for _, _, _, job in self.pending
                   if isinstance(job, _stager.Job) and not job.done)

    def must_persist(self, tag: str, version: str) -> bool:
        """True if (tag, version) must be persisted: an object of it was streamed, or what
        the staging thread still stages will not fit in memory (see nebulite._room; the
        node agent foresees it for every rank of the run it serves)."""
        unstaged = self.unstaged_bytes()
        if unstaged and not isinstance(self.engine, _core.Engine):
            return self.engine.must_persist(tag, version, unstaged)  # the agent foresees
        return (self.engine.must_persist(tag, version)
                or _room.will_not_fit(unstaged, [self.engine]))

    def barrier_decides_persist(self, v: _OpenVersion) -> bool:
        """True if the barrier learns whether `v` must be persisted, so that its commit
        need not ask the engine (an agent's answer is a request): each object saved in `v`
        waits for the staging thread (the barrier then holds the commit, and persists the
        version if one of them went to the store, see _persist_streamed). Not with
        coordinated ranks, which agree on persisting at the commit."""
        if self.coordinated:
            return False
        waiting = sum(1 for t, version, _, job in self.pending
                      if version == v.version and t == v.tag and isinstance(job, _stager.Job))
        return waiting == len(v.names)

    def take_background_errors(self) -> list[tuple[str, str]]:
        # The engine's first: if taking them raises, the staging errors wait for the next call.
        taken = [(str(c), str(m)) for c, m in self.engine.take_errors()]
        torn, self.staging_errors = self.staging_errors, []
        return torn + taken

    def commit(self, tag: str, version: str, seq: int, persist: bool) -> None:
        """Commits `version` of `tag` in the engine (every object of it staged)."""
        self.engine.commit(tag, version, seq, persist)
        self.placeholders.committed(tag, version, self.rank)
        try:  # (with an agent, its look-up is one request per tens of commits)
            self.committed.remember(tag, version, self.engine.versions)
        except NebuliteError:
            pass  # the commit stands: a lost agent is the next call's error

    def flush_committed(self, timeout: float) -> None:
        """Waits until the versions this session committed and queued for the store are
        committed there, raising the failure of one that failed. Unlike the engine's
        flush, not for the versions of an earlier trainer that the node agent still
        persists or awaits the commit of."""
        deadline = time.monotonic() + timeout
        for v in self.engine.versions():
            if ((v["tag"], v["version"]) in self.committed and v["persist_requested"]
                    and not v["store_committed"]):
                self.engine.flush_version(v["tag"], v["version"],
                                          max(0.0, deadline - time.monotonic()))

    def raise_background_errors(self) -> None:
        """Raises what failed in the background on this rank. With several coordinated
        ranks, use raise_background_errors_together() in calls every rank makes."""
        _raise_persist_errors(self.take_background_errors())

    def raise_background_errors_together(self) -> None:
        """In a call every rank makes (commit, get_latest_checkpoint): if any rank has a
        background error, every rank raises the same PersistError, naming each rank's
        errors. One small collective; a second one only when something failed."""
        errors = self.take_background_errors()
        if not self.coordinated:
            _raise_persist_errors(errors)
            return
        if not _dist.all_reduce_max([int(bool(errors))])[0]:
            return
        everyone = _dist.all_gather(errors)
        _raise_persist_errors([(c, f"rank {r}: {m}") for r, errs in enumerate(everyone)
                               for c, m in errs])  # type: ignore[union-attr]


def _newest_claimed_seq(root: str) -> int:
    """The newest commit number claimed in the store (0 when it cannot be read)."""
    try:
        return int(_core.newest_claimed_seq(root))
    except NebuliteError:
        return 0


def _torn(tag: str, version: str, name: str, why: object, before: str) -> str:
    """What a checkpoint that asynchronous staging found torn is failed with."""
    return (f"checkpoint {tag!r} ({version}) is torn and was not committed: in object {name!r}, "
            f"{why} after save() and before {before} (with async_staging, change saved tensors "
            "only through optimizer.step(), or call nebulite.wait_staged() first)")


def _raise_persist_errors(errors: list[tuple[str, str]]) -> None:
    if not errors:
        return
    if all(c == "Torn" for c, _ in errors):
        raise TornCheckpointError("; ".join(msg for _, msg in errors), errors)
    text = "; ".join(f"{code}: {msg}" for code, msg in errors)
    cls = StorageFullPersistError if any(c == "NoSpace" for c, _ in errors) else PersistError
    raise cls(f"background persistence failed: {text}", errors)


_session: _Session | None = None
_verified: dict[tuple[str, str, str], bool] = {}


def _require_session() -> _Session:
    if _session is None:
        raise NotInitializedError("nebulite.init() must be called before saving checkpoints")
    _session.fall_back_if_agent_lost()
    return _session


def init(
    persistent_storage_path: str | os.PathLike[str] | None = None,
    persistent_time_interval: float | None = None,
    num_of_version_in_retention: int | None = None,
    **more: Any,
) -> None:
    """Configures nebulite for this process.

    Args:
        persistent_storage_path: where committed checkpoints are persisted (a local or
            mounted directory). Default: ``$NEBULA_PERSISTENT_STORAGE_PATH``; without
            one, checkpoints live in the memory tier only.
        persistent_time_interval: minimum seconds between two checkpoints persisted to
            the path (default ``$NEBULA_PERSISTENT_TIME_INTERVAL``, else 0: persist
            every checkpoint). Checkpoints in between stay in memory, loadable.
        num_of_version_in_retention: committed versions kept (default 2; 0 keeps all).
        **more: ``memory_buffer_size`` (bytes; default ``$NEBULA_MEMORY_BUFFER_SIZE``,
            else a quarter of RAM), ``io_threads``, ``copy_threads``, ``direct_io``,
            ``prefault``, ``commit_timeout`` (seconds), ``dead_run_grace`` (seconds; default
            ``$NEBULITE_DEAD_RUN_GRACE``, else an hour: how long an uncommitted version of a
            run that died stays untouched before it is removed), ``rank``, ``world_size``,
            ``async_staging`` (default ``$NEBULITE_ASYNC_STAGING``, else False: copy
            parameters and optimizer state after save() returns; see nebulite._staging),
            ``shared_store`` (default ``$NEBULITE_SHARED_STORE``, else False: let several jobs
            write the persistent path at once; otherwise a second job is refused with
            StoreInUseError), ``lease_ttl`` (seconds, default ``$NEBULITE_LEASE_TTL``, else
            180: how long the job's writer lease of the path lives without renewal).

    Calling init() again with the same configuration, in the same process environment
    (run id, node id, runtime directory, rank and world), keeps the session and its memory
    tier (a second DeepSpeed engine or Lightning strategy in one process calls it again);
    otherwise it drains the previous configuration's pending work first.
    """
    _open(Config.resolve(
        persistent_storage_path, persistent_time_interval, num_of_version_in_retention, dict(more)
    ))


def _open(config: Config) -> None:
    global _session
    with _lock:
        if (_session is not None and _session.selected == _Session.selection(config)
                and _session.healthy()):
            return
        if _session is not None:
            old, _session = _session, None
            old.close()
            _staging.disable()
        _session = _Session(config)
        if config.async_staging:
            _staging.enable(_barrier)


def _barrier() -> None:
    """What the optimizer's step pre-hook runs with async_staging (see nebulite._staging)."""
    with _lock:
        if _session is not None:
            _session.wait_staged(on_device=True)


def _config() -> Config | None:
    """The settings of the current session (None before init())."""
    return _session.config if _session is not None else None


def _reopen_with_path(persistent_storage_path: str | os.PathLike[str]) -> None:
    """init() again with the current settings but another persistent path (pending
    checkpoints of the previous path are drained first)."""
    with _lock:
        config = _require_session().config
        _open(dataclasses.replace(
            config, persistent_storage_path=parse_path("persistent_storage_path", persistent_storage_path)))


def _shutdown() -> None:
    global _session
    with _lock:
        if _session is not None:
            try:
                _session.close()
            except NebuliteError as e:  # pragma: no cover - reported at exit
                log.error("nebulite: pending checkpoints could not be persisted: %s", e)
            _staging.disable()
            _session = None


atexit.register(_shutdown)

_left_behind: list[_Session] = []


def _forget_session_in_child() -> None:
    """A forked child (a DataLoader worker, say) has the parent's engine without its
    threads: never use or destroy it there. The child may call init() afresh."""
    global _session, _lock
    _lock = threading.RLock()  # another thread of the parent may have held it
    if _session is not None:
        _left_behind.append(_session)  # kept alive: its destructor would wait forever
        _session = None
    _staging.disable()


os.register_at_fork(after_in_child=_forget_session_in_child)


#: False where this torch has no CUDA: then nothing is ever pinned, and a save asks no more.
_CUDA_BUILT = bool(torch.backends.cuda.is_built())
#: The object names that passed _validate (a save checks each name once per process).
_valid_names: set[str] = set()


def _validate(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgumentTypeError(f"{what} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(
            f"{what} {value!r} is not valid UTF-8 (a lone surrogate at position {e.start})") from None
    if what == "tag":
        _core.validate_tag(value)  # a path component: no leading '.', not the history file
    else:
        _core.validate_component(value, what)
    return value


class Checkpoint:
    """A handle on the checkpoint `tag`.

    ``Checkpoint(tag, num_files=N)`` completes after N saves on this rank;
    ``num_files=-2`` completes when :meth:`commit` is called. Handles are keyed by
    tag: a new handle of a tag joins the version that earlier handles started.
    Handles returned by :func:`get_latest_checkpoint` and :func:`get_checkpoint`
    refer to a committed version and load from it; ``tag`` is ``''`` when there is
    no such checkpoint.
    """

    def __init__(self, tag: str, num_files: int = 1, *, _committed: dict[str, Any] | None = None) -> None:
        if _committed is None and tag != "":
            _validate(tag, "tag")
        if not isinstance(num_files, int) or (num_files <= 0 and num_files != COMMIT_EXPLICITLY):
            raise InvalidArgumentError(
                f"num_files must be a positive count or {COMMIT_EXPLICITLY}, got {num_files!r}"
            )
        self.tag = tag
        self.num_files = num_files
        self._committed = _committed  # tag, version, seq, tier, root, names
        # The version this handle committed (its commit may wait for asynchronous staging).
        self._written: str | None = None

    def __repr__(self) -> str:
        if self._committed:
            return f"Checkpoint(tag={self.tag!r}, version={self._committed['version']!r})"
        return f"Checkpoint(tag={self.tag!r}, num_files={self.num_files})"

    @property
    def version(self) -> str | None:
        """The committed version this handle loads from (None for a writing handle)."""
        return self._committed["version"] if self._committed else None

    # -- writing --------------------------------------------------------------

    def save(self, name: str, obj: Any) -> None:
        """Stages `obj` (anything picklable holding tensors) as `name`; returns once it is
        safe in the memory tier. Persistence happens in the background."""
        if self.tag == "":
            raise InvalidArgumentError("cannot save into the empty checkpoint handle (tag '')")
        if name not in _valid_names:
            _validate(name, "name")
            if len(_valid_names) < 4096:  # names recur from one checkpoint to the next
                _valid_names.add(name)
        caller = sys._getframe(1)
        # DeepSpeed's engine wrote an empty placeholder at `path` for its own readers.
        placeholder = (caller.f_locals.get("path")
                       if caller.f_globals.get("__name__") in _FULL_UNPICKLING_CALLERS else None)
        with _lock:
            s = _require_session()
            v = s.open.get(self.tag)
            if v is None:
                # What failed in the background since the last checkpoint is raised by the
                # first save of the next one (by every rank at once, at the commit, with
                # coordinated ranks): the saves of its other objects ask nothing of the engine
                # (an agent's is a request).
                if not s.coordinated:
                    s.raise_background_errors()
                v = s.new_version(self.tag)
            if name in v.names:
                raise InvalidArgumentError(f"{name!r} was already saved in checkpoint {self.tag!r}")
            if _CUDA_BUILT:
                s.pin_memory_if_cuda()  # once, when this process has started using CUDA
            # Asynchronous staging records what to copy here and leaves the rest to the
            # staging thread (see nebulite._staging), unless the object is too large for the
            # memory tier (the engine streams it from here, or refuses it).
            scanned = _staging.scan(obj) if _staging.enabled() else None
            if scanned is not None and scanned.storage_bytes > s.engine.memory_capacity:
                scanned = None
            # CUDA storages are flattened where they are only by a skeleton writer that
            # writes what this torch writes (else torch's own copies them to the host).
            if scanned is not None and scanned.devices and not skeleton_matches_torch():
                scanned = None
            try:
                # With an interval of 0 every checkpoint is persisted: start writing now,
                # unless more objects of this checkpoint follow (num_files): writing would
                # compete with staging them for cores and memory bandwidth and lengthen the
                # training stall; committing after the last one starts writing them all.
                # With coordinated ranks the version's name is settled at the commit (rank 0
                # decides), so nothing is written under it before.
                last = self.num_files <= 0 or len(v.names) + 1 >= self.num_files
                persist_now = (bool(s.root) and s.config.persistent_time_interval == 0 and last
                               and not s.coordinated)
                if scanned is not None:
                    if scanned.devices:  # its copies from a device wait for what is queued now
                        scanned.marks = _device.mark(scanned.devices)
                    job = s.stager.submit(functools.partial(
                        _stage_scanned, s.engine, s.sealer, self.tag, v.version, name, s.rank,
                        scanned, persist_now), scanned.image_bytes)
                    s.pending.append((self.tag, v.version, name, job))
                else:
                    s.stager.drain()  # a version's objects are staged in the order saved
                    records = flatten(obj, tag=self.tag, name=name, rank=s.rank, version=v.version)
                    if records.deferred and not records.device_copies:
                        s.pending.append((self.tag, v.version, name, records))  # alive until staged
                    if records.device_copies:
                        s.stage_from_device(self.tag, v.version, name, records, persist_now)
                    else:
                        s.engine.stage(self.tag, v.version, name, records.records, persist_now)
                    del records
            except BaseException:
                s.stager.drain()  # nothing may still be staged into what goes
                s.sealer.drain()  # no copy from a device may still land in what goes
                # A checkpoint missing an object is no checkpoint: the version goes, with
                # the memory and files its earlier objects took (else they would hold the
                # budget for good), and the next save of the tag starts a new one.
                s.engine.abandon(self.tag, v.version)
                del s.open[self.tag]
                s.placeholders.abandoned(self.tag)
                raise
            v.names.append(name)
            if isinstance(placeholder, str):
                s.placeholders.saved(self.tag, name, placeholder)
            if self.num_files > 0 and len(v.names) >= self.num_files:
                self._commit_locked(s)

    def commit(self) -> bool:
        """Completes the checkpoint. Returns True once it is committed (in memory at
        once; in the store in the background when it is due to be persisted). With several
        ranks every rank calls it: a background error of any rank is raised by all. With
        async_staging, a checkpoint whose copies are still running is committed by the
        barrier that follows them (see nebulite._staging), or, torn, never."""
        with _lock:
            s = _require_session()
            s.raise_background_errors_together()
            s.replace_placeholders()
            return self._commit_locked(s)

    def _commit_locked(self, s: _Session) -> bool:
        v = s.open.get(self.tag)
        if v is None:
            if s.world_size > 1:
                # This rank saved nothing but takes part; coordinated ranks other than 0
                # take rank 0's name for the version below.
                if s.rank == 0 or not s.coordinated:
                    v = s.new_version(self.tag)
            else:
                if any(x["tag"] == self.tag for x in s.engine.versions()):
                    return True  # already completed by its num_files
                warnings.warn(f"nebulite: checkpoint {self.tag!r} has nothing to commit", stacklevel=3)
                return False
        now = time.monotonic()
        due = bool(s.root) and (
            s.last_persist is None or now - s.last_persist >= s.config.persistent_time_interval
        )
        # An object streamed to the store must be persisted. The engine knows of the objects
        # staged so far; of those the staging thread stages, the barrier learns it itself,
        # but coordinated ranks agree now: the engine foresees whether they will fit.
        must_here = int(v is not None and not s.barrier_decides_persist(v)
                        and s.must_persist(self.tag, v.version))
        if s.rank == 0 and isinstance(s.engine, _core.Engine):
            # The commit order continues after this session's commits and the store's as
            # far as they are known without a request (read at init; then each commit in
            # the store claims a number above every writer's, which the engine keeps). An
            # agent numbers the commits it makes itself.
            s.seq = max(s.seq, s.engine.newest_seq())
        mine = _core.parse_version_name(v.version)[1] if v is not None else 0
        # A job whose writer lease another job took (this one looked dead: paused, or cut
        # off from the store longer than the lease's TTL) commits nothing more there.
        lost = s.lease_lost()
        if s.coordinated:
            # Rank 0's clock decides for everyone, rank 0 numbers the commit, and rank 0's
            # name for the version is everyone's (a rank that saved nothing, or whose
            # counter moved on a failed save, takes it).
            # Every rank must commit the same tag: the maximum of a digest and of its
            # complement differ from one value and its complement when any rank's differs.
            digest = zlib.crc32(self.tag.encode("utf-8"))
            due_all, must, seq, number, any_lost, top, top_complement = _dist.all_reduce_max(
                [int(due) if s.rank == 0 else 0, must_here, s.seq + 1 if s.rank == 0 else 0,
                 mine if s.rank == 0 else 0, int(lost is not None), digest, 0xFFFFFFFF - digest])
            if top + top_complement != 0xFFFFFFFF:
                self._fail_mismatched_tags(s, v)
            if any_lost:
                raise lost or StoreInUseError(
                    f"rank 0 lost the writer lease of {s.root}: another job writes there now")
            agreed = _core.version_name(s.run_id, number)
            if v is None:
                v = _OpenVersion(self.tag, agreed)
                s.open[self.tag] = v
            elif v.version != agreed:
                s.stager.drain()  # its objects are staged under the old name first
                s.sealer.drain(stop=False)  # ... and sealed
                s.engine.rename_version(self.tag, v.version, agreed)
                v.version = agreed
            s.counter = max(s.counter, number)
        else:
            if lost is not None:
                raise lost
            # Ranks given explicitly, without torch.distributed: each decides alike.
            due_all, must, seq = int(due), must_here, s.seq + 1
        persist = bool(s.root) and bool(due_all or must)
        s.seq = max(s.seq, seq)
        if s.waits_for_staging(self.tag, v.version):
            # Committed by the barrier once its deferred copies landed unchanged.
            s.held_commits.append((self.tag, v.version, seq, persist))
        else:
            s.commit(self.tag, v.version, seq, persist)
        if persist:
            s.last_persist = now
        self._written = v.version
        del s.open[self.tag]
        s.stager.start()  # the rest of its asynchronous saves (see nebulite._stager)
        return True

    def _fail_mismatched_tags(self, s: _Session, v: _OpenVersion | None) -> None:
        """The ranks committed different tags: every rank drops what it saved of its own
        and raises the same error (one more collective, only in this case)."""
        tags = _dist.all_gather(self.tag)
        if v is not None:
            s.engine.abandon(self.tag, v.version)
        s.open.pop(self.tag, None)
        s.placeholders.abandoned(self.tag)
        named = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        raise TagMismatchError(
            f"the ranks committed different tags ({named}); a checkpoint is one tag on every "
            "rank, so nothing of this one is kept (with DeepSpeed, give every rank the same "
            "tag, or set checkpoint.tag_validation to \"Fail\" to be stopped before saving)")

    # -- reading --------------------------------------------------------------

    def load(self, name: str, map_location: Any = None, *, weights_only: bool | None = None) -> Any:
        """Loads object `name` of this committed checkpoint.

        Reads from the memory tier when the version is there, else from the store.
        ``map_location`` is anything ``torch.load`` accepts. ``weights_only`` has
        ``torch.load``'s meaning and default: True unless given, including torch's
        ``TORCH_FORCE_(NO_)WEIGHTS_ONLY_LOAD`` environment switches. DeepSpeed's Nebula
        checkpoint engine, which gives none, loads as DeepSpeed's own ``torch.load`` engine
        does: ``weights_only=False``, from the path its configuration names.
        """
        from_deepspeed = sys._getframe(1).f_globals.get("__name__") in _FULL_UNPICKLING_CALLERS
        if weights_only is None and from_deepspeed:
            weights_only = False
        weights_only = resolve_weights_only(weights_only)
        if not self._committed:
            if self.tag == "":
                raise NotFoundError("no valid checkpoint: this handle has an empty tag")
            with _lock:  # this rank alone: no collective here
                found = _first_intact([e for e in _candidates(None) if e["tag"] == self.tag],
                                      agree=False)
            if not found._committed:
                raise NotFoundError(f"checkpoint {self.tag!r} is not committed")
            self._committed = found._committed
        if from_deepspeed and self._committed["tier"] == "memory":
            _make_save_dir_real(self._committed["tag"], self._committed["version"])
        _validate(name, "name")
        c = self._committed
        if c["tier"] == "memory":
            s = _session
            if s is not None:
                try:
                    lease = s.engine.pin(c["tag"], c["version"], name)
                except NotFoundError:
                    lease = None
                if lease is not None:
                    return _load_from_lease(lease, c, name, map_location, weights_only)
            streamed = {f[0]: f for f in c.get("streamed", [])}
            if name in streamed and c.get("root"):
                # Written straight to the store (too large for the memory left); durable
                # there, though the version may not be committed in the store yet.
                return _load_streamed(c, streamed[name], map_location, weights_only)
            # Not (or no longer) in this process's memory: try the store it belongs to.
            root = c.get("root")
            if not root:
                raise NotFoundError(f"{name!r} of checkpoint {c['tag']!r} is not in memory")
            stored = _find_committed(root, c["tag"], c["version"])
            if stored is None:
                where = ("is held in another rank's memory and not persisted yet "
                         "(flush_persistence() makes it loadable)"
                         if s is not None and name not in c.get("names", []) and s.world_size > 1
                         else "left memory and is not persisted")
                raise NotFoundError(f"{name!r} of checkpoint {c['tag']!r} {where}")
            c = stored
        return _load_from_store(c, name, map_location, weights_only)

    def list_names(self) -> list[str]:
        return list(self._committed["names"]) if self._committed else []


def _stage_device(engine: Any, sealer: _device.Sealer, tag: str, version: str, name: str,
                  records: Any, persist_now: bool,
                  after: dict[Any, Any] | None = None) -> _device.Sealer.Job | None:
    """Issues the copies of an object holding CUDA storages into the arena (see
    nebulite._device.stage; with `after`, behind those events) and returns the job that seals
    it; None when the object is larger than the memory tier, which the engine then staged
    from host memory."""
    try:
        return _device.stage(engine, tag, version, name, records, persist_now, sealer,
                             after=after)
    except MemoryBudgetError:
        if after:
            _device.order_current_after(after)  # the copies to the host below come after
        records.move_to_host()
        records.streamed = bool(engine.stage(tag, version, name, records.records, persist_now)[2])
        return None


def _stage_scanned(engine: Any, sealer: _device.Sealer, tag: str, version: str, name: str,
                   rank: int, scanned: _staging.Scanned, persist_now: bool) -> Any:
    """What the staging thread does for an object save() scanned: checks that its structure
    is still the one saved, flattens it (reading the storages save() copied from its copy
    of them), and stages the records; returns them (they keep the sources alive). Records
    on a CUDA device are copied from there behind the events save() recorded; the barrier
    finds the job that seals them on the records (``records.job``)."""
    def unmoved() -> None:
        why = scanned.moved()
        if why is not None:
            raise TornCheckpointError(why)

    unmoved()
    try:
        records = flatten(scanned.obj, tag=tag, name=name, rank=rank, version=version,
                          scanned=scanned)
    except TornCheckpointError:
        unmoved()  # changed while it was pickled: say which tensor, where it can be told
        raise
    unmoved()  # nor while it was pickled
    if records.device_copies:
        records.job = _stage_device(engine, sealer, tag, version, name, records, persist_now,
                                    after=scanned.marks)
    else:
        records.streamed = bool(engine.stage(tag, version, name, records.records, persist_now)[2])
    return records


def _load_from_lease(lease: Any, c: dict[str, Any], name: str, map_location: Any, weights_only: bool) -> Any:
    records = lease.records()
    source = ArchiveSource(
        {n: size for n, _, size in records},
        read=lambda n: lease.read(n),
        read_into=lambda n, addr: lease.copy_to(n, addr),
        description=f"checkpoint {c['tag']!r} ({c['version']}) object {name!r} in memory",
        offsets={n: offset for n, offset, _ in records},
        lend=lambda n, base=int(lease.address), at={n: o for n, o, _ in records}: base + at[n],
        pin=_session.pin_memory_if_cuda if _session is not None else None,
    )
    try:
        return load_archive(source, map_location, weights_only)
    finally:
        del lease


def _load_streamed(c: dict[str, Any], file: Any, map_location: Any, weights_only: bool) -> Any:
    """Loads an object of this rank that was streamed to the store, from its data file,
    checked against the size and CRC-32 it was written with (there is no manifest to
    read yet: the version may not be committed in the store)."""
    name, size, crc = str(file[0]), int(file[1]), int(file[2])
    rank = _session.rank if _session is not None else 0
    rel = _core.data_file_path(c["tag"], c["version"], rank, name)
    return _load_file(c["root"], rel, _read_verified(c["root"], rel, name, size, crc),
                      map_location, weights_only)


def _manifest(root: str, c: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank `rank`'s manifest of the committed version `c`, read once per catalog entry: a
    committed version's manifests never change (a store request each, on object stores)."""
    memo = c.setdefault("manifests", {})
    if rank not in memo:
        memo[rank] = _core.read_manifest(root, c["tag"], c["version"], rank)
    return memo[rank]


def _locate(root: str, c: dict[str, Any], name: str, rank: int) -> tuple[str, tuple[str, int, int]]:
    """Path and manifest entry of `name`, preferring this rank's own file."""
    world = int(c.get("world_size", 1))
    order = [rank] + [r for r in range(world) if r != rank] if rank < world else list(range(world))
    for r in order:
        m = _manifest(root, c, r)
        for entry in m["files"]:
            if entry[0] == name:
                return _core.data_file_path(c["tag"], c["version"], r, name), tuple(entry)
    raise NotFoundError(f"checkpoint {c['tag']!r} has no object {name!r}")


def _load_from_store(c: dict[str, Any], name: str, map_location: Any, weights_only: bool) -> Any:
    root = c["root"]
    rank = _session.rank if _session is not None else 0
    rel, _ = _locate(root, c, name, rank)
    # Read and verified already when the handle was found (see _verify): no second read.
    return _load_file(root, rel, c.get("prefetched", {}).pop(name, None), map_location,
                      weights_only)


def _load_file(root: str, rel: str, buffers: dict[str, Any] | None, map_location: Any,
               weights_only: bool) -> Any:
    """Loads data file `rel` of the store: from `buffers` (its records, read and verified
    already) when given, else reading it."""
    path = os.path.join(root, rel)
    try:
        if buffers is not None and not _maps_to_meta(map_location):
            # Every record is there: the file is not read again. (Meta tensors carry their
            # record's offset in the file, which only the file's index gives.)
            source = ArchiveSource({n: int(b.numel()) for n, b in buffers.items()},
                                   read=_unreachable, read_into=_unreachable, description=path,
                                   buffers=buffers)
            return load_archive(source, map_location, weights_only)
        archive = _core.StoredArchive.open(root, rel)
        records = archive.records()
        source = ArchiveSource(
            {n: size for n, _, size, _ in records},
            read=lambda n: archive.read(n),
            read_into=lambda n, addr: archive.read_into(n, addr, read_threads(root)),
            description=path,
            offsets={n: offset for n, offset, _, _ in records},
        )
        return load_archive(source, map_location, weights_only)
    except CorruptCheckpointError as e:
        if path in str(e):
            raise
        raise type(e)(f"{path}: {e}") from None


def _maps_to_meta(map_location: Any) -> bool:
    return (isinstance(map_location, str) and map_location == "meta") or (
        type(map_location).__name__ == "device" and getattr(map_location, "type", None) == "meta")


def _unreachable(*args: Any) -> Any:  # pragma: no cover - a record outside the archive
    raise NotFoundError(f"record {args[0]!r} is not in the archive")


def _read_verified(root: str, rel: str, name: str, size: int, crc: int) -> dict[str, Any] | None:
    """Reads data file `rel` whole and verifies it (size, CRC) in one pass, each record
    straight into the buffer a load of it hands out. Returns {record: uint8 tensor}, or
    None (after verifying it the plain way) when its index cannot be read or its records
    do not tile it: the load then reads the file and rejects it."""
    try:
        archive = _core.StoredArchive.open(root, rel)  # the index: small reads at the file's end
    except CorruptCheckpointError:
        # Checking a file is its size and CRC; a bad index is the loader's to reject.
        _core.verify_data_file(root, rel, name, size, crc)
        return None
    spans: list[tuple[int, int, int]] = []
    buffers: dict[str, Any] = {}
    expected: dict[int, int] = {}  # span index -> the record's own CRC-32
    pos = 0
    for rname, offset, rsize, rcrc in sorted(archive.records(), key=lambda r: r[1]):
        if offset < pos or offset + rsize > size:
            _core.verify_data_file(root, rel, name, size, crc)
            return None
        if offset > pos:
            spans.append((pos, offset - pos, 0))  # headers and padding: checksummed only
        buf = new_buffer(rsize)
        buffers[rname] = buf
        expected[len(spans)] = rcrc
        spans.append((offset, rsize, buf.data_ptr()))
        pos = offset + rsize
    if pos < size:
        spans.append((pos, size - pos, 0))
    got = _core.read_data_file(root, rel, name, size, crc, spans, read_threads(root))
    if any(got[i] != c for i, c in expected.items()):
        return None  # the file is intact, a record is not: the load reads it and rejects it
    return buffers


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def _verify(root: str, entry: dict[str, Any], ranks: list[int] | None = None,
            prefetch_rank: int | None = None) -> bool:
    """Checks the manifests and data files of `ranks` (default: every rank) of a committed
    version: size and CRC.

    A definitive answer (intact, or damaged) is remembered for the life of the process; an
    error that may pass (EIO, ESTALE, EACCES, a version deleted meanwhile) is not: the
    version is skipped this time only. With `prefetch_rank`, that rank's files are read
    into the buffers a load returns while they are checked (entry["prefetched"], held by
    the handle until loaded): loading them right after reads nothing twice. Files larger
    than half the available memory are only checked, and loaded from the store later."""
    world = int(entry["world_size"])
    ranks = list(range(world)) if ranks is None else ranks
    key = (root, entry["tag"], entry["version"], tuple(ranks))
    if key in _verified:
        return _verified[key]
    prefetched: dict[str, Any] = {}
    where = os.path.join(root, entry["tag"], entry["version"])
    try:
        # This rank's own files first: those are the ones a load reads.
        for r in sorted(ranks, key=lambda r: r != prefetch_rank):
            m = _manifest(root, entry, r)
            if r == prefetch_rank and sum(f[1] for f in m["files"]) > _available_memory() // 2:
                prefetch_rank = None  # too large to hold before it is loaded: check it only
            for name, size, crc in m["files"]:
                path = _core.data_file_path(entry["tag"], entry["version"], r, name)
                if r == prefetch_rank:
                    buffers = _read_verified(root, path, name, size, crc)
                    if buffers is not None:
                        prefetched[name] = buffers
                else:
                    _core.verify_data_file(root, path, name, size, crc)
    except CorruptCheckpointError as e:
        warnings.warn(f"nebulite: skipping damaged checkpoint {entry['tag']!r} ({where}): {e}",
                      stacklevel=4)
        _verified[key] = False
        return False
    except (NotFoundError, OSError) as e:
        warnings.warn(f"nebulite: skipping checkpoint {entry['tag']!r} ({where}) for now, it "
                      f"cannot be read: {e}", stacklevel=4)
        return False
    if prefetched:
        entry["prefetched"] = prefetched
    _verified[key] = True
    return True


def _store_entries(root: str) -> list[dict[str, Any]]:
    entries, problems = _core.read_catalog(root)
    for p in problems:
        warnings.warn(f"nebulite: {p}", stacklevel=4)
    for e in entries:
        e["tier"] = "persistent"
        e["root"] = root
    return entries


def _find_committed(root: str, tag: str, version: str) -> dict[str, Any] | None:
    for e in _store_entries(root):
        if e["tag"] == tag and e["version"] == version:
            return e
    return None


def _resolve_root(persist_path: str | os.PathLike[str] | None) -> str | None:
    if persist_path is not None and persist_path != "":
        return parse_path("persist_path", persist_path)
    if _session is not None and _session.root:
        return _session.root
    env = os.environ.get("NEBULA_PERSISTENT_STORAGE_PATH")
    return parse_path("NEBULA_PERSISTENT_STORAGE_PATH", env) if env else None


def _candidates(persist_path: str | os.PathLike[str] | None) -> list[dict[str, Any]]:
    """Committed versions visible to this process, newest commit first."""
    s = _session
    if s is not None:
        s.fall_back_if_agent_lost()
        s.wait_staged()
    root = _resolve_root(persist_path)
    out: list[dict[str, Any]] = []
    memory_keys: dict[tuple[str, str], dict[str, Any]] = {}
    if s is not None and (root is None or root == s.root):
        for v in s.engine.versions():
            # Loadable from memory, or partly from data files streamed to the store.
            if not v.get("loadable", v["in_memory"]):
                continue
            if v["failed"] and s.world_size > 1:
                continue  # the other ranks' parts never made it: not loadable anywhere
            v = dict(v, tier="memory", root=s.root, world_size=s.world_size, in_store=False)
            out.append(v)
            memory_keys[(v["tag"], v["version"])] = v
    if root is not None and store_exists(root):
        for e in _store_entries(root):
            held = memory_keys.get((e["tag"], e["version"]))
            if held is not None:
                held["in_store"] = True  # committed in the store too: the store's order
                held["seq"] = e["seq"]
            else:
                out.append(e)
    out.sort(key=lambda e: e["seq"], reverse=True)
    return out


def _handle(entry: dict[str, Any]) -> Checkpoint:
    if entry["tier"] == "persistent" and "names" not in entry:
        entry["names"] = [
            f[0]
            for r in range(int(entry["world_size"]))
            for f in _manifest(entry["root"], entry, r)["files"]
        ]
    return Checkpoint(entry["tag"], _committed=entry)


def _first_intact(entries: list[dict[str, Any]], agree: bool = True) -> Checkpoint:
    """The newest of `entries` (newest first) that can be loaded. Alone, this process checks
    every file of each candidate. Coordinated ranks each check only their own share of the
    files (the ranks of the version congruent to theirs), newest first, and agree with one
    small collective per round: each proposes its newest usable commit; when the proposals
    differ, the oldest of them bounds the next round. Once they agree, a second one says
    whether every rank can load it: a version held in memory that the ranks share through
    the store is persisted only then, when every rank holds it."""
    s = _session
    rank = s.rank if s is not None else 0
    if not agree or s is None or not s.coordinated:
        for e in entries:
            if e["tier"] == "memory" or _verify(
                    e["root"], e, prefetch_rank=rank if rank < int(e["world_size"]) else None):
                return _handle(e)
        return Checkpoint("", _committed=None)
    shared = s.memory_shared_by_all_ranks()

    def usable(e: dict[str, Any]) -> bool:
        if e["tier"] == "memory":
            return True  # held here, committed: whether every rank holds it is agreed below
        world = int(e["world_size"])
        mine = [r for r in range(world) if r % s.world_size == s.rank]
        return _verify(e["root"], e, mine, prefetch_rank=s.rank if s.rank < world else None)

    def loadable_everywhere(e: dict[str, Any]) -> bool:
        # Held in memory by every rank (agreed): loadable by every rank when they share one
        # node's agent, or once it is committed in the store too (every rank persists it
        # now and waits). Without a store, each rank loads what it holds itself, and an
        # object another rank holds is a clear error.
        if e["tier"] != "memory" or shared or e.get("in_store") or not s.root:
            return True
        return _persist_and_wait(s, e) is not None

    bound: int | None = None
    while True:
        found = next((e for e in entries
                      if (bound is None or int(e["seq"]) <= bound) and usable(e)), None)
        proposal = int(found["seq"]) if found is not None else 0
        newest, minus_oldest = _dist.all_reduce_max([proposal, -proposal])
        if newest != -minus_oldest:
            bound = -minus_oldest
            continue
        # Every rank holds this version (in its memory or the store): only now is one held
        # in memory persisted, so that no rank waits in the store for a version that another
        # rank never committed. Every rank takes part, whatever it found.
        (failed,) = _dist.all_reduce_max(
            [int(found is not None and not loadable_everywhere(found))])
        if not failed:
            return _handle(found) if found is not None else Checkpoint("", _committed=None)
        bound = newest - 1


def _persist_and_wait(s: _Session, e: dict[str, Any]) -> dict[str, Any] | None:
    """Persists memory-tier version `e` (a committed one) unless it is on its way already,
    and waits until it is committed in the store; its store entry once it is, else None.
    Only `e` is waited for: a restarted trainer's engine may still hold an older run's
    version that will never be committed (its rank 0 died before committing it), given up
    only the commit timeout after that run left."""
    if e["in_memory"] and not e["persist_requested"]:
        s.engine.persist(e["tag"], e["version"])
        s.last_persist = time.monotonic()
    try:
        s.engine.flush_version(e["tag"], e["version"], s.config.commit_timeout)
    except NebuliteError as ex:
        log.warning("nebulite: checkpoint %r could not be persisted: %s", e["tag"], ex)
    stored = _find_committed(s.root, e["tag"], e["version"]) if s.root else None
    if stored is not None:
        e["in_store"] = True
    return stored


def _make_save_dir_real(tag: str, version: str) -> None:
    """DeepSpeed loads `version` of `tag` from the memory tier; some of its readers open the
    files in its save_dir themselves: make them real (see nebulite._save_dir). Every rank
    runs this on its first DeepSpeed load of the version, as every rank loads."""
    with _lock:
        s = _require_session()
        if (tag, version) in s.deepspeed_loaded:
            return
        s.deepspeed_loaded.add((tag, version))
        held = next((v for v in s.engine.versions() if (v["tag"], v["version"]) == (tag, version)), None)
        if s.root:
            stored = _persist_and_wait(s, held) if held is not None else None
            if stored is not None:
                s.placeholders.replace_every_rank(s.root, tag, version, int(stored["world_size"]))
            return
        if held is not None:
            memory = _handle(dict(held, tier="memory", root=None, world_size=s.world_size, in_store=False))
            s.placeholders.write_from_memory(tag, version, lambda name: memory.load(name, weights_only=False))
        if s.coordinated:
            _dist.all_reduce_max([0])  # no rank reads the files before every rank wrote its own


def get_latest_checkpoint(persist_path: str | os.PathLike[str] | None = None) -> Checkpoint:
    """The most recently committed checkpoint (memory tier first), skipping damaged ones
    with a warning. ``.tag`` is ``''`` when there is none."""
    with _lock:
        if _session is not None:
            _session.raise_background_errors_together()
        return _first_intact(_candidates(persist_path))


def get_checkpoint(
    tag: str | None = None,
    persist_path: str | os.PathLike[str] | None = None,
    version: str | None = None,
) -> Checkpoint:
    """The newest committed version of `tag` (the latest checkpoint when `tag` is None), or
    with `version` (a version name, as in ``list_checkpoints()``) that committed version."""
    if tag is None:
        if version is not None:
            raise InvalidArgumentError("get_checkpoint: a version needs its tag")
        return get_latest_checkpoint(persist_path)
    _validate(tag, "tag")
    with _lock:
        return _first_intact([e for e in _candidates(persist_path)
                              if e["tag"] == tag and version in (None, e["version"])])


def list_checkpoints(persist_path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Every committed checkpoint visible here, newest first, as JSON-serialisable dicts.
    ``damaged`` is None, or why the checkpoint's manifests cannot be read (its ``names``
    are then empty)."""
    with _lock:
        out = []
        for e in _candidates(persist_path):
            damaged = None
            if e["tier"] == "memory":
                names = list(e.get("names", []))
            else:
                try:
                    names = _handle(e).list_names()
                except (CorruptCheckpointError, NotFoundError, OSError) as ex:
                    names, damaged = [], str(ex)  # listed all the same: never raise here
            out.append(
                {
                    "tag": e["tag"],
                    "version": e["version"],
                    "seq": int(e["seq"]),
                    "tier": e["tier"],
                    "persisted": bool(e.get("persisted", e["tier"] == "persistent")),
                    "committed_unix_ns": int(e.get("time_unix_ns", 0)),
                    "names": names,
                    "path": os.path.join(e["root"], e["tag"], e["version"]) if e["tier"] == "persistent" else None,
                    "damaged": damaged,
                }
            )
        return out


def get_latest_checkpoint_path(name: str, persist_path: str | os.PathLike[str] | None = None) -> str:
    """Path of object `name` in the newest *persisted* committed checkpoint holding it:
    a real file that ``torch.load`` (and Lightning's ``load_from_checkpoint``) reads, or in
    an object store the URL of its data file.
    Checkpoints of this process already on their way to that path are waited for first.
    Raises NotFoundError when there is none."""
    _validate(name, "name")
    with _lock:
        s, root = _session, _resolve_root(persist_path)
    if s is not None and s.root is not None and s.root == root:
        with _lock:
            s.wait_staged()
        s.flush_committed(s.config.commit_timeout)
        s.raise_background_errors()
    with _lock:
        if root is None or not store_exists(root):
            raise NotFoundError(f"no persistent storage path to look for {name!r} in")
        for e in sorted(_store_entries(root), key=lambda e: e["seq"], reverse=True):
            if not _verify(e["root"], e):
                continue
            try:
                rel, _ = _locate(e["root"], e, name, _session.rank if _session else 0)
            except NotFoundError:
                continue
            return os.path.join(e["root"], rel)
    raise NotFoundError(f"no persisted checkpoint holds {name!r}")


def flush_persistence(timeout: float | None = None) -> None:
    """Persists the newest committed checkpoint if it is only in memory, waits until
    everything pending is committed in the store, and raises any background error.
    ``timeout`` (seconds; default: the commit timeout) may be ``math.inf``: no limit."""
    if timeout is not None:
        timeout = parse_seconds("timeout", timeout)
    with _lock:
        s = _require_session()
        s.wait_staged()
        if not s.root:
            s.raise_background_errors()
            return
        versions = s.engine.versions()
        if versions:
            newest = versions[-1]
            if not newest["persist_requested"] and newest["in_memory"]:
                s.engine.persist(newest["tag"], newest["version"])
                s.last_persist = time.monotonic()
        engine = s.engine
    timeout = timeout if timeout is not None else s.config.commit_timeout
    try:
        _waiting.wait_written(engine, timeout, s.root, "flush_persistence()")
        engine.flush(timeout)
    finally:
        s.raise_background_errors()
    with _lock:
        s.replace_placeholders()


def _persist_versions(wanted: Iterable[tuple[str, str]]) -> None:
    """Persists the committed (tag, version) pairs in `wanted` that are held in memory only,
    now, whatever ``persistent_time_interval`` says (integrations use it for checkpoints
    that must not leave memory unpersisted, such as those Lightning's paths name)."""
    wanted = set(wanted)
    with _lock:
        s = _require_session()
        s.wait_staged()
        if not s.root or not wanted:
            return
        for v in s.engine.versions():
            if (v["tag"], v["version"]) in wanted and v["in_memory"] and not v["persist_requested"] \
                    and not v["failed"]:
                s.engine.persist(v["tag"], v["version"])
                s.last_persist = time.monotonic()


def wait_staged() -> None:
    """Blocks until every save's bytes are in the memory tier. Only needed with
    ``async_staging=True`` before changing saved tensors other than through
    ``optimizer.step()`` (which waits by itself). Raises TornCheckpointError for each
    checkpoint that a deferred tensor changed under (see nebulite._staging)."""
    with _lock:
        if _session is not None:
            _session.wait_staged()
            torn, _session.staging_errors = _session.staging_errors, []
            _raise_persist_errors(torn)


def history() -> list[dict[str, Any]]:
    """The rows this process added to checkpointHistories.csv (also without a store)."""
    with _lock:
        s = _require_session()
        s.wait_staged()
        return list(s.engine.history())


def shutdown() -> None:
    """Drains pending persistence and releases the memory tier (also run at exit)."""
    _shutdown()


def _reset_for_tests() -> None:  # pragma: no cover - used by the test suite
    _verified.clear()
    _shutdown()


def session_info() -> dict[str, Any]:
    s = _require_session()
    return {
        "rank": s.rank,
        "world_size": s.world_size,
        "persistent_storage_path": s.root,
        "memory_capacity": s.engine.memory_capacity,
        "memory_used": s.engine.memory_used,
        "memory_resident": s.engine.memory_resident,
        "memory_pinned": s.pinned_range().pinned,  # registered with CUDA (nebulite._pinned)
        "run_id": s.run_id,
        "agent_pid": getattr(s.engine, "agent_pid", None),  # None: the engine is embedded
    }


__all__ = [
    "COMMIT_EXPLICITLY",
    "Checkpoint",
    "FailedPreconditionError",
    "flush_persistence",
    "get_checkpoint",
    "get_latest_checkpoint",
    "get_latest_checkpoint_path",
    "history",
    "init",
    "list_checkpoints",
    "shutdown",
    "wait_staged",
]

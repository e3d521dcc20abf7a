"""Kill campaign: nebulite's durability promise under SIGKILL.

Runs training processes that only save checkpoints (tests/workers/kill_worker.py) and
SIGKILLs, at random moments, a trainer, the node agent, or both, aiming at the phases of a
checkpoint's life (the restart of a run, save, persist, commit, retention), in four
configurations: the embedded engine and the node agent, with 1 and 2 ranks
(torch.distributed, gloo). After each kill a fresh process that never called init()
(tests/workers/kill_verify.py) checks the store:

- every committed checkpoint is whole and loads bit for bit as saved;
- nothing else is visible (no torn checkpoint, no version without its commit marker);
- get_latest_checkpoint(persist_path) is at least as new as the newest step whose
  flush_persistence() had returned (each rank journals it, fsync'd, after the call).

Where the trainers died and the node agent lived on, the agent is later left to finish
and exit by itself: every step all ranks had committed must then be in the store.

Each scenario keeps one store across its rounds, so every run resumes (and checks) what
the killed runs before it left, and kills also hit the restart path: leftovers of dead
runs, an agent that outlived its trainer. A store's runs save one tag per step or one tag
again and again, with a roomy, tight or (agent) streaming memory budget. Each save is
staged before it returns; with --staging async (or mixed: half the stores) the runs save
with async_staging instead, copying an optimizer's tensors after it. Everything is
drawn from one seed, printed
first; a failure prints the seed, the configuration and the kill schedule of its round,
which --schedule replays.

    python tests/kill_campaign.py --kills 200 [--seed S] [--configs agent-1rank,...]

Prints the figures as a table (see docs/reliability.md) and exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
ZYGOTE = os.path.join(WORKERS, "kill_zygote.py")
RETENTION = 2  # kill_worker.RETENTION (not imported here: it would import torch)


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    agent: bool
    world: int


CONFIGS = {c.name: c for c in (
    Config("embedded-1rank", False, 1),
    Config("embedded-2ranks", False, 2),
    Config("agent-1rank", True, 1),
    Config("agent-2ranks", True, 2),
)}

AIMS = ("restart", "save", "persist", "commit", "retention", "random")
PHASES = ("restart", "save", "persist", "commit", "retention", "idle")
TARGETS = ("trainer", "agent", "both")
#: A run that prints nothing for this long, or a verifier that does not finish, hangs.
HANG_SECONDS = 120.0
#: How long an agent left alone gets to persist what it holds and exit (idle exit: 1 s).
DRAIN_SECONDS = 120.0
AGENT_IDLE_EXIT = "1"
#: Memory budgets (NEBULA_MEMORY_BUFFER_SIZE) of a store's runs. A checkpoint holds about
#: 6.5 MiB on rank 0 and 4 MiB on rank 1. Roomy: many checkpoints fit; tight: about one,
#: each save waits for the previous one to be persisted and evicted; streaming (agent
#: only): the optimizer object is larger than the whole budget and the trainer streams
#: it to the store.
MEMORY = ("roomy", "tight", "streaming")


#: commit_timeout of the runs: how long rank 0 waits for the other ranks' manifests.
COMMIT_TIMEOUT = "10"


def memory_bytes(config: Config, memory: str) -> int:
    tight = 12 if config.agent and config.world > 1 else 8  # the agent's budget is the node's
    return {"roomy": 128 if config.agent else 64, "tight": tight, "streaming": 4}[memory] << 20


# -- kill schedules ---------------------------------------------------------------------

@dataclasses.dataclass
class Schedule:
    """What one round does: the run's shape and whom it kills when.

    The kill comes `delay` seconds after `trigger`: "start" (the run's processes were
    forked); "<line>+<k>", the k-th step of the run (counted from the step it resumed
    after) printing <line> ("saving", "committed") on rank `rank`; or "<event>+<k>", the
    k-th step's version reaching <event> in the store (STORE_EVENTS: its first data file,
    its first manifest, its commit marker), watched from the moment it prints "saving"."""

    target: str        # trainer | agent | both
    rank: int          # the trainer killed (trainer, both); whose lines trigger the kill
    aim: str           # the phase aimed at (AIMS)
    trigger: str       # "start" or "<line>+<k>"
    delay: float       # seconds
    grace: float       # the other processes of the run are killed this long after the kill
    steps: int         # steps the run saves if nothing kills it
    flush_every: int   # flush_persistence() after every n-th step of the run
    drain: bool        # agent configurations: let the agent finish and exit before checking

    def __str__(self) -> str:
        return (f"{self.target}/rank{self.rank}/{self.aim}/{self.trigger}/{self.delay:.4f}/"
                f"{self.grace:.3f}/{self.steps}/{self.flush_every}/{'drain' if self.drain else 'live'}")

    @classmethod
    def parse(cls, text: str) -> "Schedule":
        target, rank, aim, trigger, delay, grace, steps, flush, drain = text.strip().split("/")
        return cls(target, int(rank[len("rank"):]), aim, trigger, float(delay), float(grace),
                   int(steps), int(flush), drain == "drain")


class Estimates:
    """How long the phases take on this machine, learnt from the rounds so far: the
    delays aimed at a phase are drawn around them."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {"ready": [0.5], "save": [0.05], "persist": [0.1],
                                                "run": [1.5]}

    def add(self, key: str, value: float) -> None:
        s = self.samples[key]
        s.append(value)
        del s[:-20]

    def get(self, key: str) -> float:
        s = sorted(self.samples[key])
        return s[len(s) // 2]

    def learn(self, lines: list[tuple[float, str]], t0: float) -> None:
        at: dict[str, float] = {}
        for t, line in lines:
            at[line] = t
            word, _, n = line.partition(" ")
            if word.startswith("resumed"):
                self.add("ready", t - t0)
            elif word == "saved" and f"saving {n}" in at:
                self.add("save", t - at[f"saving {n}"])
            elif word == "flushed" and f"committed {n}" in at:
                self.add("persist", t - at[f"committed {n}"])
            elif word == "done":
                self.add("run", t - t0)


def draw_schedule(rng: random.Random, config: Config, est: Estimates) -> Schedule:
    target = rng.choices(TARGETS, weights=(2, 1, 1))[0] if config.agent else "trainer"
    rank = rng.randrange(config.world)
    steps = rng.randint(3, 6)
    flush_every = rng.randint(1, 3)
    aim = rng.choice(AIMS)
    flushed = [k for k in range(steps) if (k + 1) % flush_every == 0]
    k = rng.choice(flushed)
    if aim == "restart":
        trigger, delay = "start", est.get("ready") * rng.uniform(0.0, 1.1)
    elif aim == "random":
        trigger, delay = "start", est.get("run") * rng.uniform(0.0, 1.0)
    elif aim == "save":
        trigger, delay = f"saving+{rng.randrange(steps)}", est.get("save") * rng.uniform(0.0, 1.0)
    elif rng.random() < 0.5:
        # Seen in the store: the step's first data file (persist), its first manifest (the
        # commit waits for the others, then writes the marker), its marker (retention follows).
        event = {"persist": "data", "commit": "manifest", "retention": "marker"}[aim]
        trigger, delay = f"{event}+{k}", rng.choice((0.0, rng.uniform(0.0, 0.004)))
    else:
        # After commit() returns the step is written (persist), its manifests and marker
        # written (commit), then retention runs; flush_persistence() returns after all.
        lo, hi = {"persist": (0.0, 0.6), "commit": (0.5, 1.0), "retention": (0.8, 1.2)}[aim]
        trigger, delay = f"committed+{k}", est.get("persist") * rng.uniform(lo, hi)
    grace = rng.choice((0.0, rng.uniform(0.0, 0.5)))
    drain = config.agent and rng.random() < 0.25
    return Schedule(target, rank, aim, trigger, delay, grace, steps, flush_every, drain)


# -- processes ------------------------------------------------------------------------

class Zygote:
    """The fork server (tests/workers/kill_zygote.py), and the processes it forked."""

    def __init__(self, workdir: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.stderr_path = os.path.join(workdir, "zygote.err")
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, ZYGOTE], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        self.spawned: list[int] = []  # pids of everything it forked
        hello = self.proc.stdout.readline()
        if not hello:
            self.close()
            with open(self.stderr_path) as f:
                raise RuntimeError(f"the fork server did not start:\n{f.read()[-3000:]}")

    def request(self, **req: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork server died")
        return json.loads(line)

    def close(self) -> None:
        """Kills everything it forked or adopted, then lets it exit."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Child:
    """A forked worker or verifier: its stdout lines (timestamped) come through a FIFO,
    its end through a pidfd, so that it is signalled only while it is itself."""

    def __init__(self, zygote: Zygote, role: str, argv: list[str], env: dict[str, str],
                 directory: str, name: str) -> None:
        self.zygote, self.name = zygote, name
        self.fifo = os.path.join(directory, f"{name}.out")
        self.stderr_path = os.path.join(directory, f"{name}.err")
        os.mkfifo(self.fifo)
        self.rfd = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK)
        self._keep = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)  # no EOF before it opens
        self.pid = int(zygote.request(op="spawn", role=role, argv=argv, env=env,
                                      stdout=self.fifo, stderr=self.stderr_path)["pid"])
        self.pidfd = os.pidfd_open(self.pid)  # it is not reaped before we ask: still itself
        zygote.spawned.append(self.pid)
        self.lines: list[tuple[float, str]] = []
        self._partial = b""
        self.returncode: int | None = None
        self.killed_at: float | None = None

    @property
    def exited(self) -> bool:
        return self.returncode is not None

    def read(self) -> list[tuple[float, str]]:
        new = []
        while True:
            try:
                data = os.read(self.rfd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            now = time.monotonic()
            self._partial += data
            *done, self._partial = self._partial.split(b"\n")
            new += [(now, x.decode(errors="replace")) for x in done]
        self.lines += new
        return new

    def kill(self) -> None:
        if self.returncode is None:
            if self.killed_at is None:
                self.killed_at = time.monotonic()
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def has_ended(self) -> bool:
        return bool(select.select([self.pidfd], [], [], 0)[0])

    def finish(self) -> int:
        """After it ended: its last lines, its exit status; releases everything."""
        if self.returncode is None:
            self.read()
            self.returncode = int(self.zygote.request(op="wait", pid=self.pid)["returncode"])
            for fd in (self.rfd, self._keep, self.pidfd):
                os.close(fd)
            os.unlink(self.fifo)
        return self.returncode

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            with open(self.stderr_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""


class Agents:
    """The node agents of one scenario (runtime directory), found by their command line and
    held by pidfds."""

    def __init__(self, runtime_dir: str) -> None:
        self.runtime_dir = runtime_dir
        self.pidfds: dict[int, int] = {}
        self.seen: list[int] = []  # every agent ever tracked

    def _is_ours(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            return False
        return b"nebulite.agent" in argv and any(a.startswith(os.fsencode(self.runtime_dir + "/"))
                                                 for a in argv)

    def track(self, pid: int) -> None:
        if pid in self.pidfds:
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        if self._is_ours(pid):  # checked after opening: the pidfd is this very process
            self.pidfds[pid] = fd
            self.seen.append(pid)
        else:
            os.close(fd)

    def scan(self) -> None:
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in self.pidfds and self._is_ours(int(entry)):
                self.track(int(entry))

    def alive(self) -> list[int]:
        self.scan()
        for pid, fd in list(self.pidfds.items()):
            if select.select([fd], [], [], 0)[0]:
                os.close(fd)
                del self.pidfds[pid]
        return sorted(self.pidfds)

    def kill(self, pids: Iterable[int] | None = None) -> list[int]:
        killed = []
        for pid in list(self.pidfds if pids is None else pids):
            fd = self.pidfds.get(pid)
            if fd is None:
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed

    def wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        self.kill()
        self.wait_gone(30)
        for fd in self.pidfds.values():
            os.close(fd)
        self.pidfds.clear()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- where a kill landed ----------------------------------------------------------------

#: Triggers seen in the store: a data file of the step, its first manifest, its marker.
STORE_EVENTS = ("data", "manifest", "marker")


def version_name(run_id: str, k: int) -> str:
    """The version the k-th checkpoint of a run creates (every rank names it alike)."""
    return f"v{run_id}-{k + 1:06d}"


def store_event(store: str, tag: str, version: str, event: str) -> bool:
    """Whether version `version` of `tag` has reached `event` in the store."""
    vdir = os.path.join(store, tag, version)
    try:
        entries = os.listdir(vdir)
    except OSError:
        return False
    if event == "marker":
        return "COMMITTED" in entries
    if event == "manifest":
        return any(e.endswith(".manifest") for e in entries)
    for e in entries:
        if e.startswith("rank") and not e.endswith(".manifest"):
            try:
                if os.listdir(os.path.join(vdir, e)):
                    return True
            except OSError:
                pass
    return False


def store_snapshot(store: str) -> list[dict[str, Any]]:
    """Every version directory: its name, whether it has a marker, manifests, data files."""
    out = []
    try:
        tags = os.listdir(store)
    except FileNotFoundError:
        return out
    for tag in tags:
        if tag.startswith(".") or tag.endswith(".csv"):
            continue
        try:
            versions = os.listdir(os.path.join(store, tag))
        except OSError:
            continue
        for version in versions:
            vdir = os.path.join(store, tag, version)
            try:
                entries = os.listdir(vdir)
            except OSError:
                continue
            data = 0
            for e in entries:
                if e.startswith("rank") and not e.endswith(".manifest"):
                    try:
                        data += len(os.listdir(os.path.join(vdir, e)))
                    except OSError:
                        pass
            out.append({"tag": tag, "version": version,
                        "committed": "COMMITTED" in entries,
                        "manifests": sum(e.endswith(".manifest") for e in entries), "data": data})
    return out


def landed_phase(lines: list[tuple[float, str]], snapshot: list[dict[str, Any]], run_id: str | None) -> str:
    """The phase a kill landed in, from the killed (or triggering) rank's last line and the
    store right after the kill."""
    words = [line.split(" ", 1)[0] for _, line in lines]
    if "resumed" not in words:
        return "restart"
    if words[-1] == "done":
        return "idle"
    mine = []
    for v in snapshot:
        m = re.fullmatch(rf"v{run_id}-(\d+)", v["version"]) if run_id else None
        if m:
            mine.append(dict(v, n=int(m.group(1))))
    newest = max((v["n"] for v in mine if v["committed"]), default=-1)
    if any(not v["committed"] and v["manifests"] and v["n"] > newest for v in mine):
        return "commit"
    if sum(v["committed"] for v in snapshot) > RETENTION or any(
            not v["committed"] and v["n"] < newest for v in mine):
        return "retention"
    if any(not v["committed"] and v["data"] for v in mine):
        return "persist"
    if words[-1] == "saving":
        return "save"
    return "idle"


# -- the campaign -----------------------------------------------------------------------

@dataclasses.dataclass
class Failure:
    kind: str          # lost | torn | order | visible | hang | error | dropped
    config: str
    seed: str
    round: int
    schedule: str
    detail: str
    context: str = ""
    replay: str = ""   # the schedules of the scenario's rounds so far
    tag_mode: str = "step"
    memory: str = "roomy"
    staging: str = "sync"

    def report(self) -> str:
        return (f"FAILURE [{self.kind}] configuration {self.config}, scenario seed {self.seed!r}, "
                f"round {self.round}, kill schedule {self.schedule}\n  {self.detail}\n"
                f"  reproduce: python tests/kill_campaign.py --configs {self.config} "
                f"--scenario-seed '{self.seed}' --rounds {self.round + 1}\n"
                f"  replay the same kills: python tests/kill_campaign.py --configs {self.config} "
                f"--tag {self.tag_mode} --memory {self.memory} --staging {self.staging} "
                f"--schedule '{self.replay}'"
                + (f"\n{self.context}" if self.context else ""))


class Stats:
    def __init__(self) -> None:
        self.runs = collections.Counter()
        self.kills = collections.Counter()
        self.targets = collections.Counter()
        self.aimed = collections.Counter()
        self.landed = collections.Counter()
        self.committed: set[tuple[str, str]] = set()
        self.verified: set[tuple[str, str]] = set()
        self.verifications = 0
        self.excused = 0  # checks a live agent's retention raced with (not held against it)
        self.scenarios = collections.Counter()  # by the tags saved: "step" or "last"
        self.memories = collections.Counter()  # by the memory budget (MEMORY)
        self.stagings = collections.Counter()  # by the staging: "sync" or "async"
        self.journaled = collections.Counter()  # flush_persistence() calls that returned
        self.paths: list[str] = []  # directories the campaign made (all removed at its end)
        self.zygote_pid: int | None = None
        self.pids: list[int] = []  # every worker, checker and agent the campaign started
        self.failures: list[Failure] = []
        self.failure_keys: set[tuple[str, ...]] = set()


class Scenario:
    """One store, runtime directory and journal, and the rounds run on them."""

    def __init__(self, campaign: "Campaign", config: Config, seed: str, tag_mode: str | None = None,
                 memory: str | None = None, staging: str | None = None) -> None:
        self.c, self.config, self.seed = campaign, config, seed
        self.rng = random.Random(seed)
        # One tag per step, or (a third of the scenarios) one tag saved again and again.
        drawn = "last" if self.rng.random() < 1 / 3 else "step"
        self.tag_mode = tag_mode or drawn
        drawn = self.rng.choices(MEMORY, weights=(2, 1, 1))[0]
        if drawn == "streaming" and not config.agent:
            drawn = "tight"
        self.memory = memory or drawn
        # With "async" (or, "mixed", for half the stores) the runs save with async_staging:
        # their objects are an optimizer's tensors, copied after save() returns, and
        # committed by the step after commit(). Drawn last: the other draws stay as they were.
        if staging == "mixed":
            staging = "async" if self.rng.random() < 0.5 else "sync"
        self.staging = staging or "sync"
        self.dir = tempfile.mkdtemp(prefix="s", dir=campaign.workdir)
        self.store = os.path.join(self.dir, "store")
        self.journal = os.path.join(self.dir, "journal")
        self.procs = os.path.join(self.dir, "procs")
        os.makedirs(self.journal)
        os.makedirs(self.procs)
        # Unix socket paths are short: the runtime directory lives right under /tmp.
        self.runtime = tempfile.mkdtemp(prefix="nbkill-")
        campaign.stats.paths.append(self.runtime)
        self.agents = Agents(self.runtime)
        self.owed: int | None = None  # the newest step every rank committed, the agent alive since
        self.round = 0
        self.schedules: list[str] = []
        self.counter = 0

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("NEBULITE_RUN_ID", "NEBULA_PERSISTENT_STORAGE_PATH", "NEBULITE_TEST_KILL",
                            "NEBULA_PERSISTENT_TIME_INTERVAL", "NEBULITE_ASYNC_STAGING")}
        env.update(OMP_NUM_THREADS="1", NEBULITE_RUNTIME_DIR=self.runtime,
                   NEBULITE_AGENT="1" if self.config.agent else "0",
                   NEBULITE_AGENT_IDLE_EXIT=AGENT_IDLE_EXIT,
                   NEBULA_MEMORY_BUFFER_SIZE=str(memory_bytes(self.config, self.memory)))
        return env

    def fail(self, kind: str, detail: str, schedule: Schedule | None, key: str | None = None,
             context: str = "") -> None:
        k = (self.seed, kind, key or detail)
        if k in self.c.stats.failure_keys:
            return
        self.c.stats.failure_keys.add(k)
        f = Failure(kind, self.config.name, self.seed, self.round, str(schedule) if schedule else "-",
                    detail, context, ";".join(self.schedules), self.tag_mode, self.memory,
                    self.staging)
        self.c.stats.failures.append(f)
        self.c.say(f.report())

    # -- one round ------------------------------------------------------------------

    def run_round(self, sched: Schedule) -> bool:
        """Runs, kills, checks. Returns whether a kill was delivered."""
        cfg, st = self.config, self.c.stats
        self.schedules.append(str(sched))
        journaled = self.journaled()
        port = _free_port()
        workers = []
        self.counter += 1
        for rank in range(cfg.world):
            argv = ["--store", self.store, "--journal-dir", self.journal, "--rank", str(rank),
                    "--world", str(cfg.world), "--port", str(port), "--steps", str(sched.steps),
                    "--flush-every", str(sched.flush_every), "--commit-timeout", COMMIT_TIMEOUT,
                    "--tag", self.tag_mode]
            if cfg.agent:
                argv.append("--agent")
            if self.staging == "async":
                argv.append("--async-staging")
            workers.append(Child(self.c.zygote, "worker", argv, self.env(), self.procs,
                                 f"r{self.counter}-rank{rank}"))
        st.runs[cfg.name] += 1
        t0 = time.monotonic()
        trig = workers[min(sched.rank, cfg.world - 1)]
        kill_at = t0 + sched.delay if sched.trigger == "start" else None
        want = None
        if sched.trigger != "start":
            word, k = sched.trigger.split("+")
            want = (word, int(k))
        killed_at: float | None = None
        delivered: list[str] = []
        snapshot: list[dict[str, Any]] = []
        run_id = None
        first: int | None = None
        watch: tuple[str, str, str] | None = None  # (store event, tag, version) awaited
        last_output = t0
        early_exit: list[str] = []
        hang = False
        try:
            while not all(w.exited for w in workers):
                now = time.monotonic()
                deadlines = [last_output + HANG_SECONDS]
                if killed_at is None and kill_at is not None:
                    deadlines.append(kill_at)
                if killed_at is not None:
                    deadlines.append(killed_at + sched.grace)
                if watch is not None:
                    deadlines.append(now + 0.0005)  # watching the store for the moment to kill
                fds = [w.rfd for w in workers if not w.exited] + [w.pidfd for w in workers if not w.exited]
                ready, _, _ = select.select(fds, [], [], max(0.0, min(deadlines) - now))
                for w in workers:
                    if w.exited:
                        continue
                    for t, line in w.read():
                        last_output = t
                        if line.startswith("ready "):
                            fields = dict(x.split("=", 1) for x in line.split()[1:])
                            run_id = fields.get("run")
                            if int(fields.get("agent", "0")):
                                self.agents.track(int(fields["agent"]))
                        word, _, rest = line.partition(" ")
                        if word == "resumed" and journaled is not None and (
                                rest.startswith("none") or int(rest.split()[0]) < journaled):
                            self.fail("lost", f"{w.name} resumed from {rest.split()[0]} although "
                                      f"flush_persistence() had returned for step{journaled}", sched,
                                      key=f"journal {journaled}")
                        if w is not trig:
                            continue
                        if word == "resumed":
                            first = 0 if rest.split()[0] == "none" else int(rest.split()[0]) + 1
                        elif want and first is not None and kill_at is None and killed_at is None \
                                and rest == str(first + want[1]):
                            if word == want[0]:
                                kill_at = t + sched.delay
                            elif word == "saving" and want[0] in STORE_EVENTS and run_id:
                                tag = f"step{first + want[1]}" if self.tag_mode == "step" else "last"
                                watch = (want[0], tag, version_name(run_id, want[1]))
                    if w.pidfd in ready or w.has_ended():
                        w.finish()
                        if killed_at is None and w.returncode != 0:
                            early_exit.append(f"rank{workers.index(w)} exited {w.returncode} "
                                              "before any kill")
                now = time.monotonic()
                if watch is not None and kill_at is None \
                        and store_event(self.store, watch[1], watch[2], watch[0]):
                    kill_at = now + sched.delay
                    watch = None
                if killed_at is None and kill_at is not None and now >= kill_at and not early_exit:
                    delivered = self._kill(sched, workers)
                    killed_at = time.monotonic()
                    snapshot = store_snapshot(self.store)
                    if not delivered:
                        kill_at = None  # nothing to kill (no agent yet): the run goes on
                        killed_at = None
                        want = watch = None
                if (killed_at is not None and now >= killed_at + sched.grace) or early_exit:
                    for w in workers:
                        w.kill()
                if killed_at is None and now - last_output >= HANG_SECONDS:
                    hang = True
                    for w in workers:
                        w.kill()
                    self.agents.kill()
        finally:
            for w in workers:
                if not w.exited:
                    w.kill()
                    while not w.has_ended():
                        time.sleep(0.01)
                    w.finish()
        self.c.estimates[cfg.name].learn(trig.lines, t0)
        context = self._context(workers)

        # What the runs said about themselves.
        for w in workers:
            for _, line in w.lines:
                if line.startswith(("CORRUPT", "LOADERR")):
                    self.fail("torn", f"{w.name}: the resumed checkpoint is not what was saved: {line}",
                              sched, key=line.split()[1] + "/" + line.split()[2], context=context)
        if hang:
            self.fail("hang", f"no output for {HANG_SECONDS:.0f} s", sched, context=context)
        # The port picked for torch.distributed may be taken by someone else meanwhile: not
        # nebulite's doing, the round just did not happen.
        port_taken = any("Address already in use" in w.stderr_tail(20000) for w in workers)
        for e in early_exit:
            if port_taken and not delivered:
                self.c.say(f"{cfg.name} {self.seed} round {self.round}: port {port} was taken; "
                           "the round is not counted")
            elif not any(l.startswith(("CORRUPT", "LOADERR")) for w in workers for _, l in w.lines):
                self.fail("error", e, sched, key=e + str(self.round), context=context)
        if not delivered and not hang and not early_exit:
            bad = [f"{w.name} exited {w.returncode}" for w in workers if w.returncode != 0]
            if bad:
                self.fail("error", "; ".join(bad), sched, key=str(self.round), context=context)

        phase = landed_phase(trig.lines, snapshot, run_id) if delivered else "-"
        if delivered:
            st.kills[cfg.name] += 1
            st.targets[sched.target] += 1
            st.aimed[sched.aim] += 1
            st.landed[phase] += 1
        if self.c.verbose:
            self.c.say(f"{cfg.name} {self.seed} round {self.round}: {sched} -> "
                       f"{', '.join(delivered) or 'no kill'} ({phase}); rc "
                       f"{[w.returncode for w in workers]}; last {trig.lines[-1][1] if trig.lines else '-'}")
        # The agent owes the store every step all ranks committed, unless it was killed.
        if cfg.agent:
            if delivered and sched.target in ("agent", "both") or hang:
                self.owed = None
            else:
                per_rank = [max((int(l.split()[1]) for _, l in w.lines if l.startswith("committed ")),
                                default=-1) for w in workers]
                if min(per_rank) >= 0:
                    self.owed = max(self.owed if self.owed is not None else -1, min(per_rank))
        self.verify(sched, drain=sched.drain, context=context)
        self.round += 1
        return bool(delivered)

    def journaled(self) -> int | None:
        """The newest step any rank's journal holds (a last line cut short is ignored)."""
        steps = []
        for name in os.listdir(self.journal):
            with open(os.path.join(self.journal, name), "rb") as f:
                steps += [int(x) for x in f.read().split(b"\n")[:-1]]
        return max(steps) if steps else None

    def _kill(self, sched: Schedule, workers: list[Child]) -> list[str]:
        trainer = workers[min(sched.rank, len(workers) - 1)]
        done = []
        if sched.target in ("agent", "both"):
            pids = self.agents.alive()
            if not pids:
                return []
            order = [("agent", None), ("trainer", trainer)]
            if sched.target == "both":
                self.c.rng_order.shuffle(order)
            else:
                order = order[:1]
            for what, w in order:
                if w is None:
                    done += [f"agent {p}" for p in self.agents.kill(pids)]
                else:
                    w.kill()
                    done.append(w.name)
            return done
        if trainer.exited:
            return []
        trainer.kill()
        return [trainer.name]

    def _context(self, workers: list[Child]) -> str:
        out = []
        for w in workers:
            last = " | ".join(l for _, l in w.lines[-8:])
            out.append(f"  {w.name} (rc {w.returncode}): {last}")
            err = w.stderr_tail(1500).strip()
            if err:
                out.append("    stderr: " + err.replace("\n", "\n    "))
        return "\n".join(out)

    # -- checks ---------------------------------------------------------------------

    def verify(self, sched: Schedule | None, drain: bool, context: str = "") -> None:
        st = self.c.stats
        drained = False
        if self.config.agent and drain:
            if self.agents.wait_gone(DRAIN_SECONDS):
                drained = True
            else:
                self.fail("hang", f"the node agent did not finish and exit within {DRAIN_SECONDS:.0f} s "
                          "of its last trainer", sched, context=context)
                self.agents.kill()
                self.agents.wait_gone(30)
                self.owed = None
        live = self.config.agent and bool(self.agents.alive())
        out = os.path.join(self.procs, f"verify{self.round}.json")
        argv = ["--store", self.store, "--journal-dir", self.journal, "--world", str(self.config.world),
                "--out", out] + (["--live"] if live else [])
        self.counter += 1
        v = Child(self.c.zygote, "verify", argv, self.env(), self.procs, f"v{self.counter}")
        deadline = time.monotonic() + HANG_SECONDS
        while not v.has_ended() and time.monotonic() < deadline:
            select.select([v.pidfd], [], [], 0.5)
            v.read()
        if not v.has_ended():
            v.kill()
            while not v.has_ended():
                time.sleep(0.01)
            v.finish()
            self.fail("hang", f"the verifier did not finish within {HANG_SECONDS:.0f} s", sched,
                      context=context)
            return
        rc = v.finish()
        try:
            with open(out) as f:
                result = json.load(f)
        except (OSError, ValueError):
            self.fail("error", f"the verifier exited {rc} without a result:\n{v.stderr_tail()}", sched,
                      key=f"verifier{self.round}")
            return
        st.verifications += 1
        st.excused += int(result.get("excused", 0))
        for e in result.get("listed", []):
            st.committed.add((self.seed, e["tag"] + "/" + e["version"]))
        for key in result.get("verified", []):
            st.verified.add((self.seed, key))
        for p in result.get("problems", []):
            detail = p["detail"]
            m = re.search(r"(step\d+/v[0-9a-zA-Z]+-\d+)", detail)
            key = m.group(1) if m else detail
            if p["kind"] == "lost":
                key = f"journal {result.get('journal')}"
            self.fail(p["kind"], ("live agent; " if live else "") + detail, sched, key=key, context=context)
        if drained and self.owed is not None:
            latest = result.get("latest")
            if latest is None or latest < self.owed:
                self.fail("dropped", f"every rank's commit() had returned for step{self.owed} and the "
                          f"agent lived on, but after it finished the latest checkpoint is "
                          f"{'step%d' % latest if latest is not None else 'none'}", sched,
                          key=f"owed {self.owed}", context=context)
            self.owed = None

    def count_commits(self) -> None:
        """Adds the versions the store's history says were committed (retention may have
        deleted them before any check saw them) and the steps the journals promised."""
        st = self.c.stats
        try:
            with open(os.path.join(self.store, "checkpointHistories.csv"), newline="") as f:
                rows = list(csv.reader(f))
        except OSError:
            rows = []
        for row in rows[1:]:
            if len(row) == 11 and row[10] == "committed":
                st.committed.add((self.seed, f"{row[1]}/{row[2]}"))
        for name in os.listdir(self.journal):
            with open(os.path.join(self.journal, name), "rb") as f:
                st.journaled[self.config.name] += f.read().count(b"\n")

    def close(self) -> None:
        self.agents.close()
        self.c.stats.pids += self.agents.seen
        self.count_commits()
        shutil.rmtree(self.runtime, ignore_errors=True)
        if not self.c.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


class Campaign:
    def __init__(self, workdir: str, keep: bool = False, out=None, verbose: bool = False) -> None:
        self.workdir, self.keep, self.out, self.verbose = workdir, keep, out or sys.stdout, verbose
        self.stats = Stats()
        self.estimates = collections.defaultdict(Estimates)
        self.rng_order = random.Random(0)
        self.zygote = Zygote(workdir)

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def scenario(self, config: Config, seed: str, kills: int | None = None, rounds: int | None = None,
                 schedules: list[Schedule] | None = None, tag_mode: str | None = None,
                 memory: str | None = None, staging: str | None = None) -> None:
        """Rounds on one store until `kills` kills were delivered (or `rounds` rounds ran, or
        the given schedules ran), then a last check with the agent gone."""
        s = Scenario(self, config, seed, tag_mode, memory, staging)
        self.stats.scenarios[s.tag_mode] += 1
        self.stats.memories[s.memory] += 1
        self.stats.stagings[s.staging] += 1
        if self.verbose:
            self.say(f"{config.name} {seed}: tags {'step<N>' if s.tag_mode == 'step' else 'last'}, "
                     f"memory {s.memory} ({memory_bytes(config, s.memory) >> 20} MiB), "
                     f"staging {s.staging}")
        self.rng_order.seed(seed)
        try:
            delivered = n = 0
            limit = rounds if rounds is not None else (len(schedules) if schedules is not None
                                                      else 3 * (kills or 0) + 3)
            while n < limit and (kills is None or delivered < kills):
                sched = schedules[n] if schedules is not None else \
                    draw_schedule(s.rng, config, self.estimates[config.name])
                delivered += s.run_round(sched)
                n += 1
            if config.agent:  # the agent finishes what it holds; the store is checked once more
                s.verify(None, drain=True)
        finally:
            s.close()

    def close(self) -> None:
        self.zygote.close()


def plan(kills: int, configs: list[Config], per_scenario: int) -> list[tuple[Config, int]]:
    """Kills shared evenly among the configurations, in scenarios of at most `per_scenario`,
    interleaved so that a shortened campaign still covers them all."""
    quotas = [kills // len(configs) + (i < kills % len(configs)) for i in range(len(configs))]
    queues = []
    for c, q in zip(configs, quotas):
        n = -(-q // per_scenario) if q else 0
        queues.append([(c, q // n + (i < q % n)) for i in range(n)])
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def table(stats: Stats, configs: list[Config], seconds: float) -> str:
    names = [c.name for c in configs]
    rows = [
        ("runs", [stats.runs[n] for n in names], sum(stats.runs.values())),
        ("kills", [stats.kills[n] for n in names], sum(stats.kills.values())),
    ]
    lines = ["| | " + " | ".join(names) + " | total |", "|---" * (len(names) + 2) + "|"]
    for label, per, total in rows:
        lines.append(f"| {label} | " + " | ".join(str(x) for x in per) + f" | {total} |")
    by_config = collections.Counter()
    for seed, key in stats.committed:
        by_config[seed.split(":")[1]] += 1
    ver_config = collections.Counter()
    for seed, key in stats.verified:
        ver_config[seed.split(":")[1]] += 1
    lines.append("| checkpoints committed | " + " | ".join(str(by_config[n]) for n in names)
                 + f" | {len(stats.committed)} |")
    lines.append("| checkpoints verified | " + " | ".join(str(ver_config[n]) for n in names)
                 + f" | {len(stats.verified)} |")
    lines.append("| flushes journaled | " + " | ".join(str(stats.journaled[n]) for n in names)
                 + f" | {sum(stats.journaled.values())} |")
    kinds = collections.Counter()
    for f in stats.failures:
        kinds[(f.config, f.kind)] += 1
    for label, ks in (("checkpoints lost", ("lost",)),
                      ("committed checkpoints the agent dropped", ("dropped",)),
                      ("torn checkpoints seen", ("torn",)),
                      ("other failures", ("order", "visible", "hang", "error"))):
        per = [sum(kinds[(n, k)] for k in ks) for n in names]
        lines.append(f"| {label} | " + " | ".join(str(x) for x in per) + f" | {sum(per)} |")
    t = stats.targets
    a, l = stats.aimed, stats.landed
    lines += [
        "",
        f"stores: {sum(stats.scenarios.values())} (tags step<N>: {stats.scenarios['step']}, "
        f"one tag saved again and again: {stats.scenarios['last']}; memory roomy: "
        f"{stats.memories['roomy']}, tight: {stats.memories['tight']}, "
        f"streaming: {stats.memories['streaming']}; staging sync: {stats.stagings['sync']}, "
        f"async: {stats.stagings['async']})",
        f"kills by target: trainer {t['trainer']}, agent {t['agent']}, both {t['both']}",
        "kills aimed at: " + ", ".join(f"{p} {a[p]}" for p in AIMS),
        "kills landed in: " + ", ".join(f"{p} {l[p]}" for p in PHASES),
        f"verifications: {stats.verifications} (versions retention deleted while a live agent's "
        f"store was being checked: {stats.excused})",
        f"wall time: {seconds:.0f} s",
    ]
    return "\n".join(lines)


def run(kills: int, seed: int, configs: list[Config], per_scenario: int = 8, keep: bool = False,
        out=None, verbose: bool = False, tag_mode: str | None = None,
        memory: str | None = None, staging: str | None = None) -> tuple[Stats, str]:
    """The whole campaign; returns its figures and the table."""
    workdir = tempfile.mkdtemp(prefix="nebulite-kill-")
    t0 = time.monotonic()
    campaign = None
    try:
        campaign = Campaign(workdir, keep, out, verbose)
        campaign.stats.paths.append(workdir)
        campaign.stats.zygote_pid = campaign.zygote.proc.pid
        campaign.say(f"kill campaign: seed {seed}, {kills} kills, configurations "
                     + ", ".join(c.name for c in configs))
        for i, (config, n) in enumerate(plan(kills, configs, per_scenario)):
            campaign.scenario(config, f"{seed}:{config.name}:{i}", kills=n, tag_mode=tag_mode,
                              memory=memory, staging=staging)
        stats = campaign.stats
    finally:
        if campaign is not None:
            campaign.close()
            campaign.stats.pids += campaign.zygote.spawned
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return stats, table(stats, configs, time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=int(os.environ.get("RELIABILITY_KILLS", "200")))
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    p.add_argument("--scenario-kills", type=int, default=10, help="kills per store")
    p.add_argument("--scenario-seed", default=None,
                   help="run the one scenario of this seed (as a failure prints it)")
    p.add_argument("--rounds", type=int, default=None, help="with --scenario-seed: rounds to run")
    p.add_argument("--schedule", default=None,
                   help="rounds of one scenario, as failures print them, separated by ';'")
    p.add_argument("--tag", choices=("step", "last"), default=None,
                   help="the tags every store's runs save (default: drawn per store)")
    p.add_argument("--memory", choices=MEMORY, default=None,
                   help="the memory budget of every store (default: drawn per store)")
    p.add_argument("--staging", choices=("sync", "async", "mixed"), default="sync",
                   help="how the stores' runs stage their saves: before save() returns (sync, "
                   "the default), with async_staging (async), or drawn per store (mixed)")
    p.add_argument("--keep", action="store_true", help="keep the stores (printed) for inspection")
    p.add_argument("--verbose", action="store_true", help="a line per round")
    a = p.parse_args(argv)
    configs = [CONFIGS[n] for n in a.configs.split(",")]
    if a.scenario_seed is not None or a.schedule is not None:
        workdir = tempfile.mkdtemp(prefix="nebulite-kill-")
        c = Campaign(workdir, a.keep, verbose=a.verbose)
        t0 = time.monotonic()
        try:
            schedules = [Schedule.parse(x) for x in a.schedule.split(";")] if a.schedule else None
            seed = a.scenario_seed or f"replay:{configs[0].name}:0"
            c.scenario(configs[0], seed, kills=None if (a.rounds or schedules) else a.kills,
                       rounds=a.rounds, schedules=schedules, tag_mode=a.tag, memory=a.memory,
                       staging=a.staging)
        finally:
            c.close()
            if a.keep:
                print(f"kept {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        print(table(c.stats, configs[:1], time.monotonic() - t0))
        return 1 if c.stats.failures else 0
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
    stats, text = run(a.kills, seed, configs, a.scenario_kills, a.keep, verbose=a.verbose,
                      tag_mode=a.tag, memory=a.memory, staging=a.staging)
    print(text)
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())

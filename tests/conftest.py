"""Shared fixtures: each test gets a clean nebulite session and environment."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

import nebulite.api

# Node agents detach from the trainer that starts them and are re-parented to the nearest
# subreaper: make it this test process, so that the agents tests start (and end) are reaped
# here by kill_agents_of() instead of lingering under a PID 1 that may not reap.
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER

# The engine runs embedded in the test process (and in the processes tests start) unless
# a test asks for the node agent, the default of init(): tests/test_agent.py and the
# multi-node tests do. Set for the whole session, so module-scoped fixtures see it too.
os.environ["NEBULITE_AGENT"] = "0"

# A Python process this run starts prints the stack of each of its threads when it crashes
# or is aborted (wait_ranks aborts a job that outlived its timeout), so that a hang says where.
os.environ["PYTHONFAULTHANDLER"] = "1"

# The ops DeepSpeed compiles just in time live in the checkout, where scripts/setup.sh built
# the one its CPU collectives need.
os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                      str(Path(__file__).resolve().parent.parent / "build" / "torch_extensions"))

# Caches that torch makes in the system's temporary directory when some packages are
# imported (DeepSpeed: torchinductor_$USER): in one of this run's own, removed at its end.
_RUN_TMP = tempfile.mkdtemp(prefix="nebulite-tests-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_RUN_TMP, "torchinductor")


@pytest.fixture(autouse=True, scope="session")
def _run_tmp():
    yield
    shutil.rmtree(_RUN_TMP, ignore_errors=True)

# Every process this test run starts inherits this mark (agents too: trainers start them
# with their own environment), so that the agents it started, and only those, can be found
# at the end, however many other runs share the machine.
SUITE_MARK = "NEBULITE_TEST_SUITE_ID"
os.environ[SUITE_MARK] = f"{os.getpid()}-{uuid.uuid4().hex}"

#: The tests' timeouts bound a hang, nothing else: what they wait for comes in seconds or
#: less on an idle machine, and many times later on a busy one. A test asserts behaviour.
HANG_TIMEOUT = 600.0
#: The same for a distributed job of a few ranks on the CPU (DeepSpeed, Lightning): seconds
#: to a minute on an idle machine; a job that hangs is aborted with its stacks (wait_ranks)
#: soon enough for the rest of the suite to run.
JOB_TIMEOUT = 300.0


@pytest.fixture(autouse=True)
def _nebulite_env(monkeypatch):
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", str(256 * 1024 * 1024))
    monkeypatch.delenv("NEBULA_PERSISTENT_STORAGE_PATH", raising=False)
    monkeypatch.delenv("NEBULA_PERSISTENT_TIME_INTERVAL", raising=False)
    try:
        yield
    finally:
        nebulite.api._reset_for_tests()


_DEEPSPEED_SHM = Path("/dev/shm")
_DEEPSPEED_SHM_PATTERN = "deepspeed_allreduce_buffer_*"


def _deepspeed_buffers() -> set[Path]:
    return set(_DEEPSPEED_SHM.glob(_DEEPSPEED_SHM_PATTERN)) if _DEEPSPEED_SHM.is_dir() else set()


@pytest.fixture(autouse=True, scope="session")
def _deepspeed_shm_before() -> set[Path]:
    """The DeepSpeed buffers in /dev/shm before this test session: not ours to remove."""
    return _deepspeed_buffers()


@pytest.fixture(autouse=True)
def _deepspeed_shm_buffers(_deepspeed_shm_before):
    """DeepSpeed's CPU collectives write a 66 MiB buffer per rank into /dev/shm and leave it
    there when the process exits: remove the ones this session created after each test,
    rather than hold hundreds of them in memory until the session ends."""
    yield
    for p in _deepspeed_buffers() - _deepspeed_shm_before:
        try:
            p.unlink()
        except OSError:
            pass


def wait_ranks(procs: list[subprocess.Popen], timeout: float = HANG_TIMEOUT) -> list[tuple[Any, Any]]:
    """Waits for the processes of a distributed job and returns what each printed, as
    communicate() does. Once one exits with an error the others are killed: they would
    wait for it in their next collective until its own timeout. Past `timeout`, every one
    still running is aborted, so that the caller reports them with their output and stacks."""
    outs: list[tuple[Any, Any]] = [(None, None)] * len(procs)

    def read(i: int) -> None:
        outs[i] = procs[i].communicate()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        while any(t.is_alive() for t in readers):
            if time.monotonic() > deadline:
                # Each Python process prints where its threads are (PYTHONFAULTHANDLER).
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGABRT)
                deadline = float("inf")
                time.sleep(5)
            if any(p.poll() not in (None, 0) for p in procs):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            for t in readers:
                t.join(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return outs


@pytest.fixture
def store(tmp_path):
    """A fresh persistent storage path (not created yet)."""
    return str(tmp_path / "ckpt")


@pytest.fixture
def agent_env(tmp_path, monkeypatch):
    """A private runtime directory (so each test has its own agent), killed afterwards."""
    rt = Path(tempfile.mkdtemp(prefix="nbrt-"))  # short: Unix socket paths are limited
    monkeypatch.setenv("NEBULITE_RUNTIME_DIR", str(rt))
    yield rt
    remove_runtime_dir(rt)


def _is_agent(cmdline: list[str]) -> bool:
    """`python -m nebulite.agent ...` (started by a trainer), or `nebulite agent ...` /
    `python -m nebulite.cli agent ...` (started by hand)."""
    for i, arg in enumerate(cmdline):
        if arg == "nebulite.agent":
            return True
        if os.path.basename(arg) in ("nebulite", "nebulite.cli") and cmdline[i + 1:i + 2] == ["agent"]:
            return True
    return False


def agents_started_here() -> list[psutil.Process]:
    """The live node agents that this test run started (carrying its mark)."""
    mark = os.environ[SUITE_MARK]
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if (proc.info["status"] != psutil.STATUS_ZOMBIE and _is_agent(proc.info["cmdline"] or [])
                    and proc.environ().get(SUITE_MARK) == mark):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _serves_in(proc: psutil.Process, rt: str) -> bool:
    """Whether agent `proc` listens in runtime directory `rt` (its --socket, or, started
    by hand without one, its NEBULITE_RUNTIME_DIR)."""
    try:
        cmdline = proc.cmdline()
        if "--socket" in cmdline:
            sock = cmdline[cmdline.index("--socket") + 1]
            return os.path.dirname(os.path.realpath(sock)) == rt
        return os.path.realpath(proc.environ().get("NEBULITE_RUNTIME_DIR", "")) == rt
    except (psutil.NoSuchProcess, psutil.AccessDenied, IndexError):
        return False


def kill_processes(procs: list[psutil.Process]) -> None:
    """SIGKILLs `procs` and waits until they are gone."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=HANG_TIMEOUT)


def kill_agents_of(rt: Path | str) -> None:
    """Kills the agents of this test run that serve in runtime directory `rt`, and waits
    until they are gone (also one that has not yet said it is serving)."""
    rt = os.path.realpath(rt)
    kill_processes([p for p in agents_started_here() if _serves_in(p, rt)])


def remove_runtime_dir(rt: Path | str) -> None:
    """Kills the agents of runtime directory `rt`, then removes it."""
    kill_agents_of(rt)
    shutil.rmtree(rt, ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run if an agent it started is still alive: each test kills what it started
    (an idle exit is no way to clean up: on a busy machine it comes late). The agents left
    behind are listed, then killed."""
    alive = agents_started_here()
    lines = []
    for proc in alive:
        try:
            lines.append(f"pid {proc.pid}: {' '.join(proc.cmdline())}")
        except psutil.NoSuchProcess:
            pass
    kill_processes(alive)
    if lines:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        text = "nebulite agents started by the tests were still running at the end (now killed):"
        if reporter is not None:
            reporter.write_sep("=", "agents left behind", red=True)
            reporter.write_line(text)
            for line in lines:
                reporter.write_line("  " + line)
        else:
            print(text, *lines, sep="\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def new_agents():
    """A function listing the agents of this test run started since the test began; those
    still alive at its end are killed (a program the test ran, killed when it hung, could
    not stop its own)."""
    before = {p.pid for p in agents_started_here()}

    def started() -> list[psutil.Process]:
        return [p for p in agents_started_here() if p.pid not in before]

    yield started
    kill_processes(started())

"""Shared fixtures: each test gets a clean nebulite session and environment."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import tempfile
from pathlib import Path

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


@pytest.fixture(autouse=True)
def _nebulite_env(monkeypatch):
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", str(256 * 1024 * 1024))
    monkeypatch.delenv("NEBULA_PERSISTENT_STORAGE_PATH", raising=False)
    monkeypatch.delenv("NEBULA_PERSISTENT_TIME_INTERVAL", raising=False)
    try:
        yield
    finally:
        nebulite.api._reset_for_tests()


@pytest.fixture(autouse=True, scope="session")
def _deepspeed_shm_buffers():
    """DeepSpeed's CPU collectives leave their shared-memory buffers in /dev/shm when a
    process exits; remove the ones this test session created."""
    shm = Path("/dev/shm")
    pattern = "deepspeed_allreduce_buffer_*"
    before = set(shm.glob(pattern)) if shm.is_dir() else set()
    yield
    if shm.is_dir():
        for p in set(shm.glob(pattern)) - before:
            try:
                p.unlink()
            except OSError:
                pass


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
    kill_agents_of(rt)
    shutil.rmtree(rt, ignore_errors=True)


def kill_agents_of(rt: Path) -> None:
    """Kills the agents whose logs are in runtime directory `rt`."""
    for log in rt.glob("agent-*.log"):
        for line in log.read_text().splitlines():
            if "nebulite agent" in line and "serving" in line:
                pid = int(line.split("nebulite agent ")[1].split()[0])
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    os.waitpid(pid, 0)  # an agent re-parented to this process
                except ChildProcessError:
                    pass

"""Shared fixtures: each test gets a clean nebulite session and environment."""

from __future__ import annotations

import pytest

import nebulite.api


@pytest.fixture(autouse=True)
def _nebulite_env(monkeypatch):
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", str(256 * 1024 * 1024))
    # The engine runs embedded in the test process unless a test asks for the node agent
    # (the default of init()): tests/test_agent.py and the tests marked `agent` cover it.
    monkeypatch.setenv("NEBULITE_AGENT", "0")
    monkeypatch.delenv("NEBULA_PERSISTENT_STORAGE_PATH", raising=False)
    monkeypatch.delenv("NEBULA_PERSISTENT_TIME_INTERVAL", raising=False)
    try:
        yield
    finally:
        nebulite.api._reset_for_tests()


@pytest.fixture
def store(tmp_path):
    """A fresh persistent storage path (not created yet)."""
    return str(tmp_path / "ckpt")

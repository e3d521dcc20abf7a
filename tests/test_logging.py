"""The ``nebulite`` logger: the agent's rotated log file beside its socket."""

from __future__ import annotations

import logging
import subprocess
import sys

from conftest import HANG_TIMEOUT

from nebulite.agent import server


def test_the_agent_log_beside_its_socket_is_rotated(tmp_path, monkeypatch):
    monkeypatch.setattr(server, "LOG_BYTES", 2000)
    top = logging.getLogger("nebulite")
    before, level = list(top.handlers), top.level
    try:
        server._log_beside(str(tmp_path / "agent-x.sock"))
        for i in range(100):
            logging.getLogger("nebulite.agent").info("line %d of the agent's log", i)
    finally:
        for h in top.handlers[len(before):]:
            h.close()
        top.handlers[:] = before
        top.setLevel(level)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["agent-x.log", "agent-x.log.1", "agent-x.log.2"]  # LOG_BACKUPS old ones
    assert "line 99 of the agent's log" in (tmp_path / "agent-x.log").read_text()
    assert all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())


class _SlowEngine:
    """An engine whose checkpoint `global_step7` takes `polls` looks to be written."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def versions(self) -> list[dict]:
        self.polls -= 1
        return [{"tag": "global_step7", "version": "v1", "persist_requested": True,
                 "persisted": self.polls <= 0, "failed": False}]


def test_a_long_wait_for_persistence_says_what_it_waits_for(monkeypatch, caplog):
    from nebulite import _waiting

    monkeypatch.setattr(_waiting, "QUIET_SECONDS", 0.0)
    with caplog.at_level(logging.WARNING, logger="nebulite"):
        _waiting.wait_written(_SlowEngine(3), 600.0, "/mnt/ckpt", "flush_persistence()")
    (record,) = [r for r in caplog.records if r.name == "nebulite"]
    assert "flush_persistence()" in record.getMessage()
    assert "global_step7" in record.getMessage() and "/mnt/ckpt" in record.getMessage()
    caplog.clear()
    monkeypatch.setattr(_waiting, "QUIET_SECONDS", 600.0)
    with caplog.at_level(logging.WARNING, logger="nebulite"):  # a short wait says nothing
        _waiting.wait_written(_SlowEngine(3), 600.0, "/mnt/ckpt", "flush_persistence()")
    assert caplog.records == []

def test_nothing_is_printed_unless_logging_is_configured(tmp_path):
    script = (
        "import torch, nebulite as nm\n"
        f"nm.init(persistent_storage_path={str(tmp_path / 'ckpt')!r}, persistent_time_interval=0)\n"
        "c = nm.Checkpoint('global_step1', num_files=1)\n"
        "c.save('model', {'w': torch.ones(4)})\n"
        "nm.flush_persistence()\n"
        "assert nm.get_latest_checkpoint().load('model')['w'].sum() == 4\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=HANG_TIMEOUT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (p.stdout, p.stderr) == ("", "")

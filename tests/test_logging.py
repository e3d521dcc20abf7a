"""The ``nebulite`` logger: the agent's rotated log file beside its socket."""

from __future__ import annotations

import logging

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

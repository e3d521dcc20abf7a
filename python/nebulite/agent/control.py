"""Talking to the agents of this user on this node without attaching as a trainer:
``status`` (what an agent holds) and ``stop`` (persist what is committed, then exit).
Used by ``nebulite agent status|stop`` and ``nebulite ls``, which only look: they never
create the runtime directory."""

from __future__ import annotations

import glob
import os
import time
from typing import Any, Callable

from .. import errors
from . import protocol
from .client import _connect, _process_state, _raise_if_error, runtime_dir, socket_path

#: Seconds an agent has to answer a control request.
TIMEOUT = 10.0


def running() -> list[str]:
    """The sockets of this user's agents on this node that accept connections."""
    out = []
    for path in sorted(glob.glob(os.path.join(runtime_dir(create=False), "agent-*.sock"))):
        s = _connect(path)
        if s is not None:
            s.close()
            out.append(path)
    return out


def request(path: str, op: str, **fields: Any) -> dict[str, Any]:
    """Sends one control request to the agent listening on `path` and returns its reply."""
    s = _connect(path)
    if s is None:
        raise errors.NotFoundError(f"no agent listens on {path}")
    try:
        s.settimeout(TIMEOUT)
        protocol.send(s, dict(fields, op=op))
        reply, _ = protocol.recv(s)
        protocol.send(s, {"op": "bye"})
    except (OSError, protocol.ProtocolError) as e:
        raise errors.AgentLostError(f"the agent on {path} did not answer {op!r}: {e}") from None
    finally:
        s.close()
    _raise_if_error(reply)
    return reply


def status_for_root(root: str) -> dict[str, Any] | None:
    """The status of the agent serving store `root` on this node, or None if none runs
    (or none can be reached: no runtime directory, an agent that does not answer)."""
    try:
        return request(socket_path(root, create=False), "status")
    except errors.NebuliteError:
        return None


def wait_gone(path: str, pid: int, report: Callable[[dict[str, Any]], None],
              timeout: float) -> bool:
    """Waits until the agent `pid` listening on `path` has exited, calling `report` with
    its status every poll while it still answers. False if it is still there after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _process_state(pid) in (None, "Z", "X"):
            return True
        try:
            report(request(path, "status"))
        except (errors.NebuliteError, OSError):
            pass  # no longer listening: closing its engines
        time.sleep(0.2)
    return _process_state(pid) in (None, "Z", "X")



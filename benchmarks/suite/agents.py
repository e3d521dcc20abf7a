"""Stopping the node agents a benchmark started.

The benchmarks give each run of theirs a runtime directory of its own
(`NEBULITE_RUNTIME_DIR`), so that its agents serve sockets there and nowhere else. An agent
outlives the process that started it (that is its job), so a benchmark stops its agents
itself, found by their socket rather than by what a worker reported: a worker that failed,
or an agent still starting, is covered too.
"""

from __future__ import annotations

import os
import shutil

import psutil

#: How long a stopped agent may take to be gone: only bounds a hang (it takes milliseconds).
GONE_TIMEOUT = 60.0


def agents_in(runtime: str) -> list[psutil.Process]:
    """The agents whose socket is in runtime directory `runtime`."""
    runtime = os.path.realpath(runtime)
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "nebulite.agent" in cmdline and "--socket" in cmdline[:-1]:
            sock = cmdline[cmdline.index("--socket") + 1]
            if os.path.dirname(os.path.realpath(sock)) == runtime:
                found.append(proc)
    return found


def stop_agents(runtime: str) -> None:
    """Stops the agents of runtime directory `runtime` (SIGTERM, then SIGKILL), waits until
    they are gone, and removes the directory. The workers flushed before they ended: the
    agents hold nothing left to persist."""
    procs = agents_in(runtime)
    for sig in ("terminate", "kill"):
        for proc in procs:
            try:
                getattr(proc, sig)()
            except psutil.NoSuchProcess:
                pass
        _, procs = psutil.wait_procs(procs, timeout=GONE_TIMEOUT)
        if not procs:
            break
    shutil.rmtree(runtime, ignore_errors=True)

"""Fork server of the kill campaign (tests/kill_campaign.py): imports torch and nebulite once
and forks each worker and verifier from there, so that a run starts in milliseconds instead
of seconds. Nothing here ever calls nebulite.init() or runs a torch operation, so every
child starts as a fresh process would (no session, no thread pools, no memory tier).

It is a child subreaper: node agents whose trainer died are re-parented to it, and it reaps
them. Requests on stdin, one JSON object a line, each answered by one line on stdout:
  {"op": "spawn", "role": "worker"|"verify", "argv": [...], "env": {...},
   "stdout": PATH, "stderr": PATH}              -> {"pid": PID}
  {"op": "wait", "pid": PID}                     -> {"returncode": RC}  (-N: killed by signal N)
  {"op": "exit"} or end of input: kills every process under it, reaps them and exits.
The child writes its stdout to PATH (a FIFO the controller reads) and its stderr to a file.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402,F401  (imported once, before forking)
import torch.distributed  # noqa: E402,F401

import nebulite  # noqa: E402,F401
import nebulite.agent.client  # noqa: E402,F401
import kill_verify  # noqa: E402
import kill_worker  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36
ROLES = {"worker": kill_worker.main, "verify": kill_verify.main}


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict) -> None:
    """In the forked child: becomes the requested program; never returns."""
    rc = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        out = os.open(request["stdout"], os.O_WRONLY)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in (null, out, err):
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["role"]] + list(request["argv"])
        rc = ROLES[request["role"]](list(request["argv"])) or 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on the child's stderr
        traceback.print_exc()
        rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _children() -> list[int]:
    """Every process whose parent is this one (its own children and adopted orphans)."""
    me, out = os.getpid(), []
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        pass
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            out.append(int(entry))
    return out


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    spawned: set[int] = set()  # reaped only when asked, so that their pids stay theirs

    def reap_orphans() -> None:
        """Reaps adopted node agents (and other orphans) that have exited."""
        for pid in _children():
            if pid not in spawned:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def answer(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": os.getpid()})
    try:
        for line in sys.stdin:
            request = json.loads(line)
            reap_orphans()
            if request["op"] == "spawn":
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request)
                spawned.add(pid)
                answer({"pid": pid})
            elif request["op"] == "wait":
                pid = int(request["pid"])
                _, status = os.waitpid(pid, 0)
                spawned.discard(pid)
                answer({"returncode": _returncode(status)})
            elif request["op"] == "exit":
                break
    finally:
        # Kill and reap everything under this process, orphans adopted meanwhile included.
        for _ in range(100):
            pids = _children()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in pids:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

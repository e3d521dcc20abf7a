"""``nebulite agent status`` and ``nebulite agent stop [--wait]``: the node agents of this
user on this node (one per storage path). ``stop`` has the agent persist the newest
checkpoint it holds only in memory, wait until everything queued is committed in the
store, then exit; ``--wait`` waits for that, showing what it is waiting for.
(``nebulite agent --root PATH`` runs an agent in the foreground.)"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..agent import control
from ..agent.client import socket_path
from ..errors import NotFoundError
from . import output, store
from .command import subcommand

#: Seconds of waiting after which ``stop --wait`` says what it waits for.
QUIET_SECONDS = 3.0


def add_parser(sub: Any) -> None:
    p = subcommand(sub, "agent", help="status of this node's agents, or stop them", doc=__doc__,
                   run=run, path=None, examples=["nebulite agent status", "nebulite agent stop --wait",
                                                 "nebulite agent stop --root /mnt/ckpt/run1"])
    what = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    st = subcommand(what, "status", help="pid, store, memory, versions held, pending", path=None,
                    examples=["nebulite agent status --json"])
    st.add_argument("--json", action="store_true", help="print JSON, for scripts")
    sp = subcommand(what, "stop", help="persist what is committed, then exit", path=None,
                    examples=["nebulite agent stop --wait --timeout 600"])
    sp.add_argument("--root", metavar="PATH", help="only the agent of this store")
    sp.add_argument("--wait", action="store_true", help="return once it has exited")
    sp.add_argument("--timeout", type=float, default=3600.0, help="seconds --wait waits")
    sp.add_argument("--force", action="store_true",
                    help="stop it even while trainers are attached")


def _statuses() -> list[dict[str, Any]]:
    out = []
    for path in control.running():
        try:
            out.append(control.request(path, "status"))
        except Exception as e:  # noqa: BLE001 - one agent's failure does not hide the others
            print(f"nebulite agent: {path}: {e}", file=sys.stderr)
    return out


def status(args: argparse.Namespace) -> int:
    agents = _statuses()
    if args.json:
        output.print_json(agents)
        return 0
    if not agents:
        print("no nebulite agent of this user runs on this node")
        return 0
    rows = []
    for a in agents:
        held = {(v["tag"], v["version"]) for v in a["versions"] if v["in_memory"]}
        rows.append([a["pid"], a["root"] or "(memory only)",
                     f"{output.size(a['used'])} / {output.size(a['capacity'])}",
                     a["trainers"], len(held), a["pending"],
                     "stopping" if a["stopping"] else "running"])
    output.table(["PID", "STORE", "MEMORY USED / BUDGET", "TRAINERS", "VERSIONS HELD",
                  "PENDING", "STATE"], rows)
    return 0


def _waiting(a: dict[str, Any]) -> str:
    pending = sorted({v["tag"] for v in a["versions"]
                      if v["persist_requested"] and not v["store_committed"] and not v["failed"]})
    what = f"{len(pending)} checkpoint(s) to persist ({', '.join(pending)})" if pending \
        else "its engines to close"
    return f"nebulite agent stop: agent {a['pid']} ({a['root'] or 'memory only'}) waits for {what}"


def stop(args: argparse.Namespace) -> int:
    if args.root:
        paths = [socket_path(store.root_of(args.root), create=False)]
    else:
        paths = control.running()
    if not paths:
        print("no nebulite agent of this user runs on this node")
        return 0
    stopped = []
    for path in paths:
        try:
            before = control.request(path, "status")
        except (NotFoundError, ConnectionError):
            if args.root:
                raise NotFoundError(f"no agent serves {args.root} on this node") from None
            continue
        control.request(path, "stop", force=args.force)
        stopped.append((path, before))
        print(f"stopping agent {before['pid']} ({before['root'] or 'memory only'})")
    if not args.wait:
        return 0
    start = time.monotonic()
    said: dict[int, str] = {}

    def report(a: dict[str, Any]) -> None:
        line = _waiting(a)
        if time.monotonic() - start >= QUIET_SECONDS and said.get(a["pid"]) != line:
            print(line, file=sys.stderr)
            said[a["pid"]] = line

    for path, before in stopped:
        remaining = max(0.0, args.timeout - (time.monotonic() - start))
        if not control.wait_gone(path, int(before["pid"]), report, remaining):
            print(f"nebulite agent stop: agent {before['pid']} has not exited after "
                  f"{args.timeout:g} s", file=sys.stderr)
            return 2
        print(f"agent {before['pid']} exited")
    return 0


def run(args: argparse.Namespace) -> int:
    return status(args) if args.action == "status" else stop(args)

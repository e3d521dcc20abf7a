"""The line protocol between the suite (parent) and its worker processes.

A worker writes requests to stdout as ``@@bench <json>`` lines; for the ones that need an
answer (memory marks) it then reads one line from stdin, so that the parent measures at
exactly that point of the worker's run. Other output of the worker passes through.
Without a parent (``NEBULITE_BENCH_LINK`` unset), requests are no-ops.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

PREFIX = "@@bench "
ENV = "NEBULITE_BENCH_LINK"


class Link:
    def __init__(self) -> None:
        self.attached = os.environ.get(ENV) == "1"
        # Keep a private handle on the real stdout: libraries may print to sys.stdout.
        self._out = os.fdopen(os.dup(1), "w", buffering=1)

    def send(self, op: str, **fields: Any) -> None:
        self._out.write(PREFIX + json.dumps(dict(fields, op=op), default=str) + "\n")
        self._out.flush()

    def ask(self, op: str, **fields: Any) -> str:
        """Sends a request and waits for the parent's answer ("" without a parent)."""
        if not self.attached:
            return ""
        self.send(op, **fields)
        return sys.stdin.readline().strip()

    # Memory marks: PSS of this process and its descendants, measured by the parent.
    def baseline(self, key: str) -> None:
        self.ask("baseline", key=key)

    def monitor(self, key: str, on: bool) -> None:
        self.ask("monitor", key=key, on=on)

    def progress(self, text: str) -> None:
        if self.attached:
            self.send("progress", text=text)
        else:
            print(text, file=sys.stderr, flush=True)

    def result(self, data: dict[str, Any]) -> None:
        self.send("result", data=data)

"""Saying what a long wait for persistence waits for: ``flush_persistence()``, and the
drain at exit, log a warning (shown even where logging is not set up) naming the
checkpoints still on their way to the store once the wait lasts more than a few seconds."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("nebulite")

#: Seconds of waiting before the first message, then between messages.
QUIET_SECONDS = 5.0
REPEAT_SECONDS = 30.0


def _unwritten(engine: Any, only: set[tuple[str, str]] | None) -> list[dict[str, Any]]:
    if only is not None:
        return [v for v in engine.versions() if (v["tag"], v["version"]) in only
                and v["persist_requested"] and not v["store_committed"] and not v["failed"]]
    return [v for v in engine.versions()
            if v["persist_requested"] and not v["persisted"] and not v["failed"]]


def wait_written(engine: Any, timeout: float, root: str | None, what: str,
                 only: set[tuple[str, str]] | None = None) -> None:
    """Returns once this rank's files of every version `engine` persists are written (or
    after `timeout` seconds), saying what it waits for when that takes long. The caller
    then flushes the engine, which waits for the commits and reports errors. With `only`,
    (tag, version) pairs, once those of them being persisted are committed in the store."""
    start = time.monotonic()
    say = start + QUIET_SECONDS
    while True:
        pending = _unwritten(engine, only)
        now = time.monotonic()
        if not pending or now - start >= timeout:
            return
        if now >= say:
            tags = ", ".join(sorted({v["tag"] for v in pending}))
            log.warning("nebulite: %s is waiting for %d checkpoint(s) to be written to %s: "
                        "%s (%.0f s so far)", what, len(pending), root, tags, now - start)
            say = now + REPEAT_SECONDS
        time.sleep(0.1)

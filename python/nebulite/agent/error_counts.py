"""How many errors each of an agent's engines has reported, in a page of shared memory.

Each engine of the agent (one per rank and world size) has a counter in one page that the
agent shares with its trainers; the engine adds 1 to it for every error it reports for
``take_errors`` (``_core.Engine.open(error_count=...)``). A trainer maps the page read-only
and asks the agent for its errors only when its engine's count has moved since it last
asked: a checkpoint's first save, which raises what failed in the background, then makes
no request in the usual case, where nothing failed (an agent that was idle between two
checkpoints takes about a third of a millisecond to answer one).

A counter only grows, and is its (rank, world size)'s for the process's life: an engine
closed and opened again goes on counting where the last one stopped. The page is the
process's (``counts()``) and stays mapped until it exits: an engine's threads may outlive
the engine, and the agent object.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading

SLOTS = mmap.PAGESIZE // 8


class Counts:
    """The agent's page: a counter per (rank, world size), handed out as engines open.
    Thread-safe."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("nebulite-error-counts", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, mmap.PAGESIZE)
        self._page = mmap.mmap(self.fd, mmap.PAGESIZE)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._page))
        self._slots: dict[tuple[int, int], int] = {}
        self._mu = threading.Lock()

    def slot(self, key: tuple[int, int]) -> int | None:
        """The counter of `key`, kept for good; None once every slot is taken (its trainers
        then ask every time)."""
        with self._mu:
            if key not in self._slots:
                if len(self._slots) >= SLOTS:
                    return None
                self._slots[key] = len(self._slots)
            return self._slots[key]

    def address(self, slot: int | None) -> int:
        """Where the engine of `slot` counts (0: nowhere)."""
        return 0 if slot is None else self._address + 8 * slot


_counts: Counts | None = None
_lock = threading.Lock()


def counts() -> Counts:
    """The agent process's page, made on first use and never unmapped."""
    global _counts
    with _lock:
        if _counts is None:
            _counts = Counts()
        return _counts


class Reader:
    """A trainer's read-only view of its engine's counter."""

    def __init__(self, fd: int, slot: int) -> None:
        if not 0 <= slot < SLOTS:
            raise ValueError(f"error count slot {slot} outside the page")
        if os.fstat(fd).st_size < mmap.PAGESIZE:  # reading past its end would be SIGBUS
            raise ValueError("the error counts' file is smaller than a page")
        self._page = mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        self._offset = 8 * slot

    def count(self) -> int:
        """The count now. A read that races with an increment may miss it: the next read
        sees it. (Counts only grow, so a read never gives back one taken earlier.)"""
        return int(struct.unpack_from("=Q", self._page, self._offset)[0])

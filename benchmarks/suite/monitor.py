"""Memory of a process and all its descendants (a trainer and the node agent it started).

The figure is the proportional set size (PSS) of anonymous and shared memory,
``Pss_Anon + Pss_Shmem`` from ``/proc/<pid>/smaps_rollup``, summed over the processes:
memory shared between them (the agent's arena, which the trainer maps) is counted once,
split between its users. File-backed pages (libraries, the page cache of mapped files) are
left out: they are shared with every other Python process of the machine and come and go
with them, which would blur a difference of a few percent.

Reading smaps_rollup walks the page tables (tens of ms for GBs of 4 KiB pages), so the
sampler runs only during a save that is not timed.
"""

from __future__ import annotations

import threading
import time

import psutil


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return 0
    total = 0
    for line in text.splitlines():
        if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
            total += int(line.split()[1]) * 1024
    return total


def tree_pids(pid: int) -> list[int]:
    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_pss(pid: int) -> tuple[int, dict[int, int]]:
    """Sum of PSS (anonymous + shared memory) of pid and its descendants, and each one's."""
    each = {p: _pss(p) for p in tree_pids(pid)}
    return sum(each.values()), each


class PeakSampler:
    """Samples tree_pss(pid) in a thread until stop(); keeps the highest sum."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = 0
        self.peak_by_pid: dict[int, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        total, each = tree_pss(self.pid)
        self.samples += 1
        if total > self.peak:
            self.peak, self.peak_by_pid = total, each

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self._sample()
            # Never spend more than about a third of a core on sampling.
            self._stop.wait(max(self.interval, 2 * (time.perf_counter() - t0)))

    def start(self) -> "PeakSampler":
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak

"""Progress of long operations on stderr: a bar redrawn in place on a terminal (bytes,
throughput, time left), a line every few seconds otherwise, nothing once it is done."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from .output import duration, size

#: Seconds between two lines when stderr is not a terminal.
LINE_EVERY = 10.0


def describe(label: str, done: int, total: int, elapsed: float) -> str:
    """"verify [#####.....] 50% 1.0 GB / 2.0 GB, 500.0 MB/s, 2.0 s left"."""
    frac = min(1.0, done / total) if total else 1.0
    bar = "#" * int(frac * 20) + "." * (20 - int(frac * 20))
    rate = done / elapsed if elapsed > 0 else 0.0
    left = (total - done) / rate if rate > 0 else None
    return (f"{label} [{bar}] {frac * 100:3.0f}% {size(done)} / {size(total)}, "
            f"{size(int(rate))}/s, {duration(left) if left is not None else '?'} left")


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.drawn = False

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last < (0.1 if self.tty else LINE_EVERY):
            return
        self.last = now
        text = describe(self.label, self.done, self.total, now - self.start)
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""The bytes of one put: a list of memoryviews seen as one byte string, without copying.

The views are valid only during the put; `ByteViews` is a context manager that releases
every view it made (casts, slices) on exit, so that nothing it made outlives the call and
the caller can release its own views right after. Not thread-safe to build; the views it
hands out may be read from any thread.
"""

from __future__ import annotations

import io
from typing import Sequence


class ByteViews:
    def __init__(self, data: Sequence[memoryview] | memoryview | bytes) -> None:
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = [data]  # type: ignore[list-item]
        self._made: list[memoryview] = []
        self.views: list[memoryview] = []
        for d in data:
            v = d if isinstance(d, memoryview) else memoryview(d)
            if v.ndim != 1 or v.format not in ("B", "b", "c") or v.itemsize != 1:
                v = self._keep(v.cast("B"))
            elif v.format != "B":
                v = self._keep(v.cast("B"))
            if v.nbytes:
                self.views.append(v)
        self.size = sum(v.nbytes for v in self.views)

    def _keep(self, v: memoryview) -> memoryview:
        self._made.append(v)
        return v

    def __enter__(self) -> "ByteViews":
        return self

    def __exit__(self, *exc) -> None:
        for v in reversed(self._made):
            v.release()
        self._made.clear()
        self.views = []

    def payload(self, part_bytes: int):
        """What obstore's put takes: one view as is (sliced zero-copy into parts), the
        concatenation when it fits a part (one copy of at most a part, one request), else
        the views as an iterable (multipart, buffered a part at a time)."""
        if not self.views:
            return b""
        if len(self.views) == 1:
            return self.views[0]
        if self.size <= part_bytes:
            return b"".join(self.views)
        return list(self.views)

    def slices(self, start: int, end: int) -> list[memoryview]:
        """Views of bytes [start, end), made without copying (released on exit)."""
        out: list[memoryview] = []
        pos = 0
        for v in self.views:
            n = v.nbytes
            lo, hi = max(start - pos, 0), min(end - pos, n)
            if lo < hi:
                out.append(v if (lo, hi) == (0, n) else self._keep(v[lo:hi]))
            pos += n
            if pos >= end:
                break
        return out

    def reader(self, start: int = 0, end: int | None = None) -> "ViewReader":
        return ViewReader(self.slices(start, self.size if end is None else end))


class ViewReader(io.RawIOBase):
    """A read-only, seekable file over a list of byte views. read() returns bytes copies
    of at most the size asked for (HTTP libraries send what they read)."""

    def __init__(self, views: list[memoryview]) -> None:
        super().__init__()
        self._views = views
        self._starts = []
        pos = 0
        for v in views:
            self._starts.append(pos)
            pos += v.nbytes
        self._size = pos
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf) -> int:
        with memoryview(buf) as whole, whole.cast("B") as out:
            return self._readinto(out)

    def _readinto(self, out: memoryview) -> int:
        n = 0
        while n < len(out) and self._pos < self._size:
            i = self._index(self._pos)
            v, lo = self._views[i], self._pos - self._starts[i]
            k = min(v.nbytes - lo, len(out) - n)
            with v[lo : lo + k] as piece:
                out[n : n + k] = piece
            n += k
            self._pos += k
        return n

    def read(self, size: int = -1) -> bytes:
        left = self._size - self._pos
        size = left if size is None or size < 0 else min(size, left)
        pieces = []
        while size > 0:
            i = self._index(self._pos)
            v, lo = self._views[i], self._pos - self._starts[i]
            k = min(v.nbytes - lo, size)
            pieces.append(v[lo : lo + k])
            self._pos += k
            size -= k
        try:
            return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)  # one copy
        finally:
            # Released now, not when collected: a frame kept by a caught exception's
            # traceback must not keep the caller's memory exported past the put.
            for p in pieces:
                p.release()

    def readall(self) -> bytes:
        return self.read(-1)

    def _index(self, pos: int) -> int:
        # Few views per put: a linear scan from the end is as fast as a bisect here.
        for i in range(len(self._starts) - 1, -1, -1):
            if self._starts[i] <= pos:
                return i
        return 0

    def close(self) -> None:
        self._views = []
        super().close()

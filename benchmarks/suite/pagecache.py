"""Making loads cold: evicting a directory's files from the page cache, and checking it.

The polite way first: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file (after fsync),
which evicts only the benchmark's own files; ``mincore`` then tells how much of them is
still cached. If some stayed (a filesystem that ignores the advice), the whole page cache
is dropped (``echo 3 > /proc/sys/vm/drop_caches``) where this process may do that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _files(root: str) -> list[str]:
    if os.path.isfile(root):
        return [root]
    out = []
    for d, _, names in os.walk(root):
        out.extend(os.path.join(d, n) for n in names)
    return out


def cached_bytes(root: str) -> tuple[int, int]:
    """(bytes of root's files in the page cache, total bytes), by mincore."""
    page = mmap.PAGESIZE
    cached = total = 0
    for path in _files(root):
        size = os.path.getsize(path)
        total += size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                continue
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) == 0:
                    cached += sum(b & 1 for b in vec) * page
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return min(cached, total), total


def _fadvise(root: str) -> None:
    for path in _files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _drop_all() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def make_cold(roots: list[str], method: str = "auto") -> dict[str, object]:
    """Evicts the files under `roots` from the page cache. `method`: "fadvise", "global"
    (drop the whole page cache) or "auto" (fadvise, then global if pages stayed).
    Returns what was done and the fraction of the files still cached after it."""
    used = []
    if method in ("auto", "fadvise"):
        for r in roots:
            _fadvise(r)
        used.append("posix_fadvise(DONTNEED)")
    cached = total = 0
    for r in roots:
        c, t = cached_bytes(r)
        cached, total = cached + c, total + t
    if method == "global" or (method == "auto" and total and cached > 0.01 * total):
        used.append("drop_caches=3" if _drop_all() else "drop_caches (not permitted)")
        cached = sum(cached_bytes(r)[0] for r in roots)
    return {"method": " + ".join(used), "still_cached_fraction": cached / total if total else 0.0}

"""The machine's own limits, which the candidates are compared with.

- memcpy into warm memory (already touched: no page faults), with 1 and 2 threads, each
  thread copying its share, the better of the C library's memcpy and a copy with
  non-temporal (streaming) stores: what staging a state into a pre-faulted buffer can
  reach at best (the C library streams only copies larger than a share of the last-level
  cache, so the two differ on some machines);
- sequential O_DIRECT write + fsync of the benchmark's disk (8 MiB writes, 1 and 4 in
  flight): what persisting can reach;
- sequential O_DIRECT read of the same disk (1 MiB and 8 MiB reads into warm, aligned
  buffers, 1 and 4 in flight): what loading from the store can reach.
Each is the best of a few tries (the machine may be shared: the best try is the one least
disturbed by others).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import time
from typing import Callable

import torch

MiB = 1 << 20


def memcpy_bandwidth(nbytes: int, threads: int, reps: int = 5, stores: str = "best") -> float:
    """Best-of-reps bytes/s of a copy into a preallocated, touched buffer, the work split
    evenly over `threads` threads (both copies release the GIL). stores: "libc" (the C
    library's memcpy), "streaming" (non-temporal stores: nebulite's StreamCopy, where the
    native module is built) or "best" (the better of the two)."""
    if stores == "best":
        kinds = ["libc"] + (["streaming"] if _stream_copy() else [])
        return max(memcpy_bandwidth(nbytes, threads, reps, k) for k in kinds)
    stream = _stream_copy() if stores == "streaming" else None
    if stores == "streaming" and stream is None:
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(1)  # touch: fault every page in before timing
    part = nbytes // threads // 4096 * 4096
    cuts = [(i * part, part if i < threads - 1 else nbytes - i * part) for i in range(threads)]

    def copy(off: int, n: int) -> None:
        if stream is not None:
            stream(dst.data_ptr() + off, src.data_ptr() + off, n)
        else:
            ctypes.memmove(dst.data_ptr() + off, src.data_ptr() + off, n)

    best = float("inf")
    for _ in range(reps + 1):  # the first pass is a warm-up
        workers = [threading.Thread(target=copy, args=c) for c in cuts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _stream_copy() -> Callable[[int, int, int], None] | None:
    try:
        from nebulite import _core
    except ImportError:
        return None
    return getattr(_core, "stream_copy", None)


def _run_chunks(nchunks: int, depth: int, work: Callable[[int, mmap.mmap], None], chunk: int) -> None:
    bufs = [mmap.mmap(-1, chunk) for _ in range(depth)]  # page-aligned: fit for O_DIRECT
    for b in bufs:
        b.write(os.urandom(MiB) * (chunk // MiB))
    nxt = 0
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(buf: mmap.mmap) -> None:
        nonlocal nxt
        try:
            while True:
                with lock:
                    i, nxt = nxt, nxt + 1
                if i >= nchunks:
                    return
                work(i, buf)
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(b,)) for b in bufs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in bufs:
        b.close()
    if errors:
        raise errors[0]


def odirect_write(path: str, nbytes: int, depth: int, chunk: int = 8 * MiB) -> float:
    """Bytes/s of a sequential O_DIRECT write of nbytes + fsync (the file is kept)."""
    nchunks = max(1, nbytes // chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        def write(i: int, buf: mmap.mmap) -> None:
            if os.pwrite(fd, buf, i * chunk) != chunk:
                raise OSError("short O_DIRECT write")

        t0 = time.perf_counter()
        _run_chunks(nchunks, depth, write, chunk)
        os.fsync(fd)
        return nchunks * chunk / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def odirect_read(path: str, depth: int, chunk: int = 8 * MiB) -> float:
    """Bytes/s of a sequential O_DIRECT read of the whole file into warm aligned buffers."""
    size = os.path.getsize(path) // chunk * chunk
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        def read(i: int, buf: mmap.mmap) -> None:
            if os.preadv(fd, [buf], i * chunk) != chunk:
                raise OSError("short O_DIRECT read")

        t0 = time.perf_counter()
        _run_chunks(size // chunk, depth, read, chunk)
        return size / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def measure(workdir: str, memcpy_bytes: int, disk_bytes: int, tries: int = 2) -> dict[str, float]:
    """All limits; bytes/s. O_DIRECT figures are NaN where the filesystem refuses O_DIRECT."""
    out: dict[str, float] = {}
    for threads, key in ((1, "memcpy_1thread"), (2, "memcpy_2threads")):
        for stores in ("libc", "streaming"):
            out[f"{key}_{stores}_Bps"] = memcpy_bandwidth(memcpy_bytes, threads, stores=stores)
        out[f"{key}_Bps"] = max(v for k, v in out.items() if k.startswith(key + "_") and not math.isnan(v))
    path = os.path.join(workdir, "odirect.bin")
    try:
        for depth in (1, 4):
            out[f"odirect_write_qd{depth}_Bps"] = max(odirect_write(path, disk_bytes, depth)
                                                      for _ in range(tries))
        for depth in (1, 4):
            # Reads of 1 MiB and of 8 MiB: which is faster depends on the device (and, on a
            # virtual disk, on the host); the limit is the better.
            out[f"odirect_read_qd{depth}_Bps"] = max(odirect_read(path, depth, chunk)
                                                     for chunk in (MiB, 8 * MiB) for _ in range(tries))
    except OSError as e:
        print(f"O_DIRECT failed on {workdir}: {e}", flush=True)
        for k in ("odirect_write_qd1_Bps", "odirect_write_qd4_Bps", "odirect_read_qd1_Bps",
                  "odirect_read_qd4_Bps"):
            out.setdefault(k, float("nan"))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    out["odirect_write_Bps"] = max(out["odirect_write_qd1_Bps"], out["odirect_write_qd4_Bps"])
    out["odirect_read_Bps"] = max(out["odirect_read_qd1_Bps"], out["odirect_read_qd4_Bps"])
    return out

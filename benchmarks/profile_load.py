"""Where the time of a cold load from the persistent store goes, step by step.

    python benchmarks/profile_load.py                      # syn-1g, under /tmp
    python benchmarks/profile_load.py --workload gpt2-124m --dir /mnt/nvme --retention 2

Saves one workload with nebulite (embedded engine; `--retention` checkpoints kept, as a
training job leaves them), then times, each from a cold page cache:
  1. the disk's limit: O_DIRECT read of the newest checkpoint's data files into warm buffers;
  2. what a restarted trainer sees: get_latest_checkpoint + load() in a fresh process;
  3. get_latest_checkpoint(persist_path=...) alone, in this process: finding the newest
     intact checkpoint, which reads its files and checks their CRC-32;
  4. Checkpoint.load() of every object right after 3, split into reading payloads
     (read_into) and everything else (unpickling, allocation);
  5. Checkpoint.load() with a cold page cache and no get_latest_checkpoint before it;
  6. the parts of a payload read: page faults of fresh memory (allocate + touch), and
     copying cached file bytes into warm memory (pread), into fresh memory, and into fresh
     memory advised to use huge pages.
Steps 3-6 run in this process, whose allocator is warm by then; a fresh process (2) may
differ: on a virtual machine that returns freed memory to its host, memory freed a moment
ago is slow to touch again, and huge pages were fast here but slow in fresh processes.
Run it before and after a change to the load path; keep its output with the change.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import nebulite as nm  # noqa: E402
from nebulite import api as nm_api  # noqa: E402
from suite import limits, pagecache, workloads  # noqa: E402
from suite.worker import arena_bytes  # noqa: E402

GB = 1e9
MiB = 1 << 20
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE = 14


def timed(what: str, fn: Callable[[], Any], nbytes: int, rows: list[tuple[str, float, int]]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    rows.append((what, dt, nbytes))
    print(f"  {what:62s}{dt:8.3f} s {nbytes / dt / GB:8.2f} GB/s", flush=True)
    return out


def data_files(root: str, version_dir: str) -> list[str]:
    out = []
    for d, _, names in os.walk(version_dir):
        out.extend(os.path.join(d, n) for n in names if not n.endswith(("manifest", "COMMITTED")))
    return sorted(out)


def pread_all(paths: list[str], alloc: Callable[[int], torch.Tensor]) -> None:
    for p in paths:
        size = os.path.getsize(p)
        t = alloc(size)
        mv = memoryview(t.numpy()).cast("B")
        with open(p, "rb", buffering=0) as f:
            done = 0
            while done < size:
                done += f.readinto(mv[done:done + 64 * MiB])


def fresh(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def fresh_huge(n: int) -> torch.Tensor:
    t = torch.empty(n, dtype=torch.uint8)
    start = (t.data_ptr() + (2 * MiB - 1)) // (2 * MiB) * (2 * MiB)
    end = (t.data_ptr() + n) // (2 * MiB) * (2 * MiB)
    if end > start:
        _libc.madvise(start, end - start, MADV_HUGEPAGE)
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="syn-1g")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--retention", type=int, default=2, help="checkpoints saved and kept (2: nebulite's default)")
    ap.add_argument("--drop-caches", choices=["auto", "fadvise", "global"], default="auto")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="nebulite-profile-", dir=args.dir)
    root = os.path.join(work, "store")
    rows: list[tuple[str, float, int]] = []
    try:
        state, _ = workloads.build(args.workload)
        names = list(state)
        nbytes = workloads.state_bytes(state)
        nm.init(root, agent=False, persistent_time_interval=0, num_of_version_in_retention=args.retention,
                memory_buffer_size=arena_bytes(nbytes, 1.02))
        for i in range(args.retention):
            ck = nm.Checkpoint(f"step{i}", num_files=len(names))
            for n in names:
                ck.save(n, state[n])
            nm.flush_persistence()
        nm.shutdown()
        del state
        gc.collect()
        newest = nm.list_checkpoints(persist_path=root)[0]
        files = data_files(root, newest["path"])
        file_bytes = sum(os.path.getsize(p) for p in files)
        print(f"{args.workload}: state {nbytes / GB:.3f} GB in {len(files)} data files "
              f"({file_bytes / GB:.3f} GB); {args.retention} checkpoint(s) in the store")

        def cold() -> None:
            c = pagecache.make_cold([root], args.drop_caches)
            if c["still_cached_fraction"] > 0.01:
                print(f"  (page cache not fully dropped: {c})")

        cold()
        for depth in (1, 4):
            timed(f"1. O_DIRECT read of the data files, {depth} in flight",
                  lambda: [limits.odirect_read(p, depth) for p in files], file_bytes, rows)
            cold()

        cold()
        code = ("import sys, time, nebulite as nm\n"
                "nm.get_latest_checkpoint  # the API is imported on first use: not timed\n"
                "t0 = time.perf_counter(); ck = nm.get_latest_checkpoint(persist_path=sys.argv[1])\n"
                "t1 = time.perf_counter(); x = {n: ck.load(n) for n in ck.list_names()}\n"
                "print(t1 - t0, time.perf_counter() - t1)\n")
        out = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, check=True)
        find_s, load_s = (float(x) for x in out.stdout.split())
        rows.append(("2. fresh process, cold: get_latest_checkpoint + load()", find_s + load_s, nbytes))
        print(f"  {'2. fresh process, cold: get_latest_checkpoint + load()':62s}{find_s + load_s:8.3f} s "
              f"{nbytes / (find_s + load_s) / GB:8.2f} GB/s (find {find_s:.3f} s, load {load_s:.3f} s)")
        cold()
        nm_api._verified.clear()
        ck = timed("3. get_latest_checkpoint (verifies CRCs), cold", lambda: nm.get_latest_checkpoint(persist_path=root),
                   nbytes, rows)
        # 3: load right after verification, with the payload reads timed apart.
        reads = [0.0]
        orig = nm_api._core.StoredArchive.read_into

        def read_into(self: Any, name: str, dst: int, threads: int) -> None:
            t0 = time.perf_counter()
            orig(self, name, dst, threads)
            reads[0] += time.perf_counter() - t0

        nm_api._core.StoredArchive.read_into = read_into
        try:
            loaded = timed("4. load() of every object after 3",
                           lambda: {n: ck.load(n) for n in names}, nbytes, rows)
            rows.append(("   of which payload reads (read_into)", reads[0], nbytes))
            print(f"     {'of which payload reads (read_into)':60s}{reads[0]:8.3f} s")
            del loaded
            gc.collect()
            cold()
            reads[0] = 0.0
            loaded = timed("5. load() of every object, cold, no verification before",
                           lambda: {n: ck.load(n) for n in names}, nbytes, rows)
            rows.append(("   of which payload reads (read_into)", reads[0], nbytes))
            print(f"     {'of which payload reads (read_into)':60s}{reads[0]:8.3f} s")
            del loaded
            gc.collect()
        finally:
            nm_api._core.StoredArchive.read_into = orig

        timed("6a. allocate and touch fresh memory (page faults)",
              lambda: [fresh(os.path.getsize(p)).fill_(1) for p in files], file_bytes, rows)
        timed("6b. ... with huge pages advised (MADV_HUGEPAGE)",
              lambda: [fresh_huge(os.path.getsize(p)).fill_(1) for p in files], file_bytes, rows)
        warm = torch.empty(max(os.path.getsize(p) for p in files), dtype=torch.uint8)
        warm.fill_(0)
        pread_all(files, fresh)  # make the files cached
        timed("6c. pread of cached files into warm memory", lambda: pread_all(files, lambda n: warm[:n]),
              file_bytes, rows)
        timed("6d. pread of cached files into fresh memory", lambda: pread_all(files, fresh), file_bytes, rows)
        timed("6e. pread of cached files into fresh memory, huge pages", lambda: pread_all(files, fresh_huge),
              file_bytes, rows)
        print(f"machine: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

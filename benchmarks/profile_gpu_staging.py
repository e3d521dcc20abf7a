"""Device-to-host staging of a CUDA state by checksum threads: what bounds a save.

    python benchmarks/profile_gpu_staging.py                    # 4 GB, 100 tensors, 4 8 12
    python benchmarks/profile_gpu_staging.py --gb 10 --threads 4 8

For each number of threads computing the records' CRC-32s as their bytes land (the
sealer's checksum pass, nebulite._device.stage), a blocking and an asynchronous save of
the same state into a memory tier with room for four of it, 3 saves after one left out
(median), beside a plain ``pinned.copy_(cuda, non_blocking=True)`` of the same bytes
measured first. The copies run at the link's speed; the checksum pass reads host memory
that the DMA is writing, and this shows how far more threads take it. Without CUDA it says
so and exits with status 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.0, help="state size in GB")
    ap.add_argument("--tensors", type=int, default=100, help="CUDA tensors in the state")
    ap.add_argument("--threads", type=int, nargs="+", default=[4, 8, 12], help="checksum threads")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_gpu_staging: no CUDA device: nothing to measure")
        return

    import nebulite as nm
    from bench_gpu import cuda_state, pinned_copy_bandwidth
    from nebulite import _core, _device

    state = cuda_state(int(args.gb * 1e9), args.tensors)
    nbytes = sum(v.nbytes for v in state.values())
    d2h, _ = pinned_copy_bandwidth(state)
    print(f"state: {nbytes / 1e9:.2f} GB in {len(state)} CUDA tensors, {torch.cuda.get_device_name()}, "
          f"{os.cpu_count()} cores; plain pinned copy_ D2H {d2h / 1e9:.1f} GB/s")
    stage = _device.stage
    base = tempfile.mkdtemp(prefix="nebulite-profile-gpu-")
    try:
        for threads in args.threads:
            def crc(address: int, n: int, _t: int = threads) -> int:
                return int(_core.crc32(address, n, _t))

            _device.stage = lambda *a, **k: stage(*a, crc=crc, **k)  # type: ignore[assignment]
            for async_staging in (False, True):
                d = os.path.join(base, f"t{threads}-{int(async_staging)}")
                nm.init(d, persistent_time_interval=3600,
                        memory_buffer_size=int(nbytes * 4.2), agent=False, async_staging=async_staging)
                try:
                    nm.api._session.engine.wait_prefaulted()  # type: ignore[union-attr]
                    blocking, staged = [], []
                    for i in range(4):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        nm.Checkpoint(f"s{i}").save("state", state)
                        t1 = time.perf_counter()
                        nm.wait_staged()
                        torch.cuda.synchronize()
                        t2 = time.perf_counter()
                        if i:
                            blocking.append(t1 - t0)
                            staged.append(t2 - t0)
                finally:
                    nm.shutdown()
                    shutil.rmtree(d, ignore_errors=True)
                b, s = statistics.median(blocking), statistics.median(staged)
                print(f"checksum threads {threads:2d}, {'async   ' if async_staging else 'blocking'}: "
                      f"host time {b * 1e3:7.1f} ms, until staged {s * 1e3:7.1f} ms = "
                      f"{nbytes / s / 1e9:5.1f} GB/s ({100 * nbytes / s / d2h:.0f}% of copy_)", flush=True)
    finally:
        _device.stage = stage  # type: ignore[assignment]
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

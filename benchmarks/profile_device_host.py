"""The host time of a save from a device, on the CPU: nebulite's own work per save.

    python benchmarks/profile_device_host.py                     # 100 tensors, both modes
    python benchmarks/profile_device_host.py --tensors 400 --profile

A save of CUDA state (nebulite._device) spends host time in two parts: nebulite's
bookkeeping (flattening the object, reserving its image in the memory tier, grouping and
chunking the copies, handing the sealing to its thread) and torch's cost of issuing each
copy and event. This program measures the first part on any machine: the state's tensors
are CPU tensors that the save takes for device storages (as tests/test_device.py does),
and the copies go to a stand-in device whose calls cost nothing (its host waits for a
copy sleep, without the interpreter's lock, as a CUDA event's do). For each mode, the
median host time of a save (until ``save()`` returns) over ``--reps`` saves after
``--warmup``, with an optimizer step (the barrier) between them and no other call, as in
training; with ``--profile``, the functions that take the most of it. bench_gpu.py
measures the whole on a CUDA machine.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import nebulite as nm
from nebulite import _device, _staging
from nebulite._serialization import RecordCollector


class StandInDevice:
    """A CopyBackend whose copies cost nothing; a host wait sleeps briefly."""

    def copy_stream(self, device: torch.device) -> Any:
        return object()

    def wait_current(self, stream: Any, device: torch.device) -> None:
        pass

    def copy(self, stream: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        pass

    def record(self, stream: Any) -> Any:
        return object()

    def order_current_after(self, event: Any, device: torch.device) -> None:
        pass

    def synchronize(self, event: Any) -> None:
        time.sleep(0.0002)


def _as_device_storages() -> None:
    """Saves take every storage for a device's (the CPU tensors play them)."""
    _device._backend = StandInDevice()
    write = RecordCollector.write_record

    def write_record(self: RecordCollector, name: str, data: Any, nbytes: int) -> None:
        write(self, name, data, nbytes)
        if not isinstance(self.sources[-1], bytes):
            n, _, size, deferred = self.records[-1]
            self.records[-1] = (n, 0, size, deferred)
            self.on_device.add(len(self.records) - 1)

    RecordCollector.write_record = write_record  # type: ignore[method-assign]
    # An object on a device is never scanned: it is flattened on the caller's thread.
    _staging.scan = lambda obj: None  # type: ignore[assignment]


def run(mode: str, n: int, numel: int, reps: int, warmup: int,
        profile: cProfile.Profile | None) -> list[float]:
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n)]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    root = tempfile.mkdtemp(prefix="nebulite-devhost-")
    nm.init(os.path.join(root, "store"), agent=False, async_staging=mode == "async",
            persistent_time_interval=0, num_of_version_in_retention=1,
            memory_buffer_size=max(64 << 20, 4 * n * numel * 4))
    times = []
    try:
        opt.step()  # with async staging, the parameters are known to be safe from now on
        state = {f"layer{i}.weight": p for i, p in enumerate(params)}
        for i in range(warmup + reps):
            ck = nm.Checkpoint(f"t{i}", num_files=1)
            timed = i >= warmup
            if timed and profile is not None:
                profile.enable()
            t0 = time.perf_counter()
            ck.save("model", state)
            t1 = time.perf_counter()
            if timed and profile is not None:
                profile.disable()
            if timed:
                times.append(t1 - t0)
            opt.step()  # the barrier (a read or a flush would also end the sealer's thread)
    finally:
        nm.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=100, help="tensors in the saved object")
    ap.add_argument("--numel", type=int, default=1 << 14, help="float32 values per tensor")
    ap.add_argument("--reps", type=int, default=30, help="timed saves per mode")
    ap.add_argument("--warmup", type=int, default=5, help="saves before the timed ones")
    ap.add_argument("--modes", nargs="+", choices=["blocking", "async"],
                    default=["blocking", "async"])
    ap.add_argument("--profile", action="store_true", help="print where the time goes")
    args = ap.parse_args()
    _as_device_storages()
    print(f"host time of a save of {args.tensors} tensors from a stand-in device "
          f"(median of {args.reps}, {os.cpu_count()} CPUs)")
    for mode in args.modes:
        profile = cProfile.Profile() if args.profile else None
        times = run(mode, args.tensors, args.numel, args.reps, args.warmup, profile)
        median = statistics.median(times)
        per_tensor = median / args.tensors * 1e6
        print(f"  {mode:9s} {median * 1e3:8.3f} ms   {per_tensor:6.2f} us per tensor")
        if profile is not None:
            pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()

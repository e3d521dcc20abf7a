"""The host time of a save from a device, on the CPU: nebulite's own work per save.

    python benchmarks/profile_device_host.py                     # 100 tensors, every mode
    python benchmarks/profile_device_host.py --tensors 400 --profile

A save of CUDA state (nebulite._device) spends host time in two parts: nebulite's
bookkeeping (flattening the object, reserving its image in the memory tier, grouping and
chunking the copies, handing the sealing to its thread) and torch's cost of issuing each
copy and event. This program measures the first part on any machine: the state's tensors
are CPU tensors that the save takes for device storages (as tests/test_device.py does),
and the copies go to a stand-in device whose calls cost nothing (its host waits for a
copy sleep, without the interpreter's lock, as a CUDA event's do). The modes:

  blocking       save() returns once the copies landed and the object is sealed
  async          async_staging, an object that holds a buffer on the device (which
                 forward may change): flattened and its copies issued on the caller's thread
  async-scanned  async_staging, an object whose device storages are all the optimizer's:
                 save() scans it and marks the device; the staging thread does the rest

For each mode, the median host time of a save (until ``save()`` returns) over ``--reps``
saves after ``--warmup``, with an optimizer step (the barrier) between them and no other
call, as in training, and the median time of that step's barrier (the step pre-hook: how
long the host waits there for the staging thread); with ``--profile``, the functions that
take the most of the saves. bench_gpu.py measures the whole on a CUDA machine.
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

    def mark(self, device: torch.device) -> Any:
        return object()

    def wait_event(self, stream: Any, event: Any) -> None:
        pass


_write_record = RecordCollector.write_record
_scan = _staging.scan


def _as_device_storages(scanned: bool) -> None:
    """Saves take the storages for a device's (the CPU tensors play them): all of them, or
    with `scanned` those an asynchronous save's scan took for safe (as it takes a CUDA
    device's); without it, an asynchronous save flattens the object on the caller's thread,
    as it does an object holding a buffer on a device."""
    _device._backend = StandInDevice()

    def write_record(self: RecordCollector, name: str, data: Any, nbytes: int) -> None:
        _write_record(self, name, data, nbytes)
        if isinstance(self.sources[-1], bytes):
            return
        n, _, size, deferred = self.records[-1]
        if self.watch.scanned is not None and not deferred:
            return  # copied into host memory at save()
        self.records[-1] = (n, 0, size, deferred)
        self.on_device.add(len(self.records) - 1)

    def scan_on_device(obj: Any) -> _staging.Scanned | None:
        found = _scan(obj)
        if found is not None:
            found.devices = [torch.device("cpu")]  # the device the CPU tensors play
        return found

    RecordCollector.write_record = write_record  # type: ignore[method-assign]
    _staging.scan = scan_on_device if scanned else (lambda obj: None)  # type: ignore


def run(mode: str, n: int, numel: int, reps: int, warmup: int, profile: cProfile.Profile | None,
        work: int = 0) -> tuple[list[float], list[float], list[float]]:
    """(save() times, barrier times, whole step times) of the timed steps."""
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n)]
    square = torch.randn(384, 384)
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    root = tempfile.mkdtemp(prefix="nebulite-devhost-")
    _as_device_storages(scanned=mode == "async-scanned")
    nm.init(os.path.join(root, "store"), agent=False, async_staging=mode != "blocking",
            # With `work`, a training run: its checkpoints persist now and then, not each
            # step (writing one competes for this machine's two cores with the step itself).
            persistent_time_interval=3600 if work else 0, num_of_version_in_retention=1,
            memory_buffer_size=max(64 << 20, 4 * n * numel * 4))
    times, barriers, steps = [], [], []
    try:
        opt.step()  # with async staging, the parameters are known to be safe from now on
        state = {f"layer{i}.weight": p for i, p in enumerate(params)}
        for i in range(warmup + reps):
            ck = nm.Checkpoint(f"t{i}", num_files=1)
            timed = i >= warmup
            if timed and profile is not None:
                profile.enable()
            t0 = time.perf_counter()
            if mode != "none":
                ck.save("model", state)
            t1 = time.perf_counter()
            if timed and profile is not None:
                profile.disable()
            if timed:
                times.append(t1 - t0)
            for _ in range(work):  # forward and backward (torch lets the interpreter go)
                square @ square
            t2 = time.perf_counter()
            _staging._pre_step(opt, (), {})  # the barrier, timed apart from the step
            t3 = time.perf_counter()
            opt.step()  # (a read or a flush would also end the sealer's thread)
            if timed:
                barriers.append(t3 - t2)
                steps.append(time.perf_counter() - t0)
    finally:
        nm.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    return times, barriers, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=100, help="tensors in the saved object")
    ap.add_argument("--numel", type=int, default=1 << 14, help="float32 values per tensor")
    ap.add_argument("--reps", type=int, default=30, help="timed saves per mode")
    ap.add_argument("--warmup", type=int, default=5, help="saves before the timed ones")
    ap.add_argument("--modes", nargs="+", choices=["blocking", "async", "async-scanned"],
                    default=["blocking", "async", "async-scanned"])
    ap.add_argument("--profile", action="store_true", help="print where the time goes")
    ap.add_argument("--work", type=int, default=0,
                    help="384x384 matrix products between a save and the next step, standing "
                         "in for forward and backward; with it, the whole step is timed too, "
                         "and a run without checkpoints is the baseline")
    args = ap.parse_args()
    print(f"host time of a save of {args.tensors} tensors from a stand-in device "
          f"(median of {args.reps}, {os.cpu_count()} CPUs)")
    modes = (["none"] if args.work else []) + args.modes
    if args.work:
        torch.set_num_threads(1)  # the products take one core: a GPU's host has cores to spare
    for mode in modes:
        profile = cProfile.Profile() if args.profile and mode != "none" else None
        times, barriers, steps = run(mode, args.tensors, args.numel, args.reps, args.warmup,
                                     profile, args.work)
        median = statistics.median(times)
        per_tensor = median / args.tensors * 1e6
        step = f"   whole step {statistics.median(steps) * 1e3:7.3f} ms" if args.work else ""
        print(f"  {mode:14s} save() {median * 1e3:7.3f} ms   {per_tensor:6.2f} us per tensor"
              f"   the next step's barrier {statistics.median(barriers) * 1e3:7.3f} ms{step}")
        if profile is not None:
            pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()

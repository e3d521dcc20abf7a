"""Where the blocking time of an asynchronous save goes: the scan of each object.

    python benchmarks/profile_scan.py                      # syn-256m
    python benchmarks/profile_scan.py --workload gpt2-124m --reps 9
    python benchmarks/profile_scan.py --agent              # the engine in the node agent
    python benchmarks/profile_scan.py --agent --gap 0.05   # ... idle 50 ms between checkpoints

With ``async_staging=True`` a save does one thing per tensor on the caller's thread: the
scan (``nebulite._staging.scan``, in the extension), which copies the object's containers
and records each tensor's storage and ``_version``. For each object of the workload's
state this prints the scan's time in three settings, each the median of ``--reps``:

* warm: the scan repeated at once (its objects and the memory it allocates are in cache);
* cold: after 64 MiB were written (the caches hold none of it);
* in a save loop: the scan of each object inside ``Checkpoint.save``, one checkpoint of
  the whole state after another with an optimizer step (the barrier: staging) and
  ``flush_persistence()`` between them, as bench_async_staging.py runs them, with the
  thread's CPU time beside the wall time (equal: the scan computes, it does not wait);

then the whole save's blocking time in that loop. ``--gap`` sleeps that long before each
checkpoint, as a trainer computes between two: an agent left idle answers a request more
slowly than one that just flushed. Run it before and after a change to the scan; keep its
output with the change.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import nebulite as nm  # noqa: E402
from nebulite import _staging  # noqa: E402
from suite import workloads  # noqa: E402
from suite.agents import stop_agents  # noqa: E402


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:8.3f}" if xs else f"{'-':>8s}"


def isolated(state: dict[str, Any], reps: int) -> dict[str, tuple[list[float], list[float], str]]:
    """Per object: (warm times, cold times, what the scan found)."""
    junk = torch.empty(64 << 20, dtype=torch.uint8)
    out = {}
    for name, obj in state.items():
        found = _staging.scan(obj)
        if found is None:
            out[name] = ([], [], "not scanned: staged on the caller's thread")
            continue
        what = (f"{sum(len(v) for v in found.views.values())} tensors, {len(found.storages)} "
                f"storages ({len(found.deferred)} deferred), {len(found.snapshot) / 1024:.0f} KiB copied")
        del found
        warm, cold = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            _staging.scan(obj)
            warm.append(time.perf_counter() - t0)
        for _ in range(reps):
            junk.fill_(1)
            t0 = time.perf_counter()
            _staging.scan(obj)
            cold.append(time.perf_counter() - t0)
        out[name] = (warm, cold, what)
    return out


def in_loop(state: dict[str, Any], opt: torch.optim.Optimizer, root: str, reps: int,
            gap: float = 0.0) -> tuple[dict[int, list[tuple[float, float]]], list[float]]:
    """(per object's position in the checkpoint: [(wall, cpu)] of its scan, blocking times)."""
    scans: list[tuple[float, float]] = []
    scan = _staging.scan

    def timed(obj: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return scan(obj)
        finally:
            scans.append((time.perf_counter() - t0, time.thread_time() - c0))

    _staging.scan = timed  # type: ignore[assignment]
    per: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(state))}
    blocking: list[float] = []
    try:
        for i in range(reps + 1):  # the first warms the memory tier: left out
            scans.clear()
            time.sleep(gap)
            t0 = time.perf_counter()
            ck = nm.Checkpoint(f"scan{i}", num_files=len(state))
            for name, obj in state.items():
                ck.save(name, obj)
            t1 = time.perf_counter()
            opt.step()
            nm.flush_persistence()
            if i:
                blocking.append(t1 - t0)
                for k, s in enumerate(scans):
                    per[k].append(s)
    finally:
        _staging.scan = scan  # type: ignore[assignment]
    return per, blocking


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="syn-256m")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--agent", action="store_true", help="the engine in a node agent (embedded "
                    "by default)")
    ap.add_argument("--gap", type=float, default=0.0, help="seconds to sleep before each "
                    "checkpoint of the loop (default 0)")
    args = ap.parse_args()
    state, opt = workloads.build(args.workload)
    nbytes = workloads.state_bytes(state)
    print(f"{args.workload}: {nbytes / 2**20:.0f} MiB, {len(workloads.tensors(state))} tensors, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; medians of {args.reps}, ms"
          + (f"; {args.gap * 1e3:.0f} ms idle before each checkpoint" if args.gap else ""))
    d = tempfile.mkdtemp(prefix="nebulite-profile-scan-")
    runtime = tempfile.mkdtemp(prefix="nbrt-")  # short: Unix socket paths are limited
    os.environ["NEBULITE_RUNTIME_DIR"] = runtime
    try:
        nm.init(os.path.join(d, "ckpt"), persistent_time_interval=0, num_of_version_in_retention=1,
                memory_buffer_size=max(64 << 20, 3 * nbytes), agent=args.agent,
                agent_idle_exit=5, async_staging=True)
        try:
            opt.step()  # no gradients: nothing changes; nebulite learns the optimizer's storages
            nm.api._session.engine.wait_prefaulted()  # type: ignore[union-attr]
            alone = isolated(state, args.reps)
            per, blocking = in_loop(state, opt, d, args.reps, args.gap)
        finally:
            nm.shutdown()
    finally:
        stop_agents(runtime)  # else it would outlive this program until its idle exit
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
    print(f"  {'object':12s} {'warm':>8s} {'cold':>8s} {'in loop':>8s} {'its CPU':>8s}  found")
    for k, (name, (warm, cold, what)) in enumerate(alone.items()):
        loop = per.get(k, [])
        print(f"  {name:12s} {_ms(warm)} {_ms(cold)} {_ms([w for w, _ in loop])} "
              f"{_ms([c for _, c in loop])}  {what}")
    print(f"  {'save() blocking, all objects and the commit, in the loop':58s} {_ms(blocking)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

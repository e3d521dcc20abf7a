"""Where the blocking time of a save goes, step by step (synchronous staging).

    python benchmarks/profile_save.py                      # syn-1g
    python benchmarks/profile_save.py --workload gpt2-124m --reps 5

For one workload, each figure the median of `--reps` after a warm-up:
  1. memcpy of the state's bytes into warm memory with 2 threads, as one block: the limit;
  2. the copy engine alone (nebulite's C++ copy pool, GIL released) copying every tensor
     of the state, at its own address and size, into warm memory: the limit for this
     state's tensor layout (many small tensors cost more than one block);
  3. flattening: torch's serializer run against nebulite's record collector (pickling the
     skeleton, collecting each storage's address), per object, in Python;
  4. Checkpoint.save of every object with the embedded engine (without a persistent path,
     unless --store: then the first objects are written while the later ones are staged);
  5. the same through the node agent (reserve, copy into the shared arena, seal).
Run it before and after a change to the save path; keep its output with the change.
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
from nebulite import _core  # noqa: E402
from nebulite import _serialization as ser  # noqa: E402
from suite import limits, workloads  # noqa: E402
from suite.agents import stop_agents  # noqa: E402
from suite.worker import arena_bytes  # noqa: E402

GB = 1e9


def median_time(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def show(what: str, seconds: float, nbytes: int) -> None:
    print(f"  {what:58s}{seconds:8.3f} s {nbytes / seconds / GB:8.2f} GB/s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="syn-1g")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-agent", action="store_true", help="skip step 5")
    ap.add_argument("--store", default=None,
                    help="a persistent path (a fresh subdirectory is used and removed): objects "
                         "then start persisting while the later ones of the same save are staged")
    args = ap.parse_args()
    state, _ = workloads.build(args.workload)
    names = list(state)
    nbytes = workloads.state_bytes(state)
    print(f"{args.workload}: state {nbytes / GB:.3f} GB, {workloads.describe(state)['tensors']} tensors, "
          f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    show("1. memcpy into warm memory, 2 threads, one block", nbytes / limits.memcpy_bandwidth(nbytes, 2), nbytes)

    collected = {n: ser.flatten(state[n], tag="p", name=n, rank=0, version="v") for n in names}
    spans_src = [(ptr, size) for c in collected.values() for _, ptr, size, _ in c.records if size]
    total = sum(size for _, size in spans_src)
    dst = torch.empty(total, dtype=torch.uint8)
    dst.fill_(0)
    spans = []
    off = 0
    for ptr, size in spans_src:
        spans.append((dst.data_ptr() + off, ptr, size))
        off += size
    show(f"2. copy engine, {len(spans)} records into warm memory",
         median_time(lambda: _core.copy_many(spans), args.reps), total)
    del dst

    t = median_time(lambda: [ser.flatten(state[n], tag="p", name=n, rank=0, version="v") for n in names],
                    args.reps)
    show("3. flatten (torch serializer -> records), all objects", t, nbytes)

    runtime = tempfile.mkdtemp(prefix="nbrt-")  # short: Unix socket paths are limited
    os.environ["NEBULITE_RUNTIME_DIR"] = runtime
    try:
        for mode in ["embedded"] + ([] if args.no_agent else ["agent"]):
            root = tempfile.mkdtemp(prefix="profile-save-", dir=args.store) if args.store else None
            nm.init(root, agent=mode == "agent", memory_buffer_size=2 * arena_bytes(nbytes, 1.02),
                    agent_idle_exit=5, persistent_time_interval=0)
            engine = nm.api._session.engine
            engine.wait_prefaulted()
            stage_s: list[float] = []
            calls: dict[str, list[float]] = {}
            orig = engine.stage

            def stage(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return orig(*a, **k)
                finally:
                    stage_s.append(time.perf_counter() - t0)

            try:
                engine.stage = stage  # type: ignore[method-assign]
            except AttributeError:  # the embedded engine is a C++ object: no breakdown
                pass
            if hasattr(engine, "_call"):  # the agent's client: time each request to the agent
                orig_call = engine._call

                def call(op: str, **fields: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return orig_call(op, **fields)
                    finally:
                        calls.setdefault(op, []).append(time.perf_counter() - t0)

                engine._call = call  # type: ignore[method-assign]
            counter = [0]

            def save() -> None:
                counter[0] += 1
                ck = nm.Checkpoint(f"p{counter[0]}", num_files=len(names))
                for n in names:
                    ck.save(n, state[n])

            def save_then_flush() -> float:
                t0 = time.perf_counter()
                save()
                t = time.perf_counter() - t0
                nm.flush_persistence()  # not timed: the next save starts with nothing pending
                return t

            if root:
                t = statistics.median([save_then_flush() for _ in range(args.reps + 1)][1:])
            else:
                t = median_time(save, args.reps)
            show(f"4. Checkpoint.save, all objects ({mode})" if mode == "embedded" else
                 "5. Checkpoint.save, all objects (agent)", t, nbytes)
            saves = args.reps + 1
            if stage_s:
                per_save = statistics.median(sum(stage_s[i * len(names):(i + 1) * len(names)])
                                             for i in range(saves))
                print(f"     {'of which stage (reserve, copy, seal)':56s}{per_save:8.3f} s")
            for op, ts in sorted(calls.items()):
                print(f"       {'request ' + repr(op) + f' ({len(ts) // saves} per save)':54s}"
                      f"{statistics.median(ts) * 1e3:8.2f} ms each (median)")
            nm.shutdown()
            if root:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        stop_agents(runtime)  # the agent would outlive this program until its idle exit
    return 0


if __name__ == "__main__":
    sys.exit(main())

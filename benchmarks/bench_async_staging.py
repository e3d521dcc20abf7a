"""Asynchronous staging on the CPU: how long save() blocks, side by side with DCP, one run.

    python benchmarks/bench_async_staging.py                      # gpt2-124m and syn-256m, 5 reps
    python benchmarks/bench_async_staging.py --workloads syn-1g --reps 9 --dir /mnt/nvme
    python benchmarks/bench_async_staging.py --smoke               # tiny states, seconds

For each workload (benchmarks/suite/workloads.py: the same state for both), in one process:
- DCP: ``torch.distributed.checkpoint.async_save`` with its cached asynchronous stager
  (``DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
  use_async_staging=True))``, kept across saves: DCP's fastest configuration);
- nebulite: ``init(async_staging=True)``, embedded engine, every object of the state saved
  into one checkpoint.
Printed per candidate: the median *blocking* time (until the save call returns) and the
median time *until staged* (DCP: its staging future; nebulite: until an optimizer step made
right after the save returns: its barrier waits for the staging; the step itself has no
gradients to apply), and nebulite's blocking time as a fraction of DCP's
(target: at most 1/10). The first save of each candidate warms its memory and is left
out of the medians. Then, for nebulite, what asynchronous staging adds to every optimizer
step, checkpointing or not: the median time of a step without gradients (nothing to
apply: the optimizer's own loop and its pre-hooks) with nebulite's barrier installed and
nothing pending, beside the same step after shutdown() removed it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from suite import dcp_async, workloads  # noqa: E402

SMOKE = ["syn-tiny", "gpt2-tiny"]
STEPS = 50  # optimizer steps per rep of the barrier's cost
DEFAULT = ["gpt2-124m", "syn-256m"]


def bench_nebulite(state: dict[str, Any], opt: torch.optim.Optimizer, d: str,
                   reps: int) -> list[dict[str, float]]:
    import nebulite as nm

    nbytes = workloads.state_bytes(state)
    nm.init(os.path.join(d, "nebulite"), persistent_time_interval=0, num_of_version_in_retention=1,
            memory_buffer_size=max(64 << 20, 3 * nbytes), agent=False, async_staging=True)
    try:
        opt.step()  # no gradients: nothing changes; nebulite learns the optimizer's storages
        engine = nm.api._session.engine  # type: ignore[union-attr]
        engine.wait_prefaulted()
        out = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            ck = nm.Checkpoint(f"bench{i}", num_files=len(state))
            for name, obj in state.items():
                ck.save(name, obj)
            t1 = time.perf_counter()
            opt.step()  # a step right after the save: its barrier waits until staged
            t2 = time.perf_counter()
            nm.flush_persistence()
            if i:
                out.append({"blocking_s": t1 - t0, "staged_s": t2 - t0})
        hooked = _step_times(opt, STEPS, len(out))
    finally:
        nm.shutdown()
    plain = _step_times(opt, STEPS, len(out))
    for run, with_hook, without in zip(out, hooked, plain):
        run["step_hooked_s"], run["step_plain_s"] = with_hook, without
    return out


def _step_times(opt: torch.optim.Optimizer, n: int, reps: int) -> list[float]:
    """Medians of n optimizer steps without gradients (the step changes nothing; what is left
    is the optimizer's own loop and the pre-hooks), one per rep."""
    out = []
    for _ in range(reps):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(DEFAULT))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where both write (default: a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="tiny states, 2 reps")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    names = SMOKE if args.smoke else args.workloads.split(",")
    reps = 2 if args.smoke else args.reps
    base = tempfile.mkdtemp(prefix="nebulite-bench-async-", dir=args.dir)
    results: dict[str, Any] = {}
    try:
        for name in names:
            state, opt = workloads.build(name)
            d = os.path.join(base, name)
            os.makedirs(d)
            results[name] = {
                "bytes": workloads.state_bytes(state),
                "tensors": len(workloads.tensors(state)),
                "dcp": dcp_async.async_save_times(state, d, reps),
                "nebulite": bench_nebulite(state, opt, d, reps),
            }
            del state, opt
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{'workload':<12} {'MiB':>7} {'tensors':>7} | {'blocking DCP':>12} {'nebulite':>9} "
          f"{'ratio':>6} (target <= 0.10) | {'staged DCP':>10} {'nebulite':>9}")
    for name, r in results.items():
        dcp_b, neb_b = _median(r["dcp"], "blocking_s"), _median(r["nebulite"], "blocking_s")
        dcp_s, neb_s = _median(r["dcp"], "staged_s"), _median(r["nebulite"], "staged_s")
        r["blocking_ratio"] = neb_b / dcp_b if dcp_b > 0 else float("inf")
        print(f"{name:<12} {r['bytes'] / 2**20:7.1f} {r['tensors']:7d} | {dcp_b:11.4f}s "
              f"{neb_b:8.4f}s {r['blocking_ratio']:6.3f}                 | {dcp_s:9.4f}s {neb_s:8.4f}s")
    print("\noptimizer step without gradients (what async_staging adds to every step: its "
          "barrier with nothing pending)")
    print(f"{'workload':<12} {'no hook':>9} {'async_staging':>14} {'added':>9}")
    for name, r in results.items():
        plain, hooked = _median(r["nebulite"], "step_plain_s"), _median(r["nebulite"], "step_hooked_s")
        print(f"{name:<12} {plain * 1e3:7.3f}ms {hooked * 1e3:12.3f}ms {(hooked - plain) * 1e3:7.3f}ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

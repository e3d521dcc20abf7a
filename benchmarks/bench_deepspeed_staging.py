"""DeepSpeed's save_checkpoint(): how long training waits, side by side, one run.

    python benchmarks/bench_deepspeed_staging.py                    # ~34M parameters, ZeRO 0-2
    python benchmarks/bench_deepspeed_staging.py --width 4096 --reps 7
    python benchmarks/bench_deepspeed_staging.py --smoke            # a tiny model, seconds

One process (world size 1, DeepSpeed on the CPU, gloo), an MLP of `--layers` square layers of
`--width` with AdamW, for each ZeRO stage. Per candidate, the median time of
``engine.save_checkpoint()`` (the training stall; the first save of each is left out), a
training step between two saves:

- ``torch.save``: DeepSpeed's own checkpoint engine (no nebula block), writing files;
- ``nebulite``: the nebula block with nebulite, ``async_staging`` off;
- ``async, caller``: ``async_staging=True`` with every object pickled on the caller's thread
  (its optimizer-held storages still copied after save() returns), as nebulite did before its
  scan took DeepSpeed's objects (their loss scaler, fragment addresses and stage enum);
- ``async``: ``async_staging=True``: the scan records what to copy, and a staging thread walks,
  pickles and copies behind the next optimizer step.

Each nebulite candidate keeps checkpoints in memory only (``persistent_time_interval`` of an
hour: the figures are the stall, not the writing) under a temporary persistent path.
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

CANDIDATES = ("torch.save", "nebulite", "async, caller", "async")


def _engine(width: int, layers: int, stage: int, nebula: dict[str, Any] | None) -> Any:
    import deepspeed
    import torch

    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1 << 30,
    }
    if nebula is not None:
        config["nebula"] = nebula
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return engine


def _step(engine: Any, width: int) -> None:
    import torch

    loss = engine(torch.randn(2, width)).square().mean()
    engine.backward(loss)
    engine.step()


def _measure(who: str, stage: int, args: argparse.Namespace, work: str) -> list[float]:
    import nebulite
    from nebulite import _staging

    nebulite.shutdown()
    os.environ["NEBULITE_ASYNC_STAGING"] = "1" if who.startswith("async") else "0"
    nebula = None if who == "torch.save" else {
        "enabled": True, "persistent_storage_path": os.path.join(work, "nebula"),
        "persistent_time_interval": 3600, "num_of_version_in_retention": 2}
    engine = _engine(args.width, args.layers, stage, nebula)
    scan = _staging.scan
    if who == "async, caller":
        _staging.scan = lambda obj: None  # type: ignore[assignment]
    try:
        times = []
        for i in range(args.reps + 1):
            _step(engine, args.width)
            start = time.perf_counter()
            engine.save_checkpoint(os.path.join(work, "ds"), tag=f"s{i}")
            times.append(time.perf_counter() - start)
        _step(engine, args.width)  # the last checkpoint's barrier
        if nebula is not None:
            nebulite.wait_staged()
    finally:
        _staging.scan = scan  # type: ignore[assignment]
        nebulite.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--stages", default="0,1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary "
                    "directory)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 2 reps")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.smoke:
        args.width, args.layers, args.reps = 64, 2, 2
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1",
                      MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu", NEBULITE_AGENT="0")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    import deepspeed

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce kernel (about a minute);
    # one process needs no collective, and gloo does the job.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    work = tempfile.mkdtemp(prefix="nebulite-ds-", dir=args.dir)
    params = args.layers * (args.width * args.width + args.width)
    print(f"MLP {args.layers} x {args.width}: {params / 1e6:.1f}M parameters, AdamW, "
          f"{os.cpu_count()} CPUs; median save_checkpoint() of {args.reps}, ms")
    print(f"{'ZeRO':>4}  " + "  ".join(f"{c:>14}" for c in CANDIDATES)
          + "  async / torch.save  async / async, caller")
    figures: dict[str, dict[str, list[float]]] = {}
    try:
        for stage in map(int, args.stages.split(",")):
            got = {who: _measure(who, stage, args, work) for who in CANDIDATES}
            figures[str(stage)] = got
            med = {who: statistics.median(t) for who, t in got.items()}
            print(f"{stage:>4}  " + "  ".join(f"{med[c] * 1e3:14.1f}" for c in CANDIDATES)
                  + f"  {med['async'] / med['torch.save']:18.3f}"
                  + f"  {med['async'] / med['async, caller']:21.3f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

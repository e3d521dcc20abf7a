"""Checkpointing CUDA state: nebulite beside plain copies, torch.save and DCP, one run.

    python benchmarks/bench_gpu.py                 # 10 GB state, every figure (needs a GPU)
    python benchmarks/bench_gpu.py --gb 1 --steps 20

Figures, side by side:
- D2H bandwidth: a blocking nebulite save of the state (from device memory to the memory
  tier) against a plain ``pinned.copy_(cuda, non_blocking=True)`` of the same bytes into
  pinned host memory (target: nebulite >= 90% of it);
- host time per save with ``async_staging=True`` of the same tensors held by an optimizer,
  as in training (target: <= 1 ms per object: save() records what to copy and an event on
  the current stream; the staging thread issues the copies on a copy stream behind it), and
  until staged (landed and sealed); with ``--plain``, also of the plain tensors, whose
  copies save() issues itself (a tensor no optimizer manages, such as a buffer, may change
  in forward);
- H2D bandwidth of ``load(map_location="cuda:0")`` from the memory tier against a plain
  pinned copy of the same bytes;
- ``torch.save`` to a file and DCP ``async_save`` with its pinned, cached async stager:
  blocking time per save of the same state;
- a training step with a checkpoint every step against none (target: >= 95%).
Without CUDA it says so and exits with status 0: there is nothing to measure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from suite import dcp_async  # noqa: E402

GB = 1e9


def cuda_state(nbytes: int, tensors: int) -> dict[str, torch.Tensor]:
    per = max(1, nbytes // tensors // 4)
    return {f"t{i}": torch.randn(per, device="cuda") for i in range(tensors)}


def _sync() -> None:
    torch.cuda.synchronize()


def pinned_copy_bandwidth(state: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(D2H, H2D) bytes per second of plain non-blocking copies between the state and
    pinned host memory."""
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    nbytes = sum(v.nbytes for v in state.values())
    out = []
    for to_host in (True, False):
        for _ in range(2):
            _sync()
            t0 = time.perf_counter()
            for k, v in state.items():
                if to_host:
                    host[k].copy_(v, non_blocking=True)
                else:
                    v.copy_(host[k], non_blocking=True)
            _sync()
            dt = time.perf_counter() - t0
        out.append(nbytes / dt)
    del host
    return out[0], out[1]


def nebulite_saves(state: dict[str, torch.Tensor], d: str, async_staging: bool,
                   reps: int, optimizer: bool = False) -> dict[str, float]:
    import nebulite as nm

    nbytes = sum(v.nbytes for v in state.values())
    # Room for four versions: the first is persisted (its memory held until written), and
    # a save that found no room would wait for that write, which is no device copy.
    nm.init(os.path.join(d, f"nebulite-{int(async_staging)}-{int(optimizer)}"),
            persistent_time_interval=3600, memory_buffer_size=int(nbytes * 4.2), agent=False,
            async_staging=async_staging)
    try:
        nm.api._session.engine.wait_prefaulted()  # type: ignore[union-attr]
        if optimizer:
            # The same storages as an optimizer's parameters: its step's pre-hook (which runs
            # without gradients, and changes nothing) registers them as safe.
            state = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in state.items()}
            torch.optim.SGD(list(state.values()), lr=0.0).step()
        blocking, staged = [], []
        for i in range(reps + 1):
            _sync()
            t0 = time.perf_counter()
            nm.Checkpoint(f"s{i}").save("state", state)
            t1 = time.perf_counter()
            nm.wait_staged()
            _sync()
            t2 = time.perf_counter()
            if i:
                blocking.append(t1 - t0)
                staged.append(t2 - t0)
        _sync()
        t0 = time.perf_counter()
        loaded = nm.get_latest_checkpoint().load("state", map_location="cuda:0")
        _sync()
        load_s = time.perf_counter() - t0
        del loaded
        torch.cuda.empty_cache()
        return {"blocking_s": statistics.median(blocking), "staged_s": statistics.median(staged),
                "bandwidth": nbytes / statistics.median(staged), "load_bandwidth": nbytes / load_s,
                "pinned": bool(nm.session_info()["memory_pinned"])}
    finally:
        nm.shutdown()


def torch_save(state: dict[str, torch.Tensor], d: str) -> float:
    path = os.path.join(d, "torch.pt")
    _sync()
    t0 = time.perf_counter()
    torch.save(state, path)
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def step_times(d: str, steps: int) -> dict[str, float]:
    """A step of a small transformer with and without an async checkpoint every step."""
    import nebulite as nm

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 8).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 256, 1024, device="cuda")

    def run(checkpoint: bool) -> float:
        # No synchronisation between steps (a training loop has none): a checkpoint's copies
        # overlap the next step's forward and backward, and its optimizer step waits for
        # them on the device. The mean over the steps, after 3 warm-up steps.
        for i in range(steps + 3):
            if i == 3:
                _sync()
                t0 = time.perf_counter()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if checkpoint:
                ck = nm.Checkpoint(f"step{i}", 2)
                ck.save("model", model.state_dict())
                ck.save("optimizer", opt.state_dict())
        _sync()
        if checkpoint:
            nm.wait_staged()
        return (time.perf_counter() - t0) / steps

    nm.init(os.path.join(d, "train"), persistent_time_interval=3600, num_of_version_in_retention=1,
            agent=False, async_staging=True)
    try:
        none = run(False)
        every = run(True)
    finally:
        nm.shutdown()
    return {"none_s": none, "every_step_s": every}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=10.0, help="state size in GB")
    ap.add_argument("--tensors", type=int, default=100, help="CUDA tensors in the state")
    ap.add_argument("--reps", type=int, default=3, help="timed saves of each kind")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps of each kind")
    ap.add_argument("--plain", action="store_true",
                    help="also time asynchronous saves of tensors no optimizer manages")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device: nothing to measure")
        return
    base = tempfile.mkdtemp(prefix="nebulite-bench-gpu-", dir=args.dir)
    out: dict[str, Any] = {}
    try:
        state = cuda_state(int(args.gb * GB), args.tensors)
        nbytes = sum(v.nbytes for v in state.values())
        print(f"state: {nbytes / GB:.2f} GB in {len(state)} CUDA tensors, {torch.cuda.get_device_name()}")
        out["pinned_copy"], out["pinned_h2d"] = pinned_copy_bandwidth(state)
        out["blocking"] = nebulite_saves(state, base, False, args.reps)
        out["async"] = nebulite_saves(state, base, True, args.reps, optimizer=True)
        if args.plain:
            out["async_plain"] = nebulite_saves(state, base, True, args.reps)
        try:
            dcp = dcp_async.async_save_times(state, base, args.reps)
            out["dcp"] = {k: statistics.median(r[k] for r in dcp) for k in ("blocking_s", "staged_s")}
        except Exception as e:  # this torch's DCP failed: the other figures still stand
            print(f"DCP async_save failed on torch {torch.__version__}: {type(e).__name__}: {e}")
            out["dcp"] = {"blocking_s": float("nan"), "staged_s": float("nan")}
        out["torch.save"] = torch_save(state, base)
        del state
        torch.cuda.empty_cache()
        out["train"] = step_times(base, args.steps)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    b, a = out["blocking"], out["async"]
    p = out.get("async_plain", {"blocking_s": float("nan"), "staged_s": float("nan")})
    print(f"D2H bandwidth: nebulite blocking save {b['bandwidth'] / GB:.2f} GB/s (memory tier "
          f"pinned: {b['pinned']}), plain pinned copy_ {out['pinned_copy'] / GB:.2f} GB/s: "
          f"{100 * b['bandwidth'] / out['pinned_copy']:.0f}% (target >= 90%)")
    print(f"host time per save (1 object): nebulite {b['blocking_s']:.4f} s, nebulite async "
          f"{a['blocking_s']:.4f} s (target <= 0.001 s per object; plain tensors, copies "
          f"issued by save(): {p['blocking_s']:.4f} s), DCP async_save (pinned async "
          f"stager) {out['dcp']['blocking_s']:.4f} s, torch.save {out['torch.save']:.4f} s")
    print(f"until staged: nebulite async {a['staged_s']:.4f} s (plain tensors "
          f"{p['staged_s']:.4f} s), DCP {out['dcp']['staged_s']:.4f} s")
    print(f"H2D bandwidth: nebulite load(map_location='cuda:0') from the memory tier "
          f"{b['load_bandwidth'] / GB:.2f} GB/s, plain pinned copy_ {out['pinned_h2d'] / GB:.2f} GB/s: "
          f"{100 * b['load_bandwidth'] / out['pinned_h2d']:.0f}%")
    t = out["train"]
    print(f"training step: none {t['none_s']:.4f} s, checkpoint every step {t['every_step_s']:.4f} s: "
          f"{100 * t['none_s'] / t['every_step_s']:.0f}% (target >= 95%)")


if __name__ == "__main__":
    sys.exit(main())

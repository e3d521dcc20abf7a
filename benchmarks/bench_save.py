"""Save benchmark: nebulite vs torch.save + fsync, against the machine's own limits.

    python benchmarks/bench_save.py                 # GPT-2 124M + AdamW state (~1.5 GB)
    python benchmarks/bench_save.py --tiny          # a few MB, seconds (smoke test)
    python benchmarks/bench_save.py --dir /mnt/nvme --reps 5

Measured in the same run, in this order:
  1. memcpy into warm (already touched) memory, 1 and 2 threads      -> the staging limit
  2. sequential O_DIRECT write + fsync to the benchmark's disk          -> the persistence limit
  3. nebulite: blocking time of Checkpoint.save (model + optimizer) and time until the
     checkpoint is committed on disk (flush_persistence), per save after a warm-up
  4. torch.save + fsync of the same state to the same disk (median)
Goals (DESIGN.md section 5): blocking <= 1/20 of torch.save+fsync; persistence >= 70% of
O_DIRECT write bandwidth. Results also go to benchmarks/results/latest.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

import torch

import nebulite as nm

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9
MiB = 1 << 20


# --------------------------------------------------------------------------- the state


def build_state(scale: float, tiny: bool) -> tuple[dict, str, torch.optim.Optimizer]:
    try:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        sys.exit(f"bench_save: the `transformers` package is required ({e}); run `make setup`")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if tiny:
        cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=64)
        what = "GPT-2 tiny (2 layers, d=128, vocab 1024)"
    else:
        n_layer = max(1, round(12 * scale))
        cfg = GPT2Config(n_layer=n_layer)  # defaults: n_embd 768, vocab 50257, n_positions 1024
        what = "GPT-2 124M" if n_layer == 12 else f"GPT-2 ({n_layer} layers, d=768)"
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()  # creates exp_avg / exp_avg_sq
    opt.zero_grad(set_to_none=True)
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}, what, opt


def state_bytes(state: dict) -> int:
    """Bytes of distinct tensor storages (tied weights counted once), as torch.save writes them."""
    seen, total = set(), 0

    def walk(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return total


# --------------------------------------------------------------------------- machine limits


def memcpy_bandwidth(nbytes: int, threads: int, reps: int = 5) -> float:
    """Best-of-reps bandwidth (bytes/s) of copying into a preallocated, touched buffer."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(7)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        dst.fill_(1)  # touch: fault every page in before timing
        dst.copy_(src)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best
    finally:
        torch.set_num_threads(old)


def odirect_write_bandwidth(path: str, nbytes: int, chunk: int = 8 * MiB, depth: int = 1) -> float:
    """Sequential O_DIRECT write of nbytes (chunk per write, `depth` writes in flight) + fsync."""
    nchunks = max(1, nbytes // chunk)
    bufs = []
    for _ in range(depth):
        b = mmap.mmap(-1, chunk)  # page-aligned, hence 4 KiB-aligned
        b.write(os.urandom(MiB) * (chunk // MiB))
        bufs.append(b)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        nxt = 0
        lock = threading.Lock()

        def worker(buf):
            nonlocal nxt
            while True:
                with lock:
                    i, nxt = nxt, nxt + 1
                if i >= nchunks:
                    return
                if os.pwrite(fd, buf, i * chunk) != chunk:
                    raise OSError("short O_DIRECT write")

        t0 = time.perf_counter()
        if depth == 1:
            worker(bufs[0])
        else:
            ts = [threading.Thread(target=worker, args=(b,)) for b in bufs]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
        for b in bufs:
            b.close()
    return nchunks * chunk / dt


# --------------------------------------------------------------------------- the candidates


def bench_nebulite(state: dict, root: str, reps: int, memory: int,
                   optimizer: torch.optim.Optimizer | None = None) -> dict:
    """With `optimizer`, saves use async staging: the optimizer steps once (without
    gradients: nothing changes) so that nebulite learns which storages it manages."""
    t0 = time.perf_counter()
    nm.init(persistent_storage_path=root, persistent_time_interval=0,
            num_of_version_in_retention=2, memory_buffer_size=memory,
            async_staging=optimizer is not None)
    if optimizer is not None:
        optimizer.step()
    init_s = time.perf_counter() - t0
    # The arena is pre-faulted by a background thread after init; a training job reaches
    # its first checkpoint long after that is done, so wait for it (internal hook).
    engine = getattr(getattr(nm.api, "_session", None), "engine", None)
    t0 = time.perf_counter()
    if hasattr(engine, "wait_prefaulted"):
        engine.wait_prefaulted()
    prefault_s = time.perf_counter() - t0
    block, staged, commit, split = [], [], [], []
    for i in range(reps + 1):  # save 0 is the warm-up
        t0 = time.perf_counter()
        ck = nm.Checkpoint(f"bench{i}", num_files=2)
        ck.save("model", state["model"])
        t1 = time.perf_counter()
        ck.save("optimizer", state["optimizer"])
        t2 = time.perf_counter()
        nm.wait_staged()  # what an optimizer step right after the save would wait for
        ts = time.perf_counter()
        nm.flush_persistence()
        t3 = time.perf_counter()
        if i == 0:
            warm = (t2 - t0, t3 - t0)
        else:
            block.append(t2 - t0)
            staged.append(ts - t0)
            commit.append(t3 - t0)
            split.append((t1 - t0, t2 - t1))
    on_disk = 0
    for d, _, files in os.walk(os.path.join(root, f"bench{reps}")):
        on_disk += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    hist = nm.history()
    nm.shutdown()
    return {"init_s": init_s, "prefault_wait_s": prefault_s, "warmup_blocking_s": warm[0], "warmup_committed_s": warm[1],
            "blocking_s": block, "staged_s": staged, "committed_s": commit,
            "blocking_model_opt_s": split, "bytes_on_disk": on_disk, "history_tail": hist[-3:]}


def bench_torch_save(state: dict, path: str, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        out.append(time.perf_counter() - t0)
        os.unlink(path)
    return out


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description="nebulite save benchmark")
    ap.add_argument("--dir", default="/tmp", help="where the bench files go (a fresh subdirectory, removed at the end)")
    ap.add_argument("--tiny", action="store_true", help="tiny configuration, runs in seconds (smoke test)")
    ap.add_argument("--size-scale", type=float, default=1.0, help="scale the number of layers (1.0 = GPT-2 124M)")
    ap.add_argument("--reps", type=int, default=3, help="measured saves (after one warm-up)")
    ap.add_argument("--memory", type=int, default=4 << 30, help="nebulite memory_buffer_size in bytes")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "latest.json"))
    args = ap.parse_args()
    tiny = args.tiny or args.size_scale <= 0.05
    if tiny:
        args.memory = min(args.memory, 256 << 20)

    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="nebulite-bench-", dir=args.dir)
    try:
        t_start = time.perf_counter()
        state, what, optimizer = build_state(args.size_scale, tiny)
        nbytes = state_bytes(state)
        probe = max(64 * MiB, min(1 << 30, nbytes // MiB * MiB))  # ~1 GB memcpy probe
        wbytes = max(64 * MiB, nbytes // (8 * MiB) * (8 * MiB))  # as much as one checkpoint
        print(f"nebulite save benchmark: {what} + AdamW state = {nbytes / GB:.3f} GB; "
              f"{os.cpu_count()} CPUs; dir {work}", flush=True)

        mc1 = memcpy_bandwidth(probe, 1)
        mc2 = memcpy_bandwidth(probe, 2)
        try:
            od1 = odirect_write_bandwidth(os.path.join(work, "odirect.bin"), wbytes, depth=1)
            od4 = odirect_write_bandwidth(os.path.join(work, "odirect.bin"), wbytes, depth=4)
        except OSError as e:
            print(f"O_DIRECT write failed on {work}: {e}")
            od1 = od4 = float("nan")
        odirect = max(od1, od4)
        print(f"limits: memcpy warm {mc1 / GB:.1f} GB/s (1 thread), {mc2 / GB:.1f} GB/s (2 threads); "
              f"O_DIRECT write+fsync {od1 / GB:.2f} GB/s (1 in flight), {od4 / GB:.2f} GB/s (4 in flight)",
              flush=True)

        neb = bench_nebulite(state, os.path.join(work, "nebulite"), args.reps, args.memory)
        ts = bench_torch_save(state, os.path.join(work, "torch_save.pt"), args.reps)
        nba = bench_nebulite(state, os.path.join(work, "nebulite-async"), args.reps, args.memory,
                             optimizer=optimizer)
        med = statistics.median
        blk, com, tsv = med(neb["blocking_s"]), med(neb["committed_s"]), med(ts)
        ablk, astg, acom = med(nba["blocking_s"]), med(nba["staged_s"]), med(nba["committed_s"])
        persist_bw = nbytes / com
        stage_bw = nbytes / blk

        blk_ok = min(blk, ablk) <= tsv / 20
        bw_ok = persist_bw >= 0.7 * odirect
        rows = [
            ("nebulite init / arena prefault", f"{neb['init_s']:.2f} s",
             f"then prefault {neb['prefault_wait_s']:.2f} s", ""),
            ("nebulite warm-up save, blocking", f"{neb['warmup_blocking_s']:.3f} s",
             f"committed {neb['warmup_committed_s']:.2f} s", ""),
            ("nebulite save, blocking", f"{blk:.3f} s", f"torch.save+fsync {tsv:.2f} s",
             f"1/{tsv / blk:.1f}"),
            ("  as staging bandwidth", f"{stage_bw / GB:.2f} GB/s", f"memcpy 2 thr {mc2 / GB:.1f} GB/s",
             f"{stage_bw / mc2:.0%}"),
            ("nebulite async staging, blocking", f"{ablk:.3f} s", f"torch.save+fsync {tsv:.2f} s",
             f"1/{tsv / ablk:.1f}"),
            ("  until staged (optimizer waits)", f"{astg:.3f} s", f"torch.save+fsync {tsv:.2f} s",
             f"1/{tsv / astg:.1f}"),
            ("  async save -> committed", f"{acom:.2f} s", f"torch.save+fsync {tsv:.2f} s",
             f"{tsv / acom:.2f}x faster"),
            ("nebulite save -> committed", f"{com:.2f} s", f"torch.save+fsync {tsv:.2f} s",
             f"{tsv / com:.2f}x faster"),
            ("nebulite persistence bandwidth", f"{persist_bw / GB:.2f} GB/s",
             f"O_DIRECT {odirect / GB:.2f} GB/s", f"{persist_bw / odirect:.0%}"),
            ("torch.save + fsync bandwidth", f"{nbytes / tsv / GB:.2f} GB/s",
             f"O_DIRECT {odirect / GB:.2f} GB/s", f"{nbytes / tsv / odirect:.0%}"),
        ]
        print(f"\nper save, median of {args.reps} after a warm-up "
              f"(blocking per save: {', '.join(f'{x:.3f}' for x in neb['blocking_s'])} s; "
              f"committed: {', '.join(f'{x:.2f}' for x in neb['committed_s'])} s; "
              f"torch.save+fsync: {', '.join(f'{x:.2f}' for x in ts)} s)")
        print(f"  {'figure':34s}{'value':>12s}   {'baseline':28s}{'ratio':>12s}")
        for r in rows:
            print(f"  {r[0]:34s}{r[1]:>12s}   {r[2]:28s}{r[3]:>12s}")
        print("goals:")
        print(f"  blocking <= 1/20 of torch.save+fsync:        {'PASS' if blk_ok else 'MISS'} "
              f"(limit {tsv / 20:.3f} s; synchronous staging {blk:.3f} s, async staging {ablk:.3f} s)")
        if blk > tsv / 20:
            print("    synchronous staging copies the whole state before save() returns: it is bounded"
                  f" by memcpy ({nbytes / mc2:.3f} s for this state at {mc2 / GB:.1f} GB/s)")
        print(f"  persistence >= 70% of O_DIRECT write bw:     {'PASS' if bw_ok else 'MISS'} "
              f"({persist_bw / GB:.2f} GB/s vs limit {0.7 * odirect / GB:.2f} GB/s)")
        print(f"(bytes on disk per checkpoint {neb['bytes_on_disk'] / GB:.3f} GB; "
              f"benchmark took {time.perf_counter() - t_start:.0f} s)")

        result = {
            "time_unix": time.time(), "host": platform.node(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "config": what, "tiny": tiny, "reps": args.reps,
            "dir": args.dir, "state_bytes": nbytes,
            "limits": {"memcpy_warm_1thread_Bps": mc1, "memcpy_warm_2threads_Bps": mc2,
                       "odirect_write_qd1_Bps": od1, "odirect_write_qd4_Bps": od4},
            "nebulite": {k: v for k, v in neb.items() if k != "history_tail"},
            "nebulite_async_staging": {k: v for k, v in nba.items() if k != "history_tail"},
            "torch_save_fsync_s": ts,
            "summary": {"blocking_s": blk, "async_blocking_s": ablk, "async_staged_s": astg,
                        "committed_s": com, "torch_save_fsync_s": tsv,
                        "blocking_ratio": tsv / blk, "persist_Bps": persist_bw,
                        "persist_fraction_of_odirect": persist_bw / odirect},
            "goals": {"blocking_le_1_20_torch_save": blk_ok, "persist_ge_70pct_odirect": bw_ok},
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"results: {os.path.relpath(args.json)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

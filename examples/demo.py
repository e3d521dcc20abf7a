"""nebulite demo: train, crash with SIGKILL, resume bit-for-bit, and time the saves.

    python examples/demo.py            (or: make demo)

1. A child process trains a small GPT-2 on synthetic tokens (CPU, AdamW) and checkpoints
   every 5 steps with nebulite; at step 23 it kills itself with SIGKILL. nebulite's node
   agent (started by the first init()) outlives it and commits the last checkpoint.
2. A new child resumes from nebulite's latest committed checkpoint (from the agent's
   memory), checks that the model and optimizer it loaded are bit-for-bit those of that
   step (sha256 recorded by the first run), replays the lost steps and trains to the end.
   With NEBULITE_AGENT=0 (no agent) it resumes from the newest checkpoint on disk.
3. The resumed child then times a save of its state with nebulite vs torch.save + fsync.

Exit status is non-zero when the resume check fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time

import torch

import nebulite as nm

RUN_DIR = os.path.abspath("demo_run")
CKPT_DIR = os.path.join(RUN_DIR, "checkpoints")
SIDE = os.path.join(RUN_DIR, "side.json")  # the first run's record of each checkpointed step
STEPS, EVERY, CRASH_AT = 40, 5, 23
BATCH, SEQ, VOCAB = 4, 64, 2048
MEM = 512 << 20  # nebulite's memory tier for the demo (bytes)


# --------------------------------------------------------------------------- model & data


def build_model() -> torch.nn.Module:
    try:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:  # pragma: no cover - environment problem
        sys.exit(f"demo: the `transformers` package is required ({e}); run `make setup`")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=128,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


ACTIVE = 64  # the data uses the first 64 token ids, so that the loss visibly falls in 40 steps
PERM = torch.randperm(ACTIVE, generator=torch.Generator().manual_seed(7))


def batch_for(step: int) -> torch.Tensor:
    """Synthetic, learnable sequences (each token is PERM of the previous), a pure function of step."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.empty(BATCH, SEQ, dtype=torch.long)
    x[:, 0] = torch.randint(0, ACTIVE, (BATCH,), generator=g)
    for t in range(1, SEQ):
        x[:, t] = PERM[x[:, t - 1]]
    return x


def digest(obj) -> str:
    """sha256 over a nested structure of tensors, dicts, lists and scalars (exact bytes)."""
    h = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                walk(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


def write_side(record: dict) -> None:
    """Atomically and durably replaces the side file (tmp, fsync, rename, fsync dir)."""
    tmp = SIDE + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, SIDE)
    fd = os.open(RUN_DIR, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_side() -> dict:
    with open(SIDE) as f:
        return json.load(f)


# --------------------------------------------------------------------------- the training child


def train(resume: bool) -> int:
    torch.set_num_threads(2)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    nm.init(persistent_storage_path=CKPT_DIR, persistent_time_interval=0,
            num_of_version_in_retention=3, memory_buffer_size=MEM)
    side = {"saved": {}, "losses": {}} if not resume else read_side()
    side["agent_pid"] = nm.session_info()["agent_pid"]
    start = 0
    who = "resume" if resume else "run 1 "

    if resume:
        latest = nm.get_latest_checkpoint()
        if latest.tag == "":
            print("resume: FAIL - no committed checkpoint found")
            return 1
        tier = latest._committed["tier"]
        meta = latest.load("meta")
        start = int(meta["step"])
        model_sd = latest.load("model", map_location="cpu")
        opt_sd = latest.load("optimizer", map_location="cpu")
        want = side["saved"].get(str(start))
        got = {"model": digest(model_sd), "optimizer": digest(opt_sd)}
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
        torch.set_rng_state(meta["torch_rng"])
        random.setstate(meta["py_rng"])
        # The loaded objects must hash as the first run's did at that step, and so must
        # the live model and optimizer after load_state_dict.
        live = {"model": digest(model.state_dict()), "optimizer": digest(opt.state_dict())}
        ok = want is not None and got == want and live == want
        print(f"resume: loaded {latest.tag!r} from {'memory' if tier == 'memory' else 'disk'} "
              f"-> step {start}; "
              f"sha256 model {got['model'][:12]} optimizer {got['optimizer'][:12]}: "
              f"{'bit-for-bit equal to run 1' if ok else 'MISMATCH with run 1 ' + str(want)}")
        if not ok:
            return 1
        side["resumed_from"] = start

    model.train()
    replay = []
    for step in range(start + 1, STEPS + 1):
        x = batch_for(step)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        lv = loss.item()
        if resume and str(step) in side["losses"]:
            replay.append(side["losses"][str(step)] == lv)
        else:
            side["losses"][str(step)] = lv
        if step % EVERY == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            if not resume:
                side["saved"][str(step)] = {k: digest(v) for k, v in state.items()}
                write_side(side)  # hash is durable before the checkpoint can be committed
            t0 = time.perf_counter()
            ck = nm.Checkpoint(f"global_step{step}", num_files=3)
            ck.save("model", state["model"])
            ck.save("optimizer", state["optimizer"])
            ck.save("meta", {"step": step, "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()})
            dt = (time.perf_counter() - t0) * 1e3
            print(f"{who}: step {step:2d}  loss {lv:.3f}  checkpoint global_step{step} saved "
                  f"({dt:.0f} ms blocking)", flush=True)
        if not resume and step == CRASH_AT:
            # What the store holds right now, as this process sees it (before the crash).
            persisted = [c["tag"] for c in nm.list_checkpoints() if c["persisted"]]
            side["persisted_before_crash"] = [int(t[len("global_step"):]) for t in persisted]
            write_side(side)
            print(f"run 1 : step {step:2d}  loss {lv:.3f}  SIGKILL (persisted so far: "
                  f"{', '.join(persisted) or 'none'})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    if resume:
        nm.flush_persistence()
        n = len(replay)
        same = all(replay)
        print(f"resume: replayed steps {start + 1}-{start + n}: losses {'identical to' if same else 'DIFFER from'} "
              f"run 1; trained to step {STEPS}, final loss {lv:.3f}", flush=True)
        side["timings"] = time_saves(model, opt)
        write_side(side)
        if not same:
            return 1
    return 0


# --------------------------------------------------------------------------- parent: timings


def time_saves(model: torch.nn.Module, opt: torch.optim.Optimizer, reps: int = 5) -> dict:
    """Blocking time of a nebulite save vs torch.save + fsync of the same state (seconds)."""
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    nbytes = sum(t.numel() * t.element_size() for t in sd["model"].values())
    nbytes += sum(t.numel() * t.element_size() for s in sd["optimizer"]["state"].values()
                  for t in s.values() if isinstance(t, torch.Tensor))
    bench = os.path.join(RUN_DIR, "bench")
    nm.init(persistent_storage_path=os.path.join(bench, "nebulite"), persistent_time_interval=0,
            num_of_version_in_retention=2, memory_buffer_size=MEM)
    block, commit = [], []
    for i in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        ck = nm.Checkpoint(f"bench{i}", num_files=2)
        ck.save("model", sd["model"])
        ck.save("optimizer", sd["optimizer"])
        t1 = time.perf_counter()
        nm.flush_persistence()
        t2 = time.perf_counter()
        if i:
            block.append(t1 - t0)
            commit.append(t2 - t0)
    nm.shutdown()
    path = os.path.join(bench, "torch_save.pt")
    ts = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        if i:
            ts.append(time.perf_counter() - t0)
        os.unlink(path)
    shutil.rmtree(bench, ignore_errors=True)
    med = statistics.median
    return {"bytes": nbytes, "reps": reps, "torch_save_fsync": med(ts),
            "nebulite_blocking": med(block), "nebulite_committed": med(commit)}


def print_timings(t: dict) -> None:
    ts, b, c = t["torch_save_fsync"], t["nebulite_blocking"], t["nebulite_committed"]
    print(f"\nsave of model + AdamW state ({t['bytes'] / 1e6:.0f} MB), median of {t['reps']} after a warm-up:")
    print(f"  {'':38s}{'ms':>7s}   torch.save+fsync / this")
    print(f"  {'torch.save + fsync (training blocked)':38s}{ts * 1e3:7.1f}   1.0x")
    print(f"  {'nebulite save (training blocked)':38s}{b * 1e3:7.1f}   {ts / b:.1f}x")
    print(f"  {'nebulite save -> committed on disk':38s}{c * 1e3:7.1f}   {ts / c:.1f}x  (in the background)")


# --------------------------------------------------------------------------- parent


def child(mode: str) -> int:
    return subprocess.run([sys.executable, os.path.abspath(__file__), mode]).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="demo", choices=["demo", "train", "resume"])
    args = ap.parse_args()
    if args.mode != "demo":
        return train(resume=args.mode == "resume")

    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        print("demo: the `transformers` package is required (GPT2LMHeadModel); run `make setup`")
        return 2
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    os.makedirs(RUN_DIR)
    print(f"nebulite demo: GPT-2 (4 layers, d=256, vocab {VOCAB}) on synthetic tokens, CPU, AdamW; "
          f"checkpoint every {EVERY} steps to {os.path.relpath(CKPT_DIR)}/")
    t0 = time.perf_counter()
    rc = child("train")
    if rc != -signal.SIGKILL:
        print(f"FAIL: the training process should have died of SIGKILL, exit status {rc}")
        return 1
    # What a fresh process finds committed on disk after the crash.
    on_disk = [c for c in nm.list_checkpoints(persist_path=CKPT_DIR) if c["persisted"]]
    side = read_side()
    saved = sorted(int(s) for s in side["saved"])
    tags = [c["tag"] for c in on_disk]
    print(f"crash : process died of SIGKILL; last save returned at step {saved[-1]}; "
          f"committed on disk so far: {', '.join(tags) or 'none'}")
    agent = side.get("agent_pid")
    if agent:
        # The agent persists and commits every checkpoint whose save() returned.
        print(f"crash : the node agent (pid {agent}) outlives the trainer and commits "
              f"global_step{saved[-1]}")
        expect = saved[-1]
    else:
        expect = int(tags[0][len("global_step"):]) if tags else None

    rc = child("resume")
    side = read_side()
    got = side.get("resumed_from")
    floor = max(side.get("persisted_before_crash") or [0])
    why = ("the last save, which the node agent held in memory and committed after the kill"
           if agent and got == saved[-1] else
           "the last save, whose background persist had committed before the kill"
           if got == saved[-1] else
           "the newest checkpoint whose commit had completed; the last save's persist was cut short")
    ok = rc == 0 and got is not None and got == expect and got >= floor
    if ok:
        print(f"resume: PASS - resumed from step {got}: {why}")
    else:
        print(f"resume: FAIL - exit {rc}, resumed from {got}, expected {expect}, "
              f"known committed before the crash {floor}")
    if "timings" in side:
        print_timings(side["timings"])
    print(f"\ndemo took {time.perf_counter() - t0:.0f} s; checkpoints are in {os.path.relpath(CKPT_DIR)}/")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

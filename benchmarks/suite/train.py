"""The training run: GPT-2 trained on CPU, with a checkpoint every N steps.

Every variant trains the same model, in segments of N steps with one checkpoint of the
model and optimizer state after step N/2 of the segment (so its background work, such
as persisting, falls inside the timed segment, not after it). The variants take turns,
segment by segment, for a few rounds, in a rotated order: a machine shared with other
work then slows them alike, and each round's no-checkpoint segment is the baseline of
that round's others. Steps per second = steps / wall time, checkpoints included.
Each segment starts after one untimed checkpoint: the steady state of a long job.

Variants: no checkpointing, torch.save, DCP async_save (DCP's own stager, cached across
saves; each save first waits for the previous one, as DCP asks), nebulite with the
embedded engine and asynchronous staging, and nebulite with the node agent (synchronous
staging, the default, and asynchronous staging). Setting up a
variant (init, pre-faulting the memory tier, starting the agent) is not timed: a job does
that once, long before its first checkpoint.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Any, Callable

import torch

from . import workloads
from .link import Link
from .worker import arena_bytes

VARIANTS = ["none", "torch.save", "dcp.async_save", "nebulite async staging", "nebulite agent",
            "nebulite agent, async staging"]


class Checkpointer:
    """save(step) is called in the training loop; finish() waits for background work;
    warm_up() takes one untimed checkpoint (a job's first checkpoint after setting up pays
    one-time costs, such as faulting in nebulite's memory or DCP's staging cache; the
    suite's save figures report it; here the steady state is measured)."""

    def __init__(self, save: Callable[[int], None] | None = None, finish: Callable[[], None] | None = None,
                 close: Callable[[], None] | None = None) -> None:
        self.save = save or (lambda step: None)
        self.finish = finish or (lambda: None)
        self.close = close or (lambda: None)

    def warm_up(self) -> None:
        self.save(0)
        self.finish()


def _keep_last(paths: list[str], n: int = 2) -> None:
    while len(paths) > n:
        p = paths.pop(0)
        shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)


def checkpointer(variant: str, model: torch.nn.Module, opt: torch.optim.Optimizer, d: str,
                 memory: int) -> Checkpointer:
    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    if variant == "none":
        return Checkpointer()
    if variant == "torch.save":
        paths: list[str] = []

        def save(step: int) -> None:
            paths.append(os.path.join(d, f"torch-step{step}.pt"))
            torch.save(state(), paths[-1])
            _keep_last(paths)

        return Checkpointer(save, close=lambda: _keep_last(paths, 0))
    if variant == "dcp.async_save":
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        warnings.filterwarnings("ignore", module=r"torch\.distributed")
        stager = DefaultStager(StagingOptions(torch.cuda.is_available(), True, False, False))
        dirs: list[str] = []
        pending: list[Any] = []

        def wait() -> None:
            while pending:
                pending.pop().result()

        def save(step: int) -> None:
            wait()
            dirs.append(os.path.join(d, f"dcp-step{step}"))
            pending.append(dcp.async_save(state(), checkpoint_id=dirs[-1], async_stager=stager))
            _keep_last(dirs, 3)

        def close() -> None:
            wait()
            stager.close()
            _keep_last(dirs, 0)

        return Checkpointer(save, wait, close)
    if variant in ("nebulite async staging", "nebulite agent", "nebulite agent, async staging"):
        import nebulite as nm

        agent = variant.startswith("nebulite agent")
        root = os.path.join(d, "nebulite-agent" if agent else "nebulite")
        nm.init(root, persistent_time_interval=0, num_of_version_in_retention=2,
                memory_buffer_size=memory, agent=agent, async_staging=variant.endswith("async staging"),
                agent_idle_exit=3600)
        engine = getattr(getattr(nm.api, "_session", None), "engine", None)
        if hasattr(engine, "wait_prefaulted"):
            engine.wait_prefaulted()  # a job's first checkpoint comes long after init

        def save(step: int) -> None:
            ck = nm.Checkpoint(f"step{step}", num_files=2)
            ck.save("model", model.state_dict())
            ck.save("optimizer", opt.state_dict())

        return Checkpointer(save, nm.flush_persistence, nm.shutdown)
    raise SystemExit(f"unknown training variant {variant!r}")


def run(spec: dict[str, Any], link: Link) -> dict[str, Any]:
    w = workloads.get(spec["workload"])
    model, opt = workloads.gpt2_model_and_optimizer(w)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, w.vocab_size, (spec["batch"], spec["seq"]), generator=g)

    def step() -> None:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # creates the optimizer state; first-call overheads
        step()
    nbytes = workloads.state_bytes({"model": model.state_dict(), "optimizer": opt.state_dict()})
    memory = arena_bytes(nbytes, spec["memory_factor"])
    every, rounds = spec["every"], spec["rounds"]
    variants = spec.get("variants") or VARIANTS
    out: dict[str, Any] = {"workload": w.name, "state_bytes": nbytes, "steps": every * rounds,
                           "every": every, "rounds": rounds, "batch": spec["batch"], "seq": spec["seq"],
                           "segments": []}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for variant in order:
            ck = checkpointer(variant, model, opt, spec["dir"], memory)
            ck.warm_up()
            ckpt_s: list[float] = []
            t0 = time.perf_counter()
            for i in range(1, every + 1):
                step()
                if i == every // 2 or every == 1:
                    tc = time.perf_counter()
                    ck.save(r * every + i)
                    ckpt_s.append(time.perf_counter() - tc)
            seconds = time.perf_counter() - t0
            tf = time.perf_counter()
            ck.finish()
            finish_s = time.perf_counter() - tf
            ck.close()
            out["segments"].append({"round": r, "variant": variant, "steps": every, "seconds": seconds,
                                    "checkpoint_call_s": ckpt_s, "finish_s": finish_s})
        link.progress(f"  training round {r + 1}/{rounds}: " + ", ".join(
            f"{s['variant']} {s['steps'] / s['seconds']:.2f}" for s in out["segments"] if s["round"] == r)
            + " steps/s")
    out["variants"] = summarize(out["segments"])
    return out


def summarize(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant: steps/s over all its segments, and the median over rounds of its
    steps/s relative to the no-checkpoint segment of the same round."""
    names = list(dict.fromkeys(s["variant"] for s in segments))
    none = {s["round"]: s["steps"] / s["seconds"] for s in segments if s["variant"] == "none"}
    out = []
    for name in names:
        mine = [s for s in segments if s["variant"] == name]
        rel = [s["steps"] / s["seconds"] / none[s["round"]] for s in mine if s["round"] in none]
        out.append({"variant": name, "steps_per_s": sum(s["steps"] for s in mine) / sum(s["seconds"] for s in mine),
                    "relative_to_none": statistics.median(rel) if rel else None,
                    "relative_by_round": rel,
                    "checkpoint_call_s": [c for s in mine for c in s["checkpoint_call_s"]]})
    return out

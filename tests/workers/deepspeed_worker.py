"""Worker for tests/test_deepspeed.py: one rank of a DeepSpeed training run on the CPU whose
ds_config has a "nebula" block, so that DeepSpeed drives nebulite (imported by DeepSpeed as
``torch_nebula``) through its own NebulaCheckpointEngine.

Usage: deepspeed_worker.py MODES WORKDIR RANK WORLD PORT

MODES is a comma-separated list of:
  save    -- for ZeRO stages 0, 1 and 2: trains 6 steps and calls save_checkpoint() every
             2 steps (global_step2, 4, 6) into WORKDIR/z<stage>/ds while nebulite persists
             to WORKDIR/z<stage>/nebula; each rank writes the state it expects back per tag
             (plain torch.save) into WORKDIR/z<stage>/expected. Then saves global_step2 of
             ZeRO 1 with Nebula disabled (DeepSpeed's torch.save engine) into WORKDIR/plain/ds.
  resume  -- fresh engines (other initial weights) load what `save` wrote: the latest tag,
             an explicit tag, and a tag that retention removed; ZeRO 2 loads through
             nebula_load_path while persisting to another path; then trains and saves on.
             With enable_nebula_load false the first load reads WORKDIR/plain/ds with
             torch.load, a later one nebulite's checkpoint. Without the nebula block, loads
             WORKDIR/export/ds_checkpoints (ZeRO 1's global_step6 copied out of nebulite).
  agent   -- (with NEBULITE_AGENT=1) ZeRO 2: saves and loads back in the same processes
             straight after save_checkpoint() returned, from the node agent's memory.
  mixed_tags
          -- ZeRO 1 with DeepSpeed's tag validation off ("Warn", then "Ignore"): each rank
             calls save_checkpoint() with a tag of its own, which fails on every rank; then
             a save with one tag on every rank commits.
  azure_save, azure_resume
          -- Azure's documented pattern: ds_config.json on disk with the nebula block,
             save_dir = persistent_storage_path, plain model_engine.save_checkpoint(save_dir)
             three times; then a new process calls load_checkpoint(save_dir).
Prints one JSON line "RESULT {...}" (one entry per mode) and exits 0.
"""

from __future__ import annotations

import argparse
import enum
import http
import json
import os
import sys
from typing import Any

MODEL_SEED = 1234  # the saving run's initial weights; resuming engines start elsewhere
STEPS_PER_SAVE = 2
STAGES = (0, 1, 2, 3)


def _bits(t: Any) -> Any:
    """The bytes of tensor `t`, in element order."""
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same(a: Any, b: Any, path: str = "") -> str:
    """'' when `a` and `b` are equal (tensors: bit for bit, with dtype and shape), else
    where they first differ."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} != {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        if torch.equal(_bits(a), _bits(b)):  # bit for bit: a NaN equals the same NaN
            return ""
        differ = int((_bits(a) != _bits(b)).sum())
        nans = [int(t.isnan().sum()) if t.is_floating_point() else 0 for t in (a, b)]
        return f"{path}: tensors differ ({differ} of {_bits(a).numel()} bytes; NaNs {nans[0]} and {nans[1]})"
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b)) if isinstance(b, dict) else b!r}"
        return next((d for k in a if (d := same(a[k], b[k], f"{path}.{k}"))), "")
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{path}: {type(a).__name__}[{len(a)}] != {b!r}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := same(x, y, f"{path}[{i}]"))), "")
    if isinstance(a, enum.Enum) or isinstance(a, (int, float, str, bytes, bool, type(None), argparse.Namespace)):
        return "" if type(a) is type(b) and a == b else f"{path}: {a!r} != {b!r}"
    if hasattr(a, "__dict__"):  # DeepSpeed's own objects (its loss scaler) compare by state
        if type(a) is not type(b):
            return f"{path}: {type(a).__name__} != {type(b).__name__}"
        return same(vars(a), vars(b), f"{path}<{type(a).__name__}>")
    return "" if a == b else f"{path}: {a!r} != {b!r}"


def client_state(step: int) -> dict[str, Any]:
    """What a training script keeps in DeepSpeed's client_state: non-tensor objects too."""
    import torch

    return {
        "epoch": step // 2,
        "data_position": torch.arange(4, dtype=torch.int64) + step,
        "args": argparse.Namespace(lr=0.01, run="r1", layers=[8, 16]),
        "status": http.HTTPStatus.OK,
    }


class Rank:
    def __init__(self, workdir: str, rank: int, world: int) -> None:
        self.workdir, self.rank, self.world = workdir, rank, world

    # -- an engine --------------------------------------------------------------

    def config(self, stage: int, nebula: dict[str, Any] | None) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "train_batch_size": 4 * self.world,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 1000,
        }
        if nebula is not None:
            cfg["nebula"] = nebula
        return cfg

    def engine(self, config: dict[str, Any] | str, seed: int) -> Any:
        import deepspeed
        import torch

        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return eng

    def train(self, eng: Any, steps: int) -> None:
        import torch

        for _ in range(steps):
            g = torch.Generator().manual_seed(eng.global_steps * 100 + self.rank)
            x = torch.randn(4, 8, generator=g)
            loss = eng(x).pow(2).mean()
            eng.backward(loss)
            eng.step()

    def state(self, eng: Any, client: dict[str, Any] | None) -> dict[str, Any]:
        """Everything that save_checkpoint keeps for this rank, as a copy (through torch.save:
        ZeRO's state holds views that deepcopy refuses)."""
        import io

        import torch

        buf = io.BytesIO()
        torch.save({
            "module": self.module_state(eng),
            "optimizer": eng.optimizer.state_dict(),
            "lr_scheduler": eng.lr_scheduler.state_dict(),
            "global_steps": eng.global_steps,
            "client": client,
        }, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)  # written just above

    def module_state(self, eng: Any) -> dict[str, Any]:
        """The module's state this rank holds: with ZeRO 3, its partition of each parameter."""
        if not eng.zero_optimization_partition_weights():
            return eng.module.state_dict()
        return {k: p.ds_tensor.detach().clone() for k, p in eng.module.named_parameters()}

    def loaded_matches(self, eng: Any, client: dict[str, Any] | None, expected: dict[str, Any]) -> str:
        got = self.state(eng, None)
        got["client"] = None if client is None else {k: client[k] for k in expected["client"] if k in client}
        return same(got, expected) or "ok"

    def expected_path(self, base: str, tag: str) -> str:
        return os.path.join(base, "expected", f"{tag}.rank{self.rank}.pt")

    def read_expected(self, base: str, tag: str) -> dict[str, Any]:
        import torch

        return torch.load(self.expected_path(base, tag), weights_only=False)  # written by `save`

    # -- modes ------------------------------------------------------------------

    def nebula_block(self, base: str, **more: Any) -> dict[str, Any]:
        block = {
            "enabled": True,
            "persistent_storage_path": os.path.join(base, "nebula"),
            "persistent_time_interval": 0,
            "num_of_version_in_retention": 2,
            "enable_nebula_load": True,
        }
        block.update(more)
        return block

    def save(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist
        import torch_nebula

        import nebulite

        out: dict[str, Any] = {"torch_nebula_is_nebulite": torch_nebula.Checkpoint is nebulite.Checkpoint}
        # With asynchronous staging: whether the scan took each object saved (else it is
        # staged on the caller's thread), in order.
        taken: list[bool] = []
        scan = nebulite._staging.scan

        def recording_scan(obj: Any) -> Any:
            found = scan(obj)
            taken.append(found is not None)
            return found

        nebulite._staging.scan = recording_scan  # type: ignore[assignment]
        for stage in STAGES:
            taken.clear()
            base = os.path.join(self.workdir, f"z{stage}")
            os.makedirs(os.path.join(base, "expected"), exist_ok=True)
            eng = self.engine(self.config(stage, self.nebula_block(base)), MODEL_SEED)
            r: dict[str, Any] = {"engine": type(eng.checkpoint_engine).__name__}
            for step in (2, 4, 6):
                self.train(eng, STEPS_PER_SAVE)
                client = client_state(step)
                torch.save(self.state(eng, client), self.expected_path(base, f"global_step{step}"))
                eng.save_checkpoint(os.path.join(base, "ds"), client_state=client)
            # What DeepSpeed itself left in save_dir: empty placeholders for its glob.
            tag_dir = os.path.join(base, "ds", "global_step6")
            r["placeholders"] = {n: torch.load(os.path.join(tag_dir, n), weights_only=True)
                                 for n in sorted(os.listdir(tag_dir))}
            # Every rank has read every rank's placeholders before any rank goes on to what
            # replaces its own (zero_to_fp32's flush_persistence, the next stage's init).
            dist.barrier()
            if stage == 3:
                r["zero_to_fp32"] = self.zero_to_fp32(base)
            config = nebulite.api._config()
            r["async_staging"] = bool(config and config.async_staging)
            # What asynchronous staging learnt from the optimizers' steps, and defers.
            r["safe_storages"] = len(nebulite._staging._safe_storages)
            r["scanned"] = list(taken)
            out[f"z{stage}"] = r
        nebulite._staging.scan = scan  # type: ignore[assignment]
        # A checkpoint written without Nebula, for enable_nebula_load: false.
        base = os.path.join(self.workdir, "plain")
        os.makedirs(os.path.join(base, "expected"), exist_ok=True)
        eng = self.engine(self.config(1, None), MODEL_SEED)
        self.train(eng, STEPS_PER_SAVE)
        torch.save(self.state(eng, client_state(2)), self.expected_path(base, "global_step2"))
        eng.save_checkpoint(os.path.join(base, "ds"), client_state=client_state(2))
        out["plain_engine"] = type(eng.checkpoint_engine).__name__
        return out

    def zero_to_fp32(self, base: str) -> str:
        """DeepSpeed's zero_to_fp32 on save_dir once nebulite has persisted the checkpoints:
        the whole fp32 model of global_step6, made of every rank's partition ('ok' when
        equal, bit for bit, to the partitions the ranks held; read on rank 0)."""
        import torch
        import torch.distributed as dist
        import torch_nebula
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        torch_nebula.flush_persistence()
        dist.barrier()  # every rank's files are in save_dir
        if self.rank != 0:
            return "rank 0 reads"
        got = get_fp32_state_dict_from_zero_checkpoint(os.path.join(base, "ds"), "global_step6")
        parts = [torch.load(os.path.join(base, "expected", f"global_step6.rank{r}.pt"), weights_only=False)["module"]
                 for r in range(self.world)]
        want = {k: torch.cat([p[k] for p in parts])[:got[k].numel()].view(got[k].shape) for k in got}
        return same(dict(got), want) or "ok"

    def resume(self) -> dict[str, Any]:
        import torch
        import torch_nebula

        out: dict[str, Any] = {}
        for stage in STAGES:
            base = os.path.join(self.workdir, f"z{stage}")
            if stage == 2:  # load from the first run's path, persist into a new one
                block = self.nebula_block(base, persistent_storage_path=os.path.join(base, "nebula_b"),
                                          nebula_load_path=os.path.join(base, "nebula"))
            else:
                block = self.nebula_block(base)
            eng = self.engine(self.config(stage, block), MODEL_SEED + 1)
            want6 = self.read_expected(base, "global_step6")
            r: dict[str, Any] = {"differs_before_load": bool(same(self.module_state(eng), want6["module"]))}
            ds = os.path.join(base, "ds")
            path, client = eng.load_checkpoint(ds)  # the tag in ds/latest
            r["latest"] = [os.path.relpath(path, ds), self.loaded_matches(eng, client, want6)]
            path, client = eng.load_checkpoint(ds, tag="global_step4")
            r["explicit"] = [os.path.relpath(path, ds),
                             self.loaded_matches(eng, client, self.read_expected(base, "global_step4"))]
            # Retention (2 versions) removed global_step2 from nebulite; DeepSpeed's engine then
            # falls back to nebulite's latest checkpoint.
            load_path = block.get("nebula_load_path", block["persistent_storage_path"])
            r["retired_tag_in_nebulite"] = torch_nebula.get_checkpoint(tag="global_step2",
                                                                       persist_path=load_path).tag
            path, client = eng.load_checkpoint(ds, tag="global_step2")
            r["retired"] = [os.path.relpath(path, ds), self.loaded_matches(eng, client, want6)]
            # Training goes on from the loaded state and saves again.
            self.train(eng, STEPS_PER_SAVE)
            eng.save_checkpoint(ds, client_state=client_state(8))
            out[f"z{stage}"] = r
        out["nebula_load_off"] = self.nebula_load_off()
        # ZeRO 1's global_step6, copied out of nebulite by the recipe in docs/deepspeed.md.
        eng = self.engine(self.config(1, None), MODEL_SEED + 1)
        exported = os.path.join(self.workdir, "export", "ds_checkpoints")
        path, client = eng.load_checkpoint(exported)
        out["exported"] = [type(eng.checkpoint_engine).__name__, os.path.relpath(path, exported),
                           self.loaded_matches(eng, client, self.read_expected(os.path.join(self.workdir, "z1"),
                                                                               "global_step6"))]
        return out

    def nebula_load_off(self) -> dict[str, Any]:
        """enable_nebula_load false: the first load reads DeepSpeed's own files with
        torch.load (a checkpoint written without Nebula); later tags load from nebulite."""
        import torch_nebula

        base = os.path.join(self.workdir, "plain")
        ds = os.path.join(base, "ds")
        eng = self.engine(self.config(1, self.nebula_block(base, enable_nebula_load=False)), MODEL_SEED + 1)
        r: dict[str, Any] = {"engine": type(eng.checkpoint_engine).__name__}
        path, client = eng.load_checkpoint(ds)
        r["torch_load"] = [os.path.relpath(path, ds),
                           self.loaded_matches(eng, client, self.read_expected(base, "global_step2"))]
        self.train(eng, STEPS_PER_SAVE)
        want = self.state(eng, client_state(4))
        eng.save_checkpoint(ds, client_state=client_state(4))
        # The embedded engines of several ranks share no memory: a tag is loadable by every
        # rank once persisted (the node agent serves it from memory at once, see `agent`).
        torch_nebula.flush_persistence()
        fresh = self.engine(self.config(1, self.nebula_block(base, enable_nebula_load=False)), MODEL_SEED + 2)
        path, client = fresh.load_checkpoint(ds, tag="global_step2")  # first load: torch.load
        r["fresh_torch_load"] = self.loaded_matches(fresh, client, self.read_expected(base, "global_step2"))
        path, client = fresh.load_checkpoint(ds)  # ds/latest: global_step4, from nebulite
        r["then_nebulite"] = [os.path.relpath(path, ds), self.loaded_matches(fresh, client, want)]
        return r

    def tight_memory(self) -> dict[str, Any]:
        """ZeRO-1 with asynchronous staging, the persistent_time_interval of DeepSpeed's
        documented nebula block (100 s), and a memory tier (set by the environment) that
        holds one of rank 0's checkpoints but not two: every save_checkpoint() goes through
        (a checkpoint that will not fit beside the newest is persisted by both ranks)."""
        import deepspeed
        import torch
        import torch_nebula

        base = os.path.join(self.workdir, "tight")
        torch.manual_seed(MODEL_SEED)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 8))
        config = self.config(1, self.nebula_block(base, persistent_time_interval=100))
        eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                            config=config)
        out: dict[str, Any] = {"raised": []}
        for step in range(8):
            g = torch.Generator().manual_seed(step * 100 + self.rank)
            eng.backward(eng(torch.randn(4, 1024, generator=g)).square().mean())
            eng.step()
            try:
                eng.save_checkpoint(os.path.join(base, "ds"), tag=f"global_step{step}")
            except Exception as e:  # noqa: BLE001 - reported to the test
                out["raised"].append(f"global_step{step}: {type(e).__name__}: {e}")
        out["latest"] = torch_nebula.get_latest_checkpoint().tag  # a barrier too
        torch_nebula.flush_persistence()
        return out

    def agent(self) -> dict[str, Any]:
        import nebulite

        base = os.path.join(self.workdir, "agent")
        ds = os.path.join(base, "ds")
        eng = self.engine(self.config(2, self.nebula_block(base)), MODEL_SEED)
        r: dict[str, Any] = {"engine": type(eng.checkpoint_engine).__name__,
                             "agent_pid": nebulite.session_info()["agent_pid"]}
        wants = {}
        for step in (2, 4):
            self.train(eng, STEPS_PER_SAVE)
            wants[step] = self.state(eng, client_state(step))
            eng.save_checkpoint(ds, client_state=client_state(step))
        # Straight after the save, without waiting for the disk: every rank loads rank 0's
        # model states and its own ZeRO partition from the agent's memory.
        fresh = self.engine(self.config(2, self.nebula_block(base)), MODEL_SEED + 1)
        path, client = fresh.load_checkpoint(ds)
        r["latest"] = [os.path.relpath(path, ds), self.loaded_matches(fresh, client, wants[4])]
        path, client = fresh.load_checkpoint(ds, tag="global_step2")
        r["explicit"] = [os.path.relpath(path, ds), self.loaded_matches(fresh, client, wants[2])]
        r["listed"] = [(e["tag"], e["tier"]) for e in nebulite.list_checkpoints()]
        return r

    def mixed_tags(self) -> dict[str, Any]:
        import nebulite

        base = os.path.join(self.workdir, "mixed")
        ds = os.path.join(base, "ds")
        r: dict[str, Any] = {"agent_pid": None, "errors": {}}
        for validation in ("Warn", "Ignore"):
            config = self.config(1, self.nebula_block(base))
            config["checkpoint"] = {"tag_validation": validation}
            eng = self.engine(config, MODEL_SEED)
            r["agent_pid"] = nebulite.session_info()["agent_pid"]
            self.train(eng, STEPS_PER_SAVE)
            try:
                eng.save_checkpoint(ds, tag=f"{validation}_rank{self.rank}")
                r["errors"][validation] = None
            except nebulite.NebuliteError as e:
                r["errors"][validation] = [type(e).__name__, str(e)]
        eng.save_checkpoint(ds, tag="agreed")
        nebulite.flush_persistence()
        r["listed"] = [e["tag"] for e in nebulite.list_checkpoints(os.path.join(base, "nebula"))]
        return r

    def azure_config(self) -> tuple[str, str]:
        """Azure's documented setup: the nebula block in ds_config.json, DeepSpeed's default
        interval of 100 s, save_dir = persistent_storage_path."""
        base = os.path.join(self.workdir, "azure")
        save_dir = os.path.join(base, "checkpoints")
        config_path = os.path.join(base, "ds_config.json")
        if not os.path.exists(config_path):
            os.makedirs(os.path.join(base, "expected"), exist_ok=True)
            config = self.config(1, {
                "enabled": True,
                "persistent_storage_path": save_dir,
                "persistent_time_interval": 100,
                "num_of_version_in_retention": 2,
                "enable_nebula_load": True,
            })
            with open(config_path, "w") as f:
                json.dump(config, f, indent=2)
        return config_path, save_dir

    def azure_save(self) -> dict[str, Any]:
        import torch

        import nebulite

        config_path, save_dir = self.azure_config()
        model_engine = self.engine(config_path, MODEL_SEED)
        for _ in range(3):
            self.train(model_engine, STEPS_PER_SAVE)
            tag = f"global_step{model_engine.global_steps}"
            torch.save(self.state(model_engine, {}), self.expected_path(os.path.dirname(save_dir), tag))
            model_engine.save_checkpoint(save_dir)
        return {"engine": type(model_engine.checkpoint_engine).__name__,
                "agent_pid": nebulite.session_info()["agent_pid"],
                "listed": [(e["tag"], e["tier"], e["persisted"]) for e in nebulite.list_checkpoints()]}

    def azure_resume(self) -> dict[str, Any]:
        import nebulite

        config_path, save_dir = self.azure_config()
        model_engine = self.engine(config_path, MODEL_SEED + 1)
        path, client = model_engine.load_checkpoint(save_dir)
        want = self.read_expected(os.path.dirname(save_dir), "global_step6")
        return {"agent_pid": nebulite.session_info()["agent_pid"],
                "latest": [os.path.relpath(path, save_dir), self.loaded_matches(model_engine, client, want)],
                "listed": [(e["tag"], e["tier"]) for e in nebulite.list_checkpoints()]}


def main() -> None:
    modes, workdir = sys.argv[1].split(","), sys.argv[2]
    rank, world, port = map(int, sys.argv[3:6])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce kernel into a cache
    # shared by every process of the user (about a minute, and a killed build leaves its lock
    # behind); checkpointing does not depend on it, and gloo does the same job.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    worker = Rank(workdir, rank, world)
    out = {mode: getattr(worker, mode)() for mode in modes}
    out["rank"] = rank
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""Worker for the framework tests of tests/test_gpu.py: one rank on CUDA device LOCAL_RANK.

Usage: gpu_worker.py MODE WORKDIR RANK WORLD PORT

MODE is one of:
  deepspeed  -- for ZeRO stages 1, 2 and 3 (nccl): a DeepSpeed engine whose config has a
                "nebula" block trains 2 steps and saves global_step2, trains 2 more and saves
                global_step4; a fresh engine (other initial weights) loads global_step2, which
                must be bit for bit what the ranks held at that save.
  ddp        -- Lightning on the GPU with DDPStrategy, NebulaCallback and NebulaCheckpointIO:
                trains 4 steps; last.ckpt, loaded through nebulite to the device, holds the
                trained weights.
  lightning_deepspeed
             -- the same with NebulaDeepspeedStrategy (ZeRO 2, a "nebula" block).
Prints one JSON line "RESULT {...}" and exits 0.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepspeed_worker import MODEL_SEED, Rank, client_state, same  # noqa: E402


class GpuRank(Rank):
    def train(self, eng: Any, steps: int) -> None:
        import torch

        for _ in range(steps):
            g = torch.Generator().manual_seed(eng.global_steps * 100 + self.rank)
            x = torch.randn(4, 8, generator=g).to(eng.device)
            loss = eng(x).pow(2).mean()
            eng.backward(loss)
            eng.step()

    def deepspeed(self) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {}
        for stage in (1, 2, 3):
            base = os.path.join(self.workdir, f"z{stage}")
            os.makedirs(os.path.join(base, "expected"), exist_ok=True)
            nebula = self.nebula_block(base)
            eng = self.engine(self.config(stage, nebula), MODEL_SEED)
            r: dict[str, Any] = {"engine": type(eng.checkpoint_engine).__name__,
                                 "device": str(next(eng.module.parameters()).device)}
            for step in (2, 4):
                self.train(eng, 2)
                client = client_state(step)
                torch.save(self.state(eng, client), self.expected_path(base, f"global_step{step}"))
                eng.save_checkpoint(os.path.join(base, "ds"), client_state=client)
            fresh = self.engine(self.config(stage, nebula), MODEL_SEED + 1)
            _, client = fresh.load_checkpoint(os.path.join(base, "ds"), tag="global_step2")
            r["loaded"] = self.loaded_matches(fresh, client, self.read_expected(base, "global_step2"))
            out[f"z{stage}"] = r
        return out


def _lightning(workdir: str, strategy: Any, world: int, plugins: list[Any],
               configure: bool = True) -> dict[str, Any]:
    """Trains with `strategy`; the callback configures nebulite unless the strategy does
    (`configure` False: DeepSpeed's "nebula" block)."""
    import lightning as L
    import torch

    import nebulite as nm
    from lightning_worker import Probe, TinyModule, loader, weights

    store = os.path.join(workdir, "nebula")
    ckpt_dir = os.path.join(workdir, "ckpts")
    config_params = {"persistent_storage_path": store, "persistent_time_interval": 0}
    callback = nm.NebulaCallback(dirpath=ckpt_dir, save_top_k=-1, every_n_train_steps=2, save_last=True,
                                 **({"config_params": config_params} if configure else {}))
    probe = Probe()
    trainer = L.Trainer(accelerator="gpu", devices=world, num_nodes=1, strategy=strategy, max_steps=4,
                        callbacks=[callback, probe], plugins=plugins, enable_progress_bar=False,
                        enable_model_summary=False, logger=False, num_sanity_val_steps=0)
    module = TinyModule()
    trainer.fit(module, loader())
    out: dict[str, Any] = {"rank": trainer.global_rank, "end_weights": probe.seen["end_weights"]}
    if trainer.global_rank == 0:
        latest = nm.get_checkpoint(tag="last.ckpt")
        names = latest.list_names()
        name = "mp_rank_00_model_states.pt" if "mp_rank_00_model_states.pt" in names else "checkpoint"
        state = latest.load(name, map_location=f"cuda:{torch.cuda.current_device()}", weights_only=False)
        module_state = state.get("state_dict") or state.get("module")
        out["loaded_device"] = sorted({str(t.device) for t in module_state.values()})
        # DeepSpeed's keys carry the prefixes of Lightning's wrappers
        end = probe.seen["end_weights"]
        out["loaded_weights"] = {next((e for e in end if k.endswith(e)), k): t.detach().flatten().tolist()
                                 for k, t in module_state.items()}
        out["paths"] = sorted(os.listdir(ckpt_dir))
        out["start_weights"] = weights(TinyModule())  # untrained: differs from what was saved
    return out


def ddp(workdir: str, world: int) -> dict[str, Any]:
    import nebulite as nm

    return _lightning(workdir, "ddp", world, [nm.NebulaCheckpointIO()])


def lightning_deepspeed(workdir: str, world: int) -> dict[str, Any]:
    import nebulite as nm

    store = os.path.join(workdir, "nebula")
    config = {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "train_micro_batch_size_per_gpu": 8,
              "nebula": {"enabled": True, "persistent_storage_path": store,
                         "persistent_time_interval": 0, "num_of_version_in_retention": 0}}
    return _lightning(workdir, nm.NebulaDeepspeedStrategy(config=config), world, [], configure=False)


def main() -> None:
    mode, workdir = sys.argv[1], sys.argv[2]
    rank, world, port = map(int, sys.argv[3:6])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.cuda.set_device(rank)
    if mode == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl")
        out = GpuRank(workdir, rank, world).deepspeed()
    else:
        out = {"ddp": ddp, "lightning_deepspeed": lightning_deepspeed}[mode](workdir, world)
    out["rank"] = rank
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

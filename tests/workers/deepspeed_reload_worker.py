"""Worker for tests/test_deepspeed.py: one rank running the checkpoint scenarios of
DeepSpeed's own test suite (tests/unit/checkpoint) with ZeRO stage 3 and a "nebula" block:
loads that happen in the process that saved, straight after the save, from the memory tier.

Usage: deepspeed_reload_worker.py WORKDIR RANK WORLD PORT NEBULA_JSON

Scenarios (each in its own save folder under WORKDIR):
  reload_optimizer   -- a second engine in the same process loads the tag with its optimizer
                        states (DeepSpeed's test_load_optimizer_state)
  reload_module      -- ... without optimizer states (test_not_load_optimizer_state; DeepSpeed
                        reads the save_dir files itself through zero_to_fp32)
  reload_module_only -- ... with load_module_only (test_load_module_only)
  immediate_load     -- the saving engine loads right after save_checkpoint() (test_immediate_save_load)
  load_then_save     -- a second engine loads, then saves at once (test_load_immediate_save)
Each records whether the loading engine's fp32 partitions equal the saving engine's, bit for
bit (they are restored with the optimizer states; without them DeepSpeed rebuilds them from
the module it loads); whether DeepSpeed's zero_to_fp32 on the tag's save_dir gives the
saving engine's whole fp32 model, bit for bit; which files in the save_dir are still
placeholders; and which files differ from the objects nebulite loads for them.
Prints "RESULT {...}" and exits 0.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

SCENARIOS = ("reload_optimizer", "reload_module", "reload_module_only", "immediate_load", "load_then_save")


def main() -> None:
    workdir, rank, world, port, nebula = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import deepspeed
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from deepspeed_worker import same

    deepspeed.init_distributed(dist_backend="gloo")
    config: dict[str, Any] = {
        "train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": True}},
        "zero_optimization": {"stage": 3}, "nebula": json.loads(nebula),
    }

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(10, 10)
            self.loss = torch.nn.CrossEntropyLoss()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.loss(self.linear(x), y)

    def engine(seed: int) -> Any:
        torch.manual_seed(seed)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Model()
        eng, _, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
        return eng

    def train(eng: Any) -> None:
        for step in range(4):
            g = torch.Generator().manual_seed(step * 10 + rank)
            loss = eng(torch.randn(2, 10, generator=g), torch.randint(0, 10, (2,), generator=g))
            eng.backward(loss)
            eng.step()
        eng.empty_partition_cache()

    def partitions(eng: Any) -> list[torch.Tensor]:
        return [p.detach().clone() for p in eng.optimizer.fp32_partitioned_groups_flat]

    def whole_fp32(eng: Any, flats: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The whole fp32 parameters, by name, from every rank's fp32 partitions `flats`
        (ZeRO 3 partitions each parameter across the ranks, padded)."""
        per_rank = [torch.cat(f) for f in flats]
        out, offset = {}, 0
        for name, p in eng.module.named_parameters():
            n = p.ds_tensor.numel()
            out[name] = torch.cat([f[offset:offset + n] for f in per_rank])[:p.ds_numel].view(p.ds_shape)
            offset += n
        return out

    def placeholders(folder: str) -> list[str]:
        return sorted(f for f in os.listdir(folder)
                      if isinstance(torch.load(os.path.join(folder, f), weights_only=False), str))

    def files_differ(folder: str) -> list[str]:
        """The files of `folder` that differ from the objects nebulite loads for them (those
        this rank can load: without a store or an agent, its own)."""
        import torch_nebula

        checkpoint = torch_nebula.get_checkpoint(tag="1")
        out = []
        for name in sorted(os.listdir(folder)):
            try:
                want = checkpoint.load(name, weights_only=False)
            except torch_nebula.NotFoundError:
                continue
            if diff := same(want, torch.load(os.path.join(folder, name), weights_only=False)):
                out.append(f"{name}: {diff}")
        return out

    result: dict[str, Any] = {}
    for scenario in SCENARIOS:
        folder = os.path.join(workdir, scenario)
        saver = engine(0)
        train(saver)
        saved = partitions(saver)
        every_rank: list[Any] = [None] * world
        torch.distributed.all_gather_object(every_rank, saved)
        saved_whole = whole_fp32(saver, every_rank)
        saver.save_checkpoint(folder, tag="1")
        if scenario == "immediate_load":
            saver.load_checkpoint(folder, tag="1")
            loaded = partitions(saver)
        else:
            loader = engine(1)
            loader.load_checkpoint(folder, tag="1",
                                   load_optimizer_states=scenario in ("reload_optimizer", "load_then_save"),
                                   load_module_only=scenario == "reload_module_only")
            loaded = partitions(loader)
            if scenario == "load_then_save":
                loader.save_checkpoint(folder, tag="2")
        deepspeed.comm.barrier()
        tag_dir = os.path.join(folder, "1")
        result[scenario] = {
            "same_fp32": same(saved, loaded) or "ok",
            "zero_to_fp32": same(saved_whole, dict(get_fp32_state_dict_from_zero_checkpoint(folder, "1"))) or "ok",
            "placeholders": placeholders(tag_dir),
            "files_differ": files_differ(tag_dir),
        }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

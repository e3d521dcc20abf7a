"""Worker for tests/test_lightning.py: a tiny Lightning model, and runs that need a process
of their own.

Usage: lightning_worker.py MODE OUT_JSON STORE CKPT_DIR MAX_STEPS [CKPT_PATH]

Modes:
  ddp       -- one rank of a 2-process DDP run (gloo), launched by the test with the
               environment variables Lightning reads (LOCAL_RANK, NODE_RANK, WORLD_SIZE,
               MASTER_ADDR, MASTER_PORT), with NebulaCallback and NebulaCheckpointIO.
  deepspeed -- one rank of a NebulaDeepspeedStrategy run (ZeRO stage from $ZERO_STAGE)
               on the CPU, same launch.
  standalone -- one process with the standalone `pytorch_lightning` package only.
  ddp_spawn -- a script that calls nebulite.init() and trains with strategy="ddp_spawn"
               (2 processes, gloo); $NEBULITE_IO_PLUGIN=0 leaves installing
               NebulaCheckpointIO to the callback. After fit, the main process loads what
               the workers saved and writes OUT_JSON.rank0.
Each rank writes OUT_JSON with suffix .rank<R>: the global step and weights when training
started (after any resume) and when it ended, and the paths the callback recorded.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__" and sys.argv[1] == "standalone":
    import pytorch_lightning as L  # the standalone package, and not `lightning`
else:
    import lightning as L


class TinyModule(L.LightningModule):
    """A linear regression with momentum SGD (so that optimizer state matters on resume)."""

    def __init__(self, lr: float = 0.05, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def loader(batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.25
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def weights(module: torch.nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().flatten().tolist() for k, v in module.state_dict().items()}


class Probe(L.Callback):
    """Records the step and weights when training starts (after any resume) and ends."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.seen["start_step"] = trainer.global_step
        self.seen["start_weights"] = weights(pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.seen["end_step"] = trainer.global_step
        self.seen["end_weights"] = weights(pl_module)


def _trainer_kwargs() -> dict[str, Any]:
    return dict(enable_progress_bar=False, enable_model_summary=False, logger=False, num_sanity_val_steps=0)


def run_ddp(out: str, store: str, ckpt_dir: str, max_steps: int, ckpt_path: str | None) -> None:
    import nebulite as nm

    callback = nm.NebulaCallback(
        dirpath=ckpt_dir, save_top_k=-1, every_n_train_steps=2, save_last=True,
        config_params={"persistent_storage_path": store, "persistent_time_interval": 0},
    )
    probe = Probe()
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp", max_steps=max_steps,
                        callbacks=[callback, probe], plugins=[nm.NebulaCheckpointIO()], **_trainer_kwargs())
    trainer.fit(TinyModule(), loader(), ckpt_path=ckpt_path)
    _write(out, trainer, probe, callback, session=nm.session_info())


def _cpu_deepspeed_strategy(config: dict[str, Any]) -> Any:
    import nebulite as nm
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy

    class CPUNebulaDeepspeedStrategy(nm.NebulaDeepspeedStrategy):
        """NebulaDeepspeedStrategy on the CPU. Lightning's DeepSpeedStrategy refuses any
        accelerator but CUDA and checks device indices against local ranks; DeepSpeed itself
        runs on its CPU accelerator with gloo. Only those two checks are lifted."""

        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        @property
        def root_device(self) -> torch.device:
            return torch.device("cpu", self.local_rank)  # DeepSpeed wants a device index

    return CPUNebulaDeepspeedStrategy(config=config, process_group_backend="gloo")


def run_deepspeed(out: str, store: str, ckpt_dir: str, max_steps: int, ckpt_path: str | None) -> None:
    import nebulite as nm

    config = {
        "zero_optimization": {"stage": int(os.environ.get("ZERO_STAGE", "0"))},
        "zero_allow_untested_optimizer": True,
        "train_micro_batch_size_per_gpu": 8,
        "nebula": {"persistent_storage_path": store, "persistent_time_interval": 0,
                   "num_of_version_in_retention": 0},
    }
    callback = nm.NebulaCallback(dirpath=ckpt_dir, save_top_k=-1, every_n_train_steps=2, save_last=True)
    probe = Probe()
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=_cpu_deepspeed_strategy(config),
                        max_steps=max_steps, callbacks=[callback, probe], **_trainer_kwargs())
    trainer.fit(TinyModule(), loader(), ckpt_path=ckpt_path)
    _write(out, trainer, probe, callback, session=nm.session_info())


def run_standalone(out: str, store: str, ckpt_dir: str, max_steps: int, ckpt_path: str | None) -> None:
    import nebulite as nm

    assert "lightning" not in sys.modules
    callback = nm.NebulaCallback(dirpath=ckpt_dir, save_last=True, every_n_train_steps=2,
                                 config_params={"persistent_storage_path": store})
    assert type(callback).__module__ == "nebulite.integrations.pytorch_lightning"
    probe = Probe()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[callback, probe],
                        plugins=[nm.NebulaCheckpointIO()], **_trainer_kwargs())
    trainer.fit(TinyModule(), loader(), ckpt_path=ckpt_path)
    _write(out, trainer, probe, callback, session=nm.session_info())


def run_ddp_spawn(out: str, store: str, ckpt_dir: str, max_steps: int, ckpt_path: str | None) -> None:
    import nebulite as nm

    nm.init(persistent_storage_path=store, persistent_time_interval=0, num_of_version_in_retention=0)
    callback = nm.NebulaCallback(dirpath=ckpt_dir, save_top_k=-1, every_n_train_steps=2, save_last=True)
    plugins = [nm.NebulaCheckpointIO()] if os.environ.get("NEBULITE_IO_PLUGIN", "1") == "1" else []
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp_spawn", max_steps=max_steps,
                        callbacks=[callback], plugins=plugins, **_trainer_kwargs())
    module = TinyModule()
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    # Lightning copies the trained weights and the best model's path back to this process.
    latest = nm.get_latest_checkpoint()
    last = os.path.join(ckpt_dir, "last.ckpt")
    loaded = TinyModule.load_from_checkpoint(last, map_location="cpu")
    result = dict(rank=0, best_model_path=callback.best_model_path,
                  best_step=torch.load(callback.best_model_path, weights_only=True)["global_step"],
                  end_weights=weights(module), loaded_weights=weights(loaded), latest_tag=latest.tag,
                  latest_step=latest.load("checkpoint")["global_step"] if latest.tag else None,
                  session_agent=nm.session_info().get("agent_pid") is not None)
    with open(f"{out}.rank0", "w") as f:
        json.dump(result, f)


def _write(out: str, trainer: Any, probe: Probe, callback: Any, session: dict[str, Any]) -> None:
    result = dict(probe.seen, rank=trainer.global_rank, world_size=trainer.world_size,
                  last_model_path=callback.last_model_path, best_k_models=sorted(callback.best_k_models),
                  session_world_size=session["world_size"], session_rank=session["rank"])
    with open(f"{out}.rank{trainer.global_rank}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    mode, out, store, ckpt_dir, steps = sys.argv[1:6]
    resume = sys.argv[6] if len(sys.argv) > 6 else None
    {"ddp": run_ddp, "deepspeed": run_deepspeed, "standalone": run_standalone,
     "ddp_spawn": run_ddp_spawn}[mode](
        out, store, ckpt_dir, int(steps), resume)

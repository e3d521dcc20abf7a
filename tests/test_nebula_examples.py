"""Azure's documented Nebula examples ("Boost checkpoint speed and reduce cost with Nebula")
run with only the import changed, or unchanged through `nebulaml` / `torch_nebula`.

Each test keeps the documentation's lines as they are (see docs/nebula-examples.md); only
the placeholders (`<YOUR STORAGE PATH>`, `<CKPT_NAME>`, "Original ModelCheckpoint params")
are filled in, with paths under the test's temporary directory. The DeepSpeed example
(`"nebula"` in ds_config.json) is covered with the DeepSpeed integration.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning import Trainer

import nebulite
import nebulite.api

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from lightning_worker import Probe, TinyModule, loader, weights  # noqa: E402

MODULES = ["nebulite", "nebulaml", "torch_nebula"]


class MyLightningModule(TinyModule):
    def train_dataloader(self) -> Any:
        return loader()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 2)


def _quiet(**kw: Any) -> dict[str, Any]:
    """Trainer arguments of the test itself, not of the examples."""
    return dict(accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                logger=False, num_sanity_val_steps=0, **kw)


def _is_nebulite_file(path: str) -> bool:
    version_dir = Path(os.path.realpath(path)).parent.parent
    return (version_dir / "COMMITTED").is_file() and "state_dict" in torch.load(path, weights_only=True)


@pytest.mark.parametrize("module", MODULES)
def test_plain_pytorch(module, tmp_path, monkeypatch):
    nm = importlib.import_module(module)  # import nebulaml as nm
    model = Net()

    # Whole nn.Module objects (the example saves `model`) need full unpickling to load. The
    # example runs unchanged with torch's own switch for scripts written before torch.load
    # became weights-only by default; without it, load() says what to do.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")

    # --- the documentation's code ---
    persistent_storage_path = str(tmp_path / "test"),
    nm.init(persistent_storage_path, persistent_time_interval=2)

    checkpoint = nm.Checkpoint('global_step500')
    checkpoint.save('checkpoint', model)

    latest_ckpt = nm.get_latest_checkpoint()
    p0 = latest_ckpt.load('checkpoint')

    ckpts = nm.list_checkpoints()
    persisted_storage_path = str(tmp_path / "test")
    latest_ckpt_path = nm.get_latest_checkpoint_path("checkpoint", persisted_storage_path)
    # --- end ---

    assert isinstance(p0, Net) and torch.equal(p0.fc.weight, model.fc.weight)
    assert [c["tag"] for c in ckpts] == ["global_step500"]
    assert isinstance(torch.load(latest_ckpt_path, weights_only=False), Net)
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        latest_ckpt.load('checkpoint')
    assert isinstance(latest_ckpt.load('checkpoint', weights_only=False), Net)


def _conditional_saving(nm: Any, storage: str, tmp_path: Path) -> Any:
    # --- the documentation's code ---
    config_params = dict()
    config_params["persistent_storage_path"] = storage
    config_params["persistent_time_interval"] = 10

    nebula_checkpoint_callback = nm.NebulaCallback(
        dirpath=str(tmp_path / "ckpts"), monitor="val_loss", save_top_k=2, save_last=True,
        every_n_train_steps=2,  # Original ModelCheckpoint params
        config_params=config_params,  # customize the config of init nebula
    )
    trainer = Trainer(plugins=[nm.NebulaCheckpointIO()],   # add NebulaCheckpointIO as a plugin
                      callbacks=[nebula_checkpoint_callback],  # use NebulaCallback as a plugin
                      **_quiet(max_steps=8, val_check_interval=2, limit_val_batches=1))
    # --- end ---
    trainer.fit(MyLightningModule(), loader(), loader())
    return nebula_checkpoint_callback


@pytest.mark.parametrize("module", MODULES)
def test_lightning_conditional_saving(module, tmp_path):
    nm = importlib.import_module(module)
    storage = str(tmp_path / "storage")
    callback = _conditional_saving(nm, storage, tmp_path)
    kept = list(callback.best_k_models) + [callback.last_model_path]
    assert len(kept) == 3
    for path in kept:
        assert os.path.realpath(path).startswith(storage + os.sep) and _is_nebulite_file(path)
    assert isinstance(callback, nebulite.NebulaCallback)


@pytest.mark.parametrize("module", MODULES)
def test_lightning_manual_saving_then_loading(module, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nm = importlib.import_module(module)
    storage = str(tmp_path / "storage")
    tier3 = str(tmp_path / "tier3" / "checkpoint")

    # --- the documentation's code: saving ---
    nm.init(persistent_storage_path=storage)

    trainer = Trainer(plugins=[nm.NebulaCheckpointIO()], **_quiet(max_steps=4))  # add NebulaCheckpointIO as a plugin
    trained = MyLightningModule()
    trainer.fit(trained, loader())

    storage_options = {}
    storage_options['is_best'] = True
    storage_options['persist_path'] = tier3

    trainer.save_checkpoint("example.ckpt",
      storage_options=storage_options,  # customize the config of Nebula saving checkpoint
    )
    # --- end ---

    # The loading examples, in a fresh process as far as nebulite is concerned (the old
    # session drains its persistence first).
    nebulite.api._reset_for_tests()
    assert _is_nebulite_file("example.ckpt")
    callback = _conditional_saving(nm, tier3, tmp_path / "conditional")
    nebula_checkpoint_callback = callback
    NebulaCheckpointIO = getattr(importlib.import_module(module), "NebulaCheckpointIO")  # from nebulaml import ...
    tmpdir = str(tmp_path / "resumed")

    # --- the documentation's code: loading ---
    persist_path = tier3
    latest_ckpt_path = nm.get_latest_checkpoint_path("checkpoint", persist_path)
    model = MyLightningModule.load_from_checkpoint(latest_ckpt_path)

    trainer = Trainer(
        default_root_dir=tmpdir,
        max_steps=100,
        plugins=[NebulaCheckpointIO()],
        callbacks=[nebula_checkpoint_callback],
        **_quiet(),
    )
    trainer.callbacks.append(probe := Probe())  # the test's own instrument
    trainer.fit(model, ckpt_path=str(tmp_path / "example.ckpt"))
    # --- end ---
    assert probe.seen["start_step"] == 4  # resumed from what the manual save holds
    assert probe.seen["start_weights"] == weights(trained)

    # Conditional saving wrote newer checkpoints to the same path since: get the one the
    # manual save committed, by its name.
    example = nebulite.get_checkpoint(tag="example.ckpt", persist_path=tier3).load("checkpoint")
    assert example["global_step"] == 4
    assert trainer.global_step == 100

"""Lightning through nebulite: NebulaCheckpointIO, NebulaCallback and NebulaDeepspeedStrategy
with a real Trainer on the CPU (see docs/lightning.md).

Each test proves nebulite did the saving: the paths Lightning records are links to
committed nebulite data files (a COMMITTED marker, the nebulite index record, a row in the
history), never files written by torch.save.
"""

from __future__ import annotations

import glob
import inspect
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import typing
import warnings
import zipfile
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Optional

import lightning as L
import pytest
import torch

import nebulite
import nebulite.api
from nebulite import _core
from nebulite.integrations.lightning import NebulaCallback, NebulaCheckpointIO

WORKER = os.path.join(os.path.dirname(__file__), "workers", "lightning_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
from conftest import HANG_TIMEOUT, JOB_TIMEOUT, wait_ranks  # noqa: E402
from lightning_worker import Probe, TinyModule, loader, weights  # noqa: E402

TIMEOUT = HANG_TIMEOUT  # bounds a hang; a busy machine may take long


class Opaque:
    """A hyperparameter of a type weights-only loading does not allow."""

    def __init__(self, value: int) -> None:
        self.value = value


def _trainer(root: Path, max_steps: int, callbacks: list[Any] = (), plugins: list[Any] = (), **kw: Any) -> L.Trainer:
    kw.setdefault("enable_checkpointing", any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks))
    return L.Trainer(default_root_dir=str(root), max_steps=max_steps, accelerator="cpu", devices=1,
                     callbacks=list(callbacks), plugins=list(plugins), enable_progress_bar=False,
                     enable_model_summary=False, logger=False, num_sanity_val_steps=0, **kw)


def _callback(ckpt_dir: Path, store: str, interval: float = 0, **kw: Any) -> NebulaCallback:
    kw.setdefault("every_n_train_steps", 2)
    kw.setdefault("save_last", True)
    config_params = {"persistent_storage_path": store, "persistent_time_interval": interval}
    return NebulaCallback(dirpath=str(ckpt_dir), config_params=config_params, **kw)


def _committed(store: str) -> list[tuple[str, str]]:
    return [(e["tag"], e["version"]) for e in _core.read_catalog(store)[0]]


def _assert_nebulite_file(path: str, store: str) -> tuple[str, str]:
    """`path` (what Lightning recorded) links to a committed nebulite data file of `store`
    that torch.load reads; returns its (tag, version)."""
    assert os.path.islink(path), f"{path} is not nebulite's link"
    target = os.path.realpath(path)
    assert target.startswith(os.path.realpath(store) + os.sep), target
    version_dir = Path(target).parent.parent
    assert (version_dir / "COMMITTED").is_file()
    with zipfile.ZipFile(target) as z:
        assert "archive/.nebulite/index.json" in z.namelist()  # written by nebulite, not torch.save
        index = json.loads(z.read("archive/.nebulite/index.json"))
    assert index["tag"] == os.path.basename(path) and index["name"] == "checkpoint"
    assert "state_dict" in torch.load(path, weights_only=True)
    return version_dir.parent.name, version_dir.name


def _history(store: str) -> list[str]:
    with open(os.path.join(store, "checkpointHistories.csv")) as f:
        return f.read().splitlines()


# -- fit with the callback --------------------------------------------------------------


@pytest.mark.parametrize("async_staging", [False, True], ids=["copied_at_save", "async_staging"])
def test_callback_saves_through_nebulite_and_keeps_what_modelcheckpoint_keeps(tmp_path, store, monkeypatch,
                                                                              async_staging):
    """Every path names the version its latest save wrote, with asynchronous staging too
    (where the commit waits for the next optimizer step, or for the end of training)."""
    monkeypatch.setenv("NEBULITE_ASYNC_STAGING", "1" if async_staging else "0")
    ckpt_dir = tmp_path / "ckpts"
    callback = _callback(ckpt_dir, store, monitor="val_loss", save_top_k=2)
    trainer = _trainer(tmp_path, 8, [callback], [NebulaCheckpointIO()], val_check_interval=2, limit_val_batches=1)
    module = TinyModule()
    trainer.fit(module, loader(), loader())
    assert nebulite.api._config().async_staging is async_staging

    kept = sorted(callback.best_k_models) + [callback.last_model_path]
    assert len(kept) == 3 and callback.best_model_path in kept
    assert sorted(str(p) for p in ckpt_dir.iterdir()) == sorted(kept)  # removed paths are gone
    versions = {_assert_nebulite_file(p, store) for p in kept}
    # The store holds exactly what the paths name: superseded and removed versions were deleted.
    assert sorted(_committed(store)) == sorted(versions)
    rows = _history(store)
    for tag, version in versions:
        assert any(f",{tag}," in r and version in r and "committed" in r for r in rows), tag
    last = torch.load(callback.last_model_path, weights_only=True)  # saved after the last step
    assert last["global_step"] == 8
    for name, t in module.state_dict().items():
        assert torch.equal(last["state_dict"][name], t), name
    best = torch.load(callback.best_model_path, weights_only=True)
    assert best["callbacks"]  # the callback's own state travels in the checkpoint
    assert torch.equal(best["state_dict"]["layer.weight"],
                       nebulite.get_checkpoint(tag=os.path.basename(callback.best_model_path))
                       .load("checkpoint")["state_dict"]["layer.weight"])


def _newest_in_memory(tag: str) -> dict[str, Any]:
    return max((v for v in nebulite.api._session.engine.versions() if v["tag"] == tag), key=lambda v: v["seq"])


def test_callback_installs_the_checkpoint_io_and_saves_the_best_at_once(tmp_path, store):
    """Without plugins=[NebulaCheckpointIO()] the callback installs it. With a long interval
    the newest save may stay in memory, but the best is persisted at once (is_best), and
    teardown persists whatever Lightning's paths still name."""
    ckpt_dir = tmp_path / "ckpts"
    callback = _callback(ckpt_dir, store, interval=3600, monitor="val_loss", save_top_k=1)
    seen: dict[str, Any] = {}

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 6:  # after the saves of steps 2 and 4
                seen["last_requested"] = _newest_in_memory("last.ckpt")["persist_requested"]
                nebulite.api._session.engine.flush(60)  # what was asked for is now in the store
                seen["best_on_disk"] = os.path.exists(callback.best_model_path)

    trainer = _trainer(tmp_path, 8, [callback, Spy()], val_check_interval=2, limit_val_batches=1)
    trainer.fit(TinyModule(), loader(), loader())
    assert isinstance(trainer.strategy.checkpoint_io, NebulaCheckpointIO)
    assert seen == {"last_requested": False, "best_on_disk": True}
    for path in (callback.best_model_path, callback.last_model_path):
        _assert_nebulite_file(path, store)  # teardown persisted the rest


def test_an_interval_spares_only_what_no_other_path_needs(tmp_path, store):
    """Without a monitor ModelCheckpoint's "best" is just the newest save (not is_best). A
    checkpoint stays in memory only while its path is the one saved last: saving another
    path persists it first, since the memory tier keeps only the newest unpersisted one."""
    ckpt_dir = tmp_path / "ckpts"
    callback = _callback(ckpt_dir, store, interval=3600, save_top_k=-1)
    seen: dict[str, Any] = {}

    class Spy(L.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 6:  # saved: steps 2, 4, 6, each followed by last.ckpt
                seen["last_requested"] = _newest_in_memory("last.ckpt")["persist_requested"]
                nebulite.api._session.engine.flush(60)
                seen["on_disk"] = sorted(p.name for p in ckpt_dir.iterdir() if p.exists())
                seen["last_step"] = torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"]

    _trainer(tmp_path, 8, [callback, Spy()]).fit(TinyModule(), loader())
    assert seen["last_requested"] is False  # the newest last.ckpt waits for the interval
    assert seen["on_disk"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    assert seen["last_step"] in (2, 4)  # last.ckpt names its previous, persisted checkpoint meanwhile
    for name in ("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt"):
        _assert_nebulite_file(str(ckpt_dir / name), store)
    _assert_nebulite_file(str(ckpt_dir / "last.ckpt"), store)
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"] == 8  # moved at teardown


def test_resume_from_last_restores_everything(tmp_path, store):
    ckpt_dir = tmp_path / "ckpts"
    first = Probe()
    _trainer(tmp_path, 4, [_callback(ckpt_dir, store), first], [NebulaCheckpointIO()]).fit(TinyModule(), loader())
    _assert_nebulite_file(str(ckpt_dir / "last.ckpt"), store)

    nebulite.api._reset_for_tests()  # a new process, as far as nebulite is concerned
    resumed = Probe()
    trainer = _trainer(tmp_path, 6, [_callback(ckpt_dir, store), resumed], [NebulaCheckpointIO()])
    trainer.fit(TinyModule(), loader(), ckpt_path="last")
    assert resumed.seen["start_step"] == 4
    assert resumed.seen["start_weights"] == first.seen["end_weights"]  # bit-identical

    straight = Probe()
    _trainer(tmp_path / "straight", 6, [straight]).fit(TinyModule(), loader())
    # Optimizer state (momentum) and loop state resumed too: same weights as a run without a break.
    assert resumed.seen["end_weights"] == straight.seen["end_weights"]


def test_resume_from_an_older_checkpoint_path(tmp_path, store):
    ckpt_dir = tmp_path / "ckpts"
    callback = _callback(ckpt_dir, store, save_top_k=-1)
    _trainer(tmp_path, 6, [callback], [NebulaCheckpointIO()]).fit(TinyModule(), loader())
    step2 = ckpt_dir / "epoch=0-step=2.ckpt"
    saved = torch.load(step2, weights_only=True)
    assert saved["global_step"] == 2
    probe = Probe()
    _trainer(tmp_path, 8, [_callback(ckpt_dir, store, save_top_k=-1), probe], [NebulaCheckpointIO()]).fit(
        TinyModule(), loader(), ckpt_path=str(step2))
    assert probe.seen["start_step"] == 2
    assert probe.seen["start_weights"] == {k: v.flatten().tolist() for k, v in saved["state_dict"].items()}


def test_with_the_node_agent(tmp_path, store, agent_env, monkeypatch):
    monkeypatch.setenv("NEBULITE_AGENT", "1")  # init()'s default, which the test suite turns off
    ckpt_dir = tmp_path / "ckpts"
    first = Probe()
    _trainer(tmp_path, 4, [_callback(ckpt_dir, store), first], [NebulaCheckpointIO()]).fit(TinyModule(), loader())
    assert nebulite.session_info()["agent_pid"] not in (None, os.getpid())
    _assert_nebulite_file(str(ckpt_dir / "last.ckpt"), store)
    resumed = Probe()
    _trainer(tmp_path, 6, [_callback(ckpt_dir, store), resumed], [NebulaCheckpointIO()]).fit(
        TinyModule(), loader(), ckpt_path="last")
    assert resumed.seen["start_step"] == 4 and resumed.seen["start_weights"] == first.seen["end_weights"]
    assert nebulite.session_info()["agent_pid"] not in (None, os.getpid())


def test_callback_signature_is_modelcheckpoint_s_plus_config_params():
    stock = inspect.signature(L.pytorch.callbacks.ModelCheckpoint)
    ours = inspect.signature(NebulaCallback)
    expected = list(stock.parameters.values()) + [
        inspect.Parameter("config_params", inspect.Parameter.KEYWORD_ONLY, default=None,
                          annotation=Optional[Mapping[str, Any]])]
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
        (p.name, p.kind, p.default) for p in expected]
    hints = typing.get_type_hints(NebulaCallback.__init__)
    stock_hints = typing.get_type_hints(L.pytorch.callbacks.ModelCheckpoint.__init__)
    assert {k: hints[k] for k in stock.parameters} == {k: stock_hints[k] for k in stock.parameters}
    assert hints["config_params"] == Optional[Mapping[str, Any]]
    # Positional arguments land where ModelCheckpoint puts them.
    callback = NebulaCallback("some/dir", "{epoch}", "val_loss", config_params={"a": 1})
    assert (callback.dirpath, callback.filename, callback.monitor) == (
        os.path.realpath("some/dir"), "{epoch}", "val_loss")
    assert callback.config_params == {"a": 1}


@pytest.mark.parametrize("first_nebulite", [False, True], ids=["from_modelcheckpoint", "to_modelcheckpoint"])
def test_a_run_resumes_with_the_other_callback_keeping_its_best_models(tmp_path, store, first_nebulite):
    """A job saved with ModelCheckpoint resumes under NebulaCallback (and back) with its
    best-model tracking: the callback's state is under ModelCheckpoint's state key."""
    ckpt_dir = tmp_path / "ckpts"
    params = dict(dirpath=str(ckpt_dir), monitor="val_loss", save_top_k=-1, every_n_train_steps=2,
                  save_last=True)

    def make(nebulite_one: bool) -> Any:
        if nebulite_one:
            return NebulaCallback(**params, config_params={"persistent_storage_path": store,
                                                           "persistent_time_interval": 0})
        return L.pytorch.callbacks.ModelCheckpoint(**params)

    def plugins(nebulite_one: bool) -> list[Any]:
        return [NebulaCheckpointIO()] if nebulite_one else []

    first = make(first_nebulite)
    _trainer(tmp_path, 4, [first], plugins(first_nebulite), val_check_interval=2,
             limit_val_batches=1).fit(TinyModule(), loader(), loader())
    assert len(first.best_k_models) == 2
    assert first.state_key == L.pytorch.callbacks.ModelCheckpoint(**params).state_key

    seen: dict[str, Any] = {}

    class Restored(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            seen["best_k_models"] = dict(second.best_k_models)
            seen["best_model_path"] = second.best_model_path

    nebulite.api._reset_for_tests()
    second = make(not first_nebulite)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*callbacks used to create the checkpoint.*")
        _trainer(tmp_path, 6, [second, Restored()], plugins(not first_nebulite), val_check_interval=2,
                 limit_val_batches=1).fit(TinyModule(), loader(), loader(), ckpt_path="last")
    assert seen["best_model_path"] == first.best_model_path
    assert {k: float(v) for k, v in seen["best_k_models"].items()} == {
        k: float(v) for k, v in first.best_k_models.items()}


@pytest.mark.parametrize("with_callback", [True, False], ids=["nebula_callback", "model_checkpoint"])
def test_async_checkpoint_io_around_nebulite_is_refused_clearly(tmp_path, store, with_callback):
    """AsyncCheckpointIO would save on its own thread and remove on the training thread,
    and never pass teardown on: refused with an error that says what to do instead."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    nebulite.init(persistent_storage_path=store, persistent_time_interval=0)
    callback = (_callback(tmp_path / "ckpts", store) if with_callback
                else L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2))
    trainer = _trainer(tmp_path, 4, [callback], [AsyncCheckpointIO(NebulaCheckpointIO())])
    with pytest.raises(nebulite.InvalidArgumentError, match="AsyncCheckpointIO.*plugins=\\[NebulaCheckpointIO"):
        trainer.fit(TinyModule(), loader())
    assert list((tmp_path / "ckpts").glob("*.ckpt")) == []  # no link to anything uncommitted
    assert _nebulite_threads() == []


@pytest.mark.parametrize("url", ["memory://x"])
@pytest.mark.parametrize("how", ["callback", "io"])
def test_a_url_checkpoint_directory_is_refused(tmp_path, store, url, how, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if how == "callback":
        trainer = _trainer(tmp_path, 2, [NebulaCallback(dirpath=url, every_n_train_steps=1,
                                                        config_params={"persistent_storage_path": store})])
    else:
        nebulite.init(persistent_storage_path=store)
        trainer = _trainer(tmp_path, 2, [L.pytorch.callbacks.ModelCheckpoint(dirpath=url, every_n_train_steps=1)],
                           [NebulaCheckpointIO()])
    with pytest.raises(nebulite.InvalidArgumentError, match="does not know the scheme .memory."):
        trainer.fit(TinyModule(), loader())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("memory:")) == []


def test_a_url_checkpoint_directory_with_deepspeed_is_refused(tmp_path, store, monkeypatch):
    """DeepSpeed writes the checkpoint directory itself, with the local file system: a URL
    dirpath is refused (the store goes in as the persistent path) instead of becoming local
    directories named "s3:"."""
    from nebulite.integrations.lightning import NebulaDeepspeedStrategy

    monkeypatch.chdir(tmp_path)
    url = "s3://bucket/run/ckpts"
    strategy = NebulaDeepspeedStrategy(config={"train_micro_batch_size_per_gpu": 1})
    with pytest.raises(nebulite.InvalidArgumentError, match="DeepSpeed writes .* local dirpath"):
        strategy.save_checkpoint({}, f"{url}/epoch=0-step=1.ckpt")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    callback = NebulaCallback(dirpath=url, config_params={"persistent_storage_path": store})
    with pytest.raises(nebulite.InvalidArgumentError, match="persistent storage path"):
        callback.setup(trainer, TinyModule(), "fit")
    assert list(tmp_path.iterdir()) == []


def _nebulite_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("nebulite"))


def test_no_thread_outlives_the_work(tmp_path, store, agent_env, monkeypatch):
    """As Lightning's own "no leftover threads" test fixture checks: once fit has returned
    (nothing pending), and after shutdown, no Python thread of nebulite runs, with the node
    agent and with asynchronous staging; a second persistent path starts none either."""
    monkeypatch.setenv("NEBULITE_AGENT", "1")
    before = set(threading.enumerate())
    for i in range(2):
        callback = NebulaCallback(dirpath=str(tmp_path / f"ckpts{i}"), every_n_train_steps=2,
                                  config_params={"persistent_storage_path": f"{store}{i}",
                                                 "async_staging": True})
        _trainer(tmp_path, 4, [callback], [NebulaCheckpointIO()]).fit(TinyModule(), loader())
        assert nebulite.session_info()["agent_pid"] not in (None, os.getpid())
        _assert_nebulite_file(str(tmp_path / f"ckpts{i}" / "epoch=0-step=4.ckpt"), f"{store}{i}")
        assert _nebulite_threads() == []
    nebulite.shutdown()
    assert set(threading.enumerate()) <= before


class _PathReader(threading.Thread):
    """Reads, over and over while training saves, every path Lightning records for
    `callback` (``best_model_path``, ``last_model_path``, the files in its dirpath), as a
    reader that is not nebulite would (an eval job, a copy to another machine): a path that
    can be opened must hold a whole checkpoint."""

    def __init__(self, callback: NebulaCallback, ckpt_dir: Path) -> None:
        super().__init__(name="path-reader")
        self.callback, self.ckpt_dir = callback, ckpt_dir
        self.stop = threading.Event()
        self.loaded: set[str] = set()
        self.failures: list[str] = []

    def _paths(self) -> list[str]:
        recorded = [self.callback.best_model_path, self.callback.last_model_path]
        listed = [str(self.ckpt_dir / n) for n in os.listdir(self.ckpt_dir)] if self.ckpt_dir.is_dir() else []
        return [p for p in recorded + listed if p]

    def run(self) -> None:
        while not self.stop.is_set() or not self.loaded:
            for path in self._paths():
                try:
                    f = open(path, "rb")  # what exists now; removal after this cannot tear it
                except (FileNotFoundError, IsADirectoryError):
                    continue
                with f:
                    try:
                        step = torch.load(f, weights_only=True)["global_step"]
                    except Exception as e:  # noqa: BLE001 - every failure is reported
                        self.failures.append(f"{path} ({os.path.realpath(path)}): {type(e).__name__}: {e}")
                        continue
                self.loaded.add(f"{os.path.basename(path)}@{step}")
            if self.stop.is_set():
                return


@pytest.mark.parametrize("interval", [0, 3600])
def test_a_recorded_path_never_names_a_partly_written_file(tmp_path, store, interval):
    """Every save, removals, the best and last checkpoints rewritten, persisted at once or
    (with an interval) links made while their versions are on their way to the store:
    whatever path Lightning records, another reader opening it gets a whole checkpoint (or
    nothing yet)."""
    ckpt_dir = tmp_path / "ckpts"
    callback = _callback(ckpt_dir, store, interval, monitor="train_loss", save_top_k=2, every_n_train_steps=1)
    reader = _PathReader(callback, ckpt_dir)
    reader.start()
    try:
        # A megabyte-sized hyperparameter makes each data file take a while to write.
        _trainer(tmp_path, 12, [callback], [NebulaCheckpointIO()]).fit(
            TinyModule(extra=torch.randn(1 << 18)), loader())
    finally:
        reader.stop.set()
        reader.join(TIMEOUT)
    assert not reader.is_alive()
    assert reader.failures == []
    assert reader.loaded  # it did read recorded paths
    assert torch.load(callback.last_model_path, weights_only=True)["global_step"] == 12


# -- manual saving, loading ------------------------------------------------------------------


def test_manual_save_with_storage_options_and_load_from_checkpoint(tmp_path, store, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nebulite.init(persistent_storage_path=store, persistent_time_interval=3600)
    trainer = _trainer(tmp_path, 4, plugins=[NebulaCheckpointIO()])
    model = TinyModule(lr=0.125)
    trainer.fit(model, loader())
    other = str(tmp_path / "tier3" / "checkpoint")
    trainer.save_checkpoint("example.ckpt", storage_options={"is_best": True, "persist_path": other})
    assert nebulite.session_info()["persistent_storage_path"] == other  # persist_path re-initialised

    path = nebulite.get_latest_checkpoint_path("checkpoint", other)
    assert _committed(other) == [("example.ckpt", Path(path).parent.parent.name)]
    assert os.path.realpath("example.ckpt") == os.path.realpath(path)  # the path Lightning was given links to it
    loaded = TinyModule.load_from_checkpoint(path)
    assert loaded.hparams.lr == 0.125
    assert weights(loaded) == weights(model)

    with pytest.raises(TypeError, match="storage_options"):
        trainer.save_checkpoint("x.ckpt", storage_options={"compress": True})


@pytest.mark.parametrize("url", ["memory://x", "hdfs://namenode/p"])
@pytest.mark.parametrize("how", ["persist_path", "config_params"])
def test_a_url_persistent_path_is_refused(tmp_path, store, url, how, monkeypatch):
    """A URL of a store nebulite has no driver for, as the persistent path, is a clear error,
    never a local directory named after its scheme (object stores: test_object_stores.py)."""
    monkeypatch.chdir(tmp_path)
    if how == "persist_path":
        nebulite.init(persistent_storage_path=store)
        trainer = _trainer(tmp_path, 2, plugins=[NebulaCheckpointIO()])
        trainer.fit(TinyModule(), loader())
        run = nebulite.session_info()["run_id"]
        trainer.save_checkpoint(str(tmp_path / "same.ckpt"), storage_options={"persist_path": f"file://{store}"})
        assert nebulite.session_info()["run_id"] == run  # the same path: not re-initialised
        with pytest.raises(nebulite.InvalidArgumentError, match="persist_path.*does not know the scheme"):
            trainer.save_checkpoint(str(tmp_path / "example.ckpt"), storage_options={"persist_path": url})
        assert nebulite.session_info()["persistent_storage_path"] == store  # the session stands
    else:
        callback = NebulaCallback(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=1,
                                  config_params={"persistent_storage_path": url})
        with pytest.raises(nebulite.InvalidArgumentError, match="persistent_storage_path.*does not know the scheme"):
            _trainer(tmp_path, 2, [callback], [NebulaCheckpointIO()]).fit(TinyModule(), loader())
    scheme = url.split(":")[0]
    assert [p for p in tmp_path.rglob(f"{scheme}:*")] == []
    assert not os.path.lexists(tmp_path / "example.ckpt")


def test_a_path_names_its_previous_checkpoint_until_the_new_one_is_stored(tmp_path, store):
    nebulite.init(persistent_storage_path=store, persistent_time_interval=3600, rank=0, world_size=1)
    io = NebulaCheckpointIO()
    path = str(tmp_path / "last.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, path)  # first: persisted
    nebulite.flush_persistence()
    first = _assert_nebulite_file(path, store)
    io.save_checkpoint({"state_dict": {"w": torch.full((2,), 2.0)}, "global_step": 2}, path)  # memory only
    assert torch.load(path)["global_step"] == 1  # the link still names a loadable checkpoint
    assert io.load_checkpoint(path)["global_step"] == 2  # this process reads what it wrote
    io.teardown()
    second = _assert_nebulite_file(path, store)
    assert torch.load(path)["global_step"] == 2
    assert _committed(store) == [second] and second != first  # the superseded version is gone


def test_remove_checkpoint_keeps_the_newest_in_the_store(tmp_path, store):
    nebulite.init(persistent_storage_path=store, rank=0, world_size=1, num_of_version_in_retention=0)
    io = NebulaCheckpointIO()
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, a)
    nebulite.flush_persistence()
    only = _assert_nebulite_file(a, store)
    io.remove_checkpoint(a)
    assert not os.path.lexists(a)  # gone from Lightning's view at once
    assert _committed(store) == [only]  # but the store's newest checkpoint is not deleted yet
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}}, b)
    io.teardown()
    assert _committed(store) == [_assert_nebulite_file(b, store)]  # deleted once b is committed
    assert not os.path.exists(os.path.join(store, "a.ckpt"))


def test_a_checkpoint_path_in_the_persistent_path_itself_is_refused(store):
    """There the link and the tag's directory would have the same name."""
    nebulite.init(persistent_storage_path=store, rank=0, world_size=1)
    io = NebulaCheckpointIO()
    with pytest.raises(nebulite.InvalidArgumentError, match="persistent path"):
        io.save_checkpoint({"state_dict": {}}, os.path.join(store, "last.ckpt"))
    io.save_checkpoint({"state_dict": {"w": torch.ones(1)}}, os.path.join(store, "lightning", "last.ckpt"))
    io.teardown()
    assert _committed(store) == [_assert_nebulite_file(os.path.join(store, "lightning", "last.ckpt"), store)]


def test_fit_from_a_path_that_does_not_exist_loads_the_newest_of_its_tag(tmp_path, store):
    """Nebula's trainer.fit(ckpt_path="/path/example.ckpt"): the file name is the tag."""
    nebulite.init(persistent_storage_path=store)
    trainer = _trainer(tmp_path, 2, plugins=[NebulaCheckpointIO()])
    trainer.fit(TinyModule(), loader())
    trainer.save_checkpoint(str(tmp_path / "saved" / "example.ckpt"))
    probe = Probe()
    _trainer(tmp_path, 4, [probe], [NebulaCheckpointIO()]).fit(
        TinyModule(), loader(), ckpt_path="/path/example.ckpt")
    assert probe.seen["start_step"] == 2
    with pytest.raises(FileNotFoundError):
        NebulaCheckpointIO().load_checkpoint(str(tmp_path / "nothing.ckpt"))


def test_resume_from_a_checkpoint_torch_save_wrote_before_switching(tmp_path, store):
    _trainer(tmp_path, 2, enable_checkpointing=True).fit(TinyModule(), loader())  # Lightning's own files
    (old,) = glob.glob(str(tmp_path / "checkpoints" / "*.ckpt"))
    nebulite.init(persistent_storage_path=store)
    probe = Probe()
    _trainer(tmp_path, 4, [probe], [NebulaCheckpointIO()]).fit(TinyModule(), loader(), ckpt_path=old)
    assert probe.seen["start_step"] == 2


def test_weights_only_as_torch_load(tmp_path, store):
    """Lightning passes weights_only to load_checkpoint; None means torch.load's default
    (True). A checkpoint holding other objects loads with weights_only=False."""
    ckpt_dir = tmp_path / "ckpts"
    _trainer(tmp_path, 2, [_callback(ckpt_dir, store)], [NebulaCheckpointIO()]).fit(
        TinyModule(extra=Opaque(3)), loader())
    last = str(ckpt_dir / "last.ckpt")
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        _trainer(tmp_path, 4, [_callback(ckpt_dir, store)], [NebulaCheckpointIO()]).fit(
            TinyModule(), loader(), ckpt_path=last)
    probe = Probe()
    _trainer(tmp_path, 4, [_callback(ckpt_dir, store), probe], [NebulaCheckpointIO()]).fit(
        TinyModule(), loader(), ckpt_path=last, weights_only=False)
    assert probe.seen["start_step"] == 2


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {r.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        nebulite.api._reset_for_tests()
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_teardown_raises_background_persistence_errors(tmp_path, small_tmpfs):
    store = os.path.join(small_tmpfs, "ckpt")
    nebulite.init(persistent_storage_path=store, rank=0, world_size=1)
    io = NebulaCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.randn(2 << 20)}}, str(tmp_path / "big.ckpt"))  # 8 MiB
    with pytest.raises(nebulite.PersistError, match="No space"):
        io.teardown()


# -- several processes -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, tmp_path: Path, store: str, steps: int, ckpt_path: str | None = None,
            world: int = 2, **env_extra: str) -> list[dict[str, Any]]:
    """Starts `world` ranks the way an external launcher does (Lightning reads LOCAL_RANK,
    NODE_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT); returns each rank's results."""
    out = str(tmp_path / f"{mode}-{steps}.json")
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(nebulite.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg_root] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world), NODE_RANK="0",
               OMP_NUM_THREADS="1", **env_extra)
    args = [sys.executable, WORKER, mode, out, store, str(tmp_path / "ckpts"), str(steps)]
    args += [ckpt_path] if ckpt_path else []
    # Their temporary files (ddp_spawn's workers leave a folder) go where this removes them;
    # short, as the Unix sockets of multiprocessing's helpers may be made there.
    env["TMPDIR"] = tempfile.mkdtemp(prefix="nbtmp-")
    procs = []
    try:
        for rank in range(world):
            rank_env = dict(env, LOCAL_RANK=str(rank), RANK=str(rank)) if world > 1 else env
            procs.append(subprocess.Popen(args, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        logs = [out for out, _ in wait_ranks(procs, JOB_TIMEOUT)]
    finally:
        shutil.rmtree(env["TMPDIR"], ignore_errors=True)
    failed = [f"rank {r} exited {p.returncode}:\n{log[-4000:]}" for r, (p, log) in enumerate(zip(procs, logs))
              if p.returncode]
    assert not failed, "\n".join(failed)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


def test_ddp_two_processes(tmp_path, store):
    first = _launch("ddp", tmp_path, store, 4)
    assert [r["rank"] for r in first] == [0, 1] and all(r["world_size"] == 2 for r in first)
    # Every rank runs a single-rank nebulite session; rank 0 saves whole checkpoints.
    assert all(r["session_world_size"] == 1 for r in first)
    assert first[0]["end_weights"] == first[1]["end_weights"]
    paths = sorted(glob.glob(str(tmp_path / "ckpts" / "*.ckpt")))
    assert [os.path.basename(p) for p in paths] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    for path in paths:
        tag, version = _assert_nebulite_file(path, store)
        assert _core.read_manifest(store, tag, version, 0)["world_size"] == 1

    resumed = _launch("ddp", tmp_path, store, 6, "last")
    for r in resumed:  # both ranks resumed from rank 0's checkpoint, bit for bit
        assert r["start_step"] == 4 and r["start_weights"] == first[0]["end_weights"]
    _assert_nebulite_file(resumed[0]["last_model_path"], store)
    assert torch.load(resumed[0]["last_model_path"], weights_only=True)["global_step"] == 6


@pytest.mark.parametrize("io_plugin", ["1", "0"])
def test_ddp_spawn_workers_save_where_the_main_process_s_init_says(tmp_path, store, io_plugin):
    """A script calls nebulite.init(persistent_storage_path=...) and trains with
    strategy="ddp_spawn": the processes Lightning spawns save to that path as well, and
    after fit the main process finds and loads what they saved."""
    [result] = _launch("ddp_spawn", tmp_path, store, 4, world=1, NEBULITE_IO_PLUGIN=io_plugin)
    paths = sorted(glob.glob(str(tmp_path / "ckpts" / "*.ckpt")))
    assert [os.path.basename(p) for p in paths] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    for path in paths:
        _assert_nebulite_file(path, store)
    assert result["best_model_path"] == str(tmp_path / "ckpts" / "epoch=1-step=4.ckpt") and result["best_step"] == 4
    assert result["latest_tag"] == "last.ckpt" and result["latest_step"] == 4
    assert result["loaded_weights"] == result["end_weights"]


def test_ddp_spawn_workers_with_the_node_agent(tmp_path, store, agent_env):
    """The same script with init()'s default, the node agent: the spawned workers attach to
    the node's agent, which persists what they commit, and the main process finds it."""
    [result] = _launch("ddp_spawn", tmp_path, store, 4, world=1, NEBULITE_AGENT="1")
    paths = sorted(glob.glob(str(tmp_path / "ckpts" / "*.ckpt")))
    assert [os.path.basename(p) for p in paths] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    for path in paths:
        _assert_nebulite_file(path, store)
    assert result["session_agent"] is True
    assert result["latest_tag"] == "last.ckpt" and result["latest_step"] == 4
    assert result["loaded_weights"] == result["end_weights"]


@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_strategy_two_processes(tmp_path, store, stage):
    """NebulaDeepspeedStrategy on the CPU (gloo, DeepSpeed's CPU accelerator): DeepSpeed saves
    through its Nebula engine, that is nebulite, and a resume from an older checkpoint
    directory loads that checkpoint, not the newest."""
    first = _launch("deepspeed", tmp_path, store, 4, ZERO_STAGE=str(stage))
    assert all(r["session_world_size"] == 2 for r in first)  # DeepSpeed's own session: both ranks
    ckpt_dir = tmp_path / "ckpts"
    names = sorted(p.name for p in ckpt_dir.iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    expected = {"mp_rank_00_model_states.pt"}
    if stage:
        expected |= {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)}
    for name in names:
        directory = ckpt_dir / name
        assert (directory / "latest").read_text() == name  # the DeepSpeed tag is the directory's name
        assert (directory / "checkpoint").resolve() == (directory / name).resolve()
        for file in (directory / name).iterdir():
            # Once committed, DeepSpeed's placeholders hold the committed files (as its own
            # engine's would): DeepSpeed's readers that open them directly find the state.
            state = torch.load(file, weights_only=False)  # ZeRO's state holds a LossScaler
            assert isinstance(state, dict) and state, file
            if file.name == "mp_rank_00_model_states.pt":
                assert "module" in state
        checkpoint = nebulite.get_checkpoint(tag=name, persist_path=store)
        assert set(checkpoint.list_names()) == expected
        assert os.path.isfile(os.path.join(store, name, checkpoint.version, "COMMITTED"))

    resumed = _launch("deepspeed", tmp_path, store, 6, str(ckpt_dir / "epoch=0-step=2.ckpt"),
                      ZERO_STAGE=str(stage))  # ZeRO's state holds DeepSpeed's LossScaler objects
    for r in resumed:
        assert r["start_step"] == 2
        assert r["start_weights"] != first[0]["end_weights"]  # the step-2 weights, not the newest


def test_standalone_pytorch_lightning_package(tmp_path, store):
    first = _launch("standalone", tmp_path, store, 4, world=1)
    _assert_nebulite_file(first[0]["last_model_path"], store)
    resumed = _launch("standalone", tmp_path, store, 6, "last", world=1)
    assert resumed[0]["start_step"] == 4 and resumed[0]["start_weights"] == first[0]["end_weights"]


# -- imports -----------------------------------------------------------------------------


def test_importing_nebulite_does_not_import_lightning():
    code = (
        "import sys, nebulite, torch_nebula, nebulaml\n"
        "assert not {'lightning', 'pytorch_lightning'} & set(sys.modules), 'imported eagerly'\n"
        "assert 'NebulaCallback' in dir(nebulite)\n"
        "import lightning\n"
        "from nebulite.integrations.lightning import NebulaCallback, NebulaCheckpointIO, NebulaDeepspeedStrategy\n"
        "for m in (nebulite, torch_nebula, nebulaml):\n"
        "    assert m.NebulaCallback is NebulaCallback and m.NebulaCheckpointIO is NebulaCheckpointIO\n"
        "    assert m.NebulaDeepspeedStrategy is NebulaDeepspeedStrategy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr


class _RecordingLogger(L.pytorch.loggers.Logger):
    """A logger that keeps what it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[dict[str, float], int]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        self.metrics.append((dict(metrics), step))


def test_callback_logs_each_checkpoints_figures_to_the_trainers_loggers(tmp_path, store):
    callback = _callback(tmp_path / "ckpts", store)
    logger = _RecordingLogger()
    trainer = L.Trainer(default_root_dir=str(tmp_path), max_steps=6, accelerator="cpu", devices=1,
                        callbacks=[callback], enable_progress_bar=False, enable_model_summary=False,
                        logger=logger, num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(TinyModule(), loader())
    nebulite.flush_persistence()
    callback._log_checkpoint_metrics(trainer)  # what became known after the last save
    sent = [m for m, _ in logger.metrics if any(k.startswith("nebulite/") for k in m)]
    saved = [m for m in sent if "nebulite/blocking_seconds" in m]
    committed = [m for m in sent if "nebulite/persist_seconds" in m]
    commits = [r for r in nebulite.history() if r["outcome"] == "committed"]
    assert len(committed) == len(commits) >= 3 and len(saved) == len(commits)
    assert sorted(m["nebulite/bytes"] for m in saved) == sorted(float(r["bytes"]) for r in commits)
    assert all(m["nebulite/blocking_seconds"] >= 0 for m in saved)
    assert all(m["nebulite/persist_seconds"] > 0 and m["nebulite/throughput_mb_s"] > 0
               for m in committed)
    callback._log_checkpoint_metrics(trainer)  # each figure is sent once
    assert len([m for m, _ in logger.metrics if any(k.startswith("nebulite/") for k in m)]) == len(sent)

"""``NebulaCallback``: Lightning's ``ModelCheckpoint`` with nebulite doing the saving, apart
from the Lightning package that hosts it (see lightning.py and pytorch_lightning.py)."""

from __future__ import annotations

import posixpath
import warnings
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

from .. import api
from .._config import Config, is_store_url
from .._history import summarise
from ..errors import InvalidArgumentError
from ._lightning_io import WRAPPED_REFUSAL, adopt_carried, carry_config, refuse_url

#: Keys of DeepSpeed's "nebula" config block that NebulaCallback's config_params may fill.
DEEPSPEED_NEBULA_KEYS = (
    "persistent_storage_path",
    "persistent_time_interval",
    "num_of_version_in_retention",
    "enable_nebula_load",
    "nebula_load_path",
)


def enable_nebula(config: dict[str, Any], params: Mapping[str, Any]) -> None:
    """Turns on the "nebula" block of a DeepSpeed config; `params` fill keys it lacks."""
    block = dict(config.get("nebula") or {})
    block["enabled"] = True
    for key in DEEPSPEED_NEBULA_KEYS:
        if key in params:
            block.setdefault(key, params[key])
    config["nebula"] = block


def _resolved(params: Mapping[str, Any]) -> Config:
    more = dict(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # init() itself warns about unknown options
        return Config.resolve(
            more.pop("persistent_storage_path", None),
            more.pop("persistent_time_interval", None),
            more.pop("num_of_version_in_retention", None),
            more,
        )


class NebulaCallbackMixin:
    """The behaviour of ``NebulaCallback``.

    ``NebulaCallback(<ModelCheckpoint's parameters>, *, config_params={...})``
    decides when to save and what to keep exactly as ``ModelCheckpoint`` does. At setup it
    initialises nebulite on every rank with `config_params` (the arguments of
    ``nebulite.init``; without them, an existing ``nebulite.init()`` stands, in the processes
    that ``strategy="ddp_spawn"`` starts too), as one rank
    saving whole checkpoints, and with ``num_of_version_in_retention=0`` unless given: what
    to delete is ``ModelCheckpoint``'s decision (``save_top_k``), carried out through
    ``NebulaCheckpointIO.remove_checkpoint``. It installs ``NebulaCheckpointIO`` when the
    strategy still has Lightning's default ``TorchCheckpointIO``, and, with a ``monitor``,
    marks the save that becomes ``best_model_path`` as ``is_best``. With a DeepSpeed
    strategy, DeepSpeed saves: the callback turns on the "nebula" block of its config
    instead, filled from `config_params`.
    """

    # Set by the flavour module to its package's classes.
    _io_class: type
    _torch_io_class: type
    _deepspeed_class: type

    # ModelCheckpoint's attributes this mixin reads.
    save_top_k: int
    save_last: Any
    best_model_path: str
    monitor: Optional[str]

    # ModelCheckpoint's parameters, spelled out for the tools that read the signature
    # (LightningCLI, IDEs, documentation generators); tests/test_lightning.py keeps them
    # equal to the installed ModelCheckpoint's.
    def __init__(
        self,
        dirpath: Union[str, Path, None] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        verbose: bool = False,
        save_last: Union[bool, Literal["link"], None] = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: Optional[int] = None,
        train_time_interval: Optional[timedelta] = None,
        every_n_epochs: Optional[int] = None,
        save_on_train_epoch_end: Optional[bool] = None,
        enable_version_counter: bool = True,
        *,
        config_params: Optional[Mapping[str, Any]] = None,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]
            dirpath=dirpath, filename=filename, monitor=monitor, verbose=verbose,
            save_last=save_last, save_top_k=save_top_k, save_on_exception=save_on_exception,
            save_weights_only=save_weights_only, mode=mode,
            auto_insert_metric_name=auto_insert_metric_name,
            every_n_train_steps=every_n_train_steps, train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs, save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=enable_version_counter,
        )
        self.config_params: dict[str, Any] = dict(config_params or {})
        self._carried_config: Optional[Config] = None
        self._logged: set[tuple[str, str, str]] = set()  # (tag, version, what) sent to loggers

    def __getstate__(self) -> dict[str, Any]:
        return carry_config(self.__dict__)

    def _generate_state_key(self, **kwargs: Any) -> str:
        """``ModelCheckpoint``'s state key, not one of its own: a run saved with either
        resumes with the other, its best-model tracking included."""
        return f"ModelCheckpoint{kwargs!r}"

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Checkpoints written before the key was ModelCheckpoint's hold it under this
        # class's own name: move it to the key Lightning looks up next.
        states = checkpoint.get("callbacks")
        old = type(self).__qualname__ + self.state_key[len("ModelCheckpoint"):]
        if isinstance(states, dict) and self.state_key not in states and old in states:
            states[self.state_key] = states.pop(old)
        super().on_load_checkpoint(trainer, pl_module, checkpoint)  # type: ignore[misc]

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """``ModelCheckpoint``'s, with the last checkpoints of a directory in an object store
        named by their URLs: Lightning's own drops the scheme fsspec lists them without, and
        ``ckpt_path="last"`` then looks for them on the local disk and resumes nothing."""
        found: set[str] = super()._find_last_checkpoints(trainer)  # type: ignore[misc]
        dirpath = self.dirpath  # type: ignore[attr-defined]
        if not dirpath or not is_store_url(str(dirpath)):
            return found
        return {f"{str(dirpath).rstrip('/')}/{posixpath.basename(p)}" for p in found}

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        refuse_url(self.dirpath)  # type: ignore[attr-defined]
        super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        strategy = trainer.strategy
        if isinstance(strategy, self._deepspeed_class):
            from ._lightning_deepspeed import refuse_url_directory

            refuse_url_directory(self.dirpath)  # type: ignore[attr-defined]
            enable_nebula(strategy.config, self.config_params)
            return
        io = strategy.checkpoint_io
        if isinstance(getattr(io, "checkpoint_io", None), self._io_class):  # AsyncCheckpointIO
            raise InvalidArgumentError(f"NebulaCallback: {WRAPPED_REFUSAL}")
        if type(io) is self._torch_io_class:
            strategy.checkpoint_io = self._io_class()
        elif not isinstance(io, self._io_class):
            warnings.warn(
                f"NebulaCallback: the strategy saves through {type(io).__name__}, not "
                "NebulaCheckpointIO: checkpoints are not saved by nebulite. Pass "
                "Trainer(plugins=[NebulaCheckpointIO()]).",
                stacklevel=2,
            )
        self._init_nebulite()
        self._check_retention()

    def _init_nebulite(self) -> None:
        if not self.config_params:
            adopt_carried(self._carried_config)  # in a process Lightning spawned
        if not self.config_params and api._config() is not None:
            return  # the user's own nebulite.init() stands
        params = dict(self.config_params)
        params.setdefault("num_of_version_in_retention", 0)
        params.setdefault("rank", 0)
        params.setdefault("world_size", 1)
        if api._config() == _resolved(params):
            return  # already initialised so (a second fit, or another NebulaCallback)
        api.init(**params)

    def _check_retention(self) -> None:
        config = api._config()
        keep = config.num_of_version_in_retention if config else 0
        if keep == 0:
            return
        needed = None if self.save_top_k < 0 else self.save_top_k + (1 if self.save_last else 0) + 1
        if needed is None or keep < needed:
            warnings.warn(
                f"nebulite keeps {keep} checkpoint versions (num_of_version_in_retention), fewer "
                f"than this callback keeps (save_top_k={self.save_top_k}, save_last={self.save_last}) "
                "plus the one being replaced: retention may delete checkpoints whose paths Lightning "
                "still records. Leave num_of_version_in_retention out of config_params (or set it "
                "to 0) to let the callback decide.",
                stacklevel=3,
            )

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        io = getattr(trainer.strategy, "checkpoint_io", None)
        if isinstance(io, self._io_class):
            # Without a monitor, ModelCheckpoint's "best" is merely the newest checkpoint.
            is_best = self.monitor is not None and filepath == self.best_model_path
            with io._saving_best(is_best):  # type: ignore[attr-defined]
                super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]
        else:
            super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]
        self._log_checkpoint_metrics(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_end(trainer, pl_module)  # type: ignore[misc]
        self._log_checkpoint_metrics(trainer)

    def _log_checkpoint_metrics(self, trainer: Any) -> None:
        """Sends each checkpoint's figures to the trainer's loggers (TensorBoard, CSV, W&B...)
        once known: ``nebulite/blocking_seconds`` and ``nebulite/bytes`` once it is saved,
        ``nebulite/persist_seconds`` and ``nebulite/throughput_mb_s`` once it is committed
        in the store. Logged at the step they become known, by the global rank 0."""
        loggers = list(getattr(trainer, "loggers", None) or [])
        if not loggers or not trainer.is_global_zero or api._config() is None:
            return
        for c in summarise(api.history()):
            metrics: dict[str, float] = {}
            if (c.tag, c.version, "saved") not in self._logged:
                self._logged.add((c.tag, c.version, "saved"))
                metrics.update({"nebulite/blocking_seconds": c.blocking_seconds,
                                "nebulite/bytes": float(c.bytes)})
            if c.persist_seconds is not None and (c.tag, c.version, "committed") not in self._logged:
                self._logged.add((c.tag, c.version, "committed"))
                metrics["nebulite/persist_seconds"] = c.persist_seconds
                if c.throughput_mb_s is not None:
                    metrics["nebulite/throughput_mb_s"] = c.throughput_mb_s
            if metrics:
                for logger in loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)

"""``NebulaDeepspeedStrategy``: Lightning's ``DeepSpeedStrategy`` with DeepSpeed's Nebula
checkpoint engine turned on, apart from the Lightning package that hosts it."""

from __future__ import annotations

import os
from typing import Any, Optional

from ..errors import InvalidArgumentError
from ._lightning_callback import enable_nebula

#: The DeepSpeed tag directory Lightning's own checks look for in a checkpoint directory.
LIGHTNING_TAG = "checkpoint"


def refuse_url_directory(path: Any) -> None:
    """DeepSpeed writes a checkpoint directory of its own (``latest``, its placeholders) with
    the local file system: a URL would become a directory named after its scheme."""
    if path is not None and "://" in os.fspath(path):
        raise InvalidArgumentError(
            f"{os.fspath(path)!r}: with a DeepSpeed strategy, DeepSpeed writes Lightning's "
            "checkpoint directory itself, on the local file system: give a local dirpath. To "
            "keep the checkpoints in an object store, give its URL as the persistent storage "
            "path (the \"nebula\" block's persistent_storage_path, or NebulaCallback's config_params)")


class NebulaDeepspeedStrategyMixin:
    """The behaviour of ``NebulaDeepspeedStrategy``.

    ``NebulaDeepspeedStrategy(config=..., **DeepSpeedStrategy_kwargs)`` is Lightning's
    ``DeepSpeedStrategy`` whose DeepSpeed config (a dict, a JSON path, or the strategy's
    defaults) gets ``"nebula": {"enabled": true, ...}``: DeepSpeed then saves and loads
    through ``torch_nebula``, which is nebulite. Keys of an existing "nebula" block are kept.

    DeepSpeed's Nebula engine names a checkpoint by its DeepSpeed tag, and Lightning's
    strategy gives every checkpoint the same tag (``checkpoint``), so that loading any
    checkpoint directory would load the newest one. This strategy tags each checkpoint with
    its directory's name instead (``epoch=0-step=10.ckpt``), which DeepSpeed records in the
    directory's ``latest`` file, and links ``checkpoint`` to that tag's folder so that
    Lightning still recognises the directory.
    """

    # DeepSpeedStrategy's attributes this mixin uses.
    config: dict[str, Any]
    deepspeed_engine: Any
    exclude_frozen_parameters: bool
    is_global_zero: bool

    def __init__(self, *args: Any, config: Optional[Any] = None, **kwargs: Any) -> None:
        super().__init__(*args, config=config, **kwargs)
        self.config = dict(self.config)  # the caller's dict stays as it was
        enable_nebula(self.config, {})

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """As ``DeepSpeedStrategy.save_checkpoint``, with the tag named after `filepath`."""
        refuse_url_directory(filepath)
        filepath = self.broadcast(filepath)  # type: ignore[attr-defined]
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                f"`{type(self).__name__}`: DeepSpeed saves, not a CheckpointIO."
            )
        tag = os.path.basename(os.path.normpath(os.fspath(filepath)))
        # What Lightning's DeepSpeedStrategy saves besides the engine's own state.
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.deepspeed_engine.save_checkpoint(
            filepath, client_state=client_state, tag=tag, exclude_frozen_parameters=self.exclude_frozen_parameters
        )
        if self.is_global_zero and tag != LIGHTNING_TAG:
            link = os.path.join(os.fspath(filepath), LIGHTNING_TAG)
            if not os.path.lexists(link):
                os.symlink(tag, link)
        self.barrier("NebulaDeepspeedStrategy.save_checkpoint")  # type: ignore[attr-defined]

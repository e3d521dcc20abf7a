"""nebulite for Lightning (the ``lightning`` package, ``lightning.pytorch``).

``NebulaCheckpointIO``, ``NebulaCallback`` and ``NebulaDeepspeedStrategy``, also reachable
as ``nebulite.NebulaCheckpointIO`` and so on (and through ``torch_nebula`` / ``nebulaml``).
See docs/lightning.md. The same classes for the standalone ``pytorch_lightning`` package
are in ``nebulite.integrations.pytorch_lightning``.
"""

from __future__ import annotations

from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _atomic_save, _load
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy

from ._lightning_callback import NebulaCallbackMixin
from ._lightning_deepspeed import NebulaDeepspeedStrategyMixin
from ._lightning_io import CHECKPOINT_NAME, NebulaCheckpointIOMixin


class NebulaCheckpointIO(NebulaCheckpointIOMixin, CheckpointIO):
    __doc__ = NebulaCheckpointIOMixin.__doc__
    _torch_load = staticmethod(_load)
    _torch_save = staticmethod(_atomic_save)


class NebulaCallback(NebulaCallbackMixin, ModelCheckpoint):
    __doc__ = NebulaCallbackMixin.__doc__
    _io_class = NebulaCheckpointIO
    _torch_io_class = TorchCheckpointIO
    _deepspeed_class = DeepSpeedStrategy


class NebulaDeepspeedStrategy(NebulaDeepspeedStrategyMixin, DeepSpeedStrategy):
    __doc__ = NebulaDeepspeedStrategyMixin.__doc__
    strategy_name = "nebula_deepspeed"


__all__ = ["CHECKPOINT_NAME", "NebulaCallback", "NebulaCheckpointIO", "NebulaDeepspeedStrategy"]

"""nebulite for Lightning (the standalone ``pytorch_lightning`` package).

``NebulaCheckpointIO``, ``NebulaCallback`` and ``NebulaDeepspeedStrategy``, also reachable
as ``nebulite.NebulaCheckpointIO`` and so on (and through ``torch_nebula`` / ``nebulaml``).
See docs/lightning.md. The same classes for the ``lightning`` package
are in ``nebulite.integrations.lightning``.
"""

from __future__ import annotations

from lightning_fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning_fabric.utilities.cloud_io import _atomic_save, _load
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DeepSpeedStrategy

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

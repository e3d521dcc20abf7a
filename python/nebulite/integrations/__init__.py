"""Integrations of nebulite with training frameworks, each imported only when used.

``nebulite.integrations.lightning`` (the ``lightning`` package) and
``nebulite.integrations.pytorch_lightning`` (the standalone ``pytorch_lightning``
package) hold the same three classes, each built on its own package's base classes;
``nebulite.NebulaCallback`` and friends come from :func:`lightning_flavour`.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lightning_flavour() -> ModuleType:
    """The integration module for the Lightning package this process uses.

    ``lightning`` when it is imported, or when neither package is imported yet and it is
    installed; ``pytorch_lightning`` otherwise. A Trainer accepts only plugins and
    callbacks built on its own package's classes, so a script that imports
    ``pytorch_lightning`` gets classes built on ``pytorch_lightning``.
    """
    if "lightning" in sys.modules or (
        "pytorch_lightning" not in sys.modules and importlib.util.find_spec("lightning") is not None
    ):
        from . import lightning as flavour
    else:
        try:
            from . import pytorch_lightning as flavour
        except ImportError as e:
            raise ImportError(
                "nebulite's NebulaCallback, NebulaCheckpointIO and NebulaDeepspeedStrategy need "
                "Lightning: pip install lightning"
            ) from e
    return flavour

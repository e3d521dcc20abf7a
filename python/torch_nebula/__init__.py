"""Compatibility module: ``import torch_nebula`` is nebulite (Azure ML Nebula's name)."""

from typing import Any

import nebulite
from nebulite import *  # noqa: F401,F403
from nebulite import __all__, __version__  # noqa: F401


def __getattr__(name: str) -> Any:
    # What nebulite imports on first use (the Lightning integration) is nebulite's too.
    return getattr(nebulite, name)

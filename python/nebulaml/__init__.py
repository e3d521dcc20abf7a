"""Compatibility module: ``import nebulaml`` is nebulite (Azure ML Nebula's name)."""

from nebulite import *  # noqa: F401,F403
from nebulite import __all__, __version__  # noqa: F401

"""nebulite: fast asynchronous checkpointing for PyTorch.

A drop-in successor to Azure ML's Nebula: ``import nebulite as nm`` (or
``import torch_nebula`` / ``import nebulaml``), then::

    nm.init(persistent_storage_path="/mnt/ckpt/run1")
    ckpt = nm.Checkpoint("global_step500", num_files=2)
    ckpt.save("model", model.state_dict())       # returns once in memory
    ckpt.save("optimizer", opt.state_dict())     # second file: committed
    latest = nm.get_latest_checkpoint()
    model.load_state_dict(latest.load("model"))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    AgentLostError,
    CorruptCheckpointError,
    FailedPreconditionError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    MemoryBudgetError,
    NebuliteError,
    NotFoundError,
    NotInitializedError,
    PersistError,
    StorageError,
    StorageFullError,
    StorageFullPersistError,
    StoragePermissionError,
    StoreInUseError,
    TagMismatchError,
    TornCheckpointError,
    UnsupportedVersionError,
)

if TYPE_CHECKING:
    from .api import (
        COMMIT_EXPLICITLY,
        Checkpoint,
        flush_persistence,
        get_checkpoint,
        get_latest_checkpoint,
        get_latest_checkpoint_path,
        history,
        init,
        list_checkpoints,
        session_info,
        shutdown,
        wait_staged,
    )

__version__ = "0.1.0"

# The API (and torch with it) is imported on first use, so that processes that need
# none of it, such as the node agent, stay small.
_API = {
    "COMMIT_EXPLICITLY", "Checkpoint", "flush_persistence", "get_checkpoint",
    "get_latest_checkpoint", "get_latest_checkpoint_path", "history", "init",
    "list_checkpoints", "session_info", "shutdown", "wait_staged",
}
# The Lightning integration, likewise: `import nebulite` (and DeepSpeed's `import
# torch_nebula`) never imports Lightning. Kept out of __all__ for the same reason.
_LIGHTNING = {"NebulaCallback", "NebulaCheckpointIO", "NebulaDeepspeedStrategy"}


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module(".api", __name__), name)
        globals()[name] = value  # found without this call from now on
        return value
    if name == "api":
        return importlib.import_module(".api", __name__)
    if name in _LIGHTNING:
        from .integrations import lightning_flavour

        return getattr(lightning_flavour(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API | _LIGHTNING)


__all__ = [
    "AgentLostError",
    "COMMIT_EXPLICITLY",
    "Checkpoint",
    "CorruptCheckpointError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "MemoryBudgetError",
    "NebuliteError",
    "NotFoundError",
    "NotInitializedError",
    "PersistError",
    "StorageError",
    "StorageFullError",
    "StorageFullPersistError",
    "StoragePermissionError",
    "StoreInUseError",
    "TagMismatchError",
    "TornCheckpointError",
    "UnsupportedVersionError",
    "flush_persistence",
    "get_checkpoint",
    "get_latest_checkpoint",
    "get_latest_checkpoint_path",
    "history",
    "init",
    "list_checkpoints",
    "session_info",
    "shutdown",
    "wait_staged",
]

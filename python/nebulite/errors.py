"""Exceptions raised by nebulite.

Every error nebulite raises derives from :class:`NebuliteError`. Where a standard
exception fits, the nebulite class derives from it too, so that ``except OSError``
or ``except ValueError`` keep working.
"""

from __future__ import annotations


class NebuliteError(Exception):
    """Base class of every nebulite error."""


class InvalidArgumentError(NebuliteError, ValueError):
    """A tag, name, path or option is not acceptable."""


class TagMismatchError(InvalidArgumentError):
    """The ranks of one job committed different tags in the same commit (DeepSpeed's
    ``checkpoint.tag_validation`` set to ``Warn`` or ``Ignore`` allows it): that checkpoint
    fails on every rank, naming each rank's tag, and nothing of it is kept."""


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (an ``int`` where a path goes, say). It is a
    ``TypeError`` and, as every bad argument, an :class:`InvalidArgumentError`."""


class NotFoundError(NebuliteError, LookupError):
    """The checkpoint, tag or object does not exist (or is not committed)."""


class CorruptCheckpointError(NebuliteError):
    """Stored bytes are not what was written (checksum, size or structure mismatch)."""


class UnsupportedVersionError(CorruptCheckpointError):
    """The file was written by a newer format version than this nebulite reads."""


class StorageError(NebuliteError, OSError):
    """The persistent store failed an operation."""


class StorageFullError(StorageError):
    """The persistent store ran out of space."""


class StoragePermissionError(StorageError, PermissionError):
    """The persistent store is not writable or readable by this process."""


class MemoryBudgetError(NebuliteError, MemoryError):
    """The memory budget (NEBULA_MEMORY_BUFFER_SIZE) cannot hold the request."""


class FailedPreconditionError(NebuliteError, RuntimeError):
    """The call is not valid in the current state."""


class StoreInUseError(FailedPreconditionError):
    """Another job holds the persistent store's writer lease: two jobs writing one store
    would delete each other's checkpoints. The message names the other job (run id, host,
    pid, when it last renewed its lease) and how to opt into sharing the store
    (``init(shared_store=True)`` or ``NEBULITE_SHARED_STORE=1``)."""


class NotInitializedError(FailedPreconditionError):
    """nebulite.init() has not been called."""


class AgentLostError(NebuliteError, ConnectionError):
    """The node agent this trainer was attached to is gone (killed, or its socket closed)
    or stopped answering within ``agent_timeout`` (stopped, in a debugger, swapping).
    Checkpoints it had committed to the store are safe; call ``nebulite.init()`` again to
    attach to a new agent, or let nebulite go on without one (``agent_fallback=True``)."""


class PersistError(NebuliteError):
    """Background persistence failed; raised on the next call after the failure."""

    def __init__(self, message: str, causes: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.causes = causes or []


class TornCheckpointError(PersistError):
    """With asynchronous staging, a saved tensor changed in place between ``save()`` and
    the copy of its bytes (outside ``optimizer.step()``, or without ``wait_staged()``
    first). The message names the checkpoint, the object and the tensor's key path; the
    checkpoint is never committed, and the previous one stays the latest."""


class StorageFullPersistError(PersistError, StorageFullError):
    """Background persistence failed because the persistent store is full."""

"""Configuration: arguments of init() and the NEBULA_* environment variables."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgumentError

#: Versions kept when num_of_version_in_retention is not given (Nebula's default).
DEFAULT_RETENTION = 2


def _parse_bool(name: str, value: Any) -> bool:
    """A boolean option or environment variable, parsed strictly: True/False, or one of
    1/0, true/false, yes/no (any case); anything else is an error, never a guess."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("1", "true", "yes"):
            return True
        if v in ("0", "false", "no"):
            return False
    raise InvalidArgumentError(f"{name} must be a boolean (0/1, true/false, yes/no), got {value!r}")


def _parse_number(name: str, value: Any, kind: type) -> Any:
    try:
        out = kind(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}") from None
    if out < 0:
        raise InvalidArgumentError(f"{name} must not be negative, got {value!r}")
    return out


@dataclass
class Config:
    persistent_storage_path: str | None = None
    persistent_time_interval: float = 0.0
    num_of_version_in_retention: int = DEFAULT_RETENTION
    memory_buffer_size: int = 0  # bytes per node; 0 = default (25% of RAM)
    io_threads: int = 0
    copy_threads: int = 0
    direct_io: bool = True
    prefault: bool = False
    commit_timeout: float = 600.0
    # Uncommitted versions of a dead run are removed only once nothing in them changed for
    # this long (None: an hour, or twice the commit timeout if longer); see nebulite/runs.h.
    dead_run_grace: float | None = None
    async_staging: bool = False
    agent: bool = True
    agent_idle_exit: float = 60.0
    # Several jobs may write this store at once (no writer lease is taken or checked).
    shared_store: bool = False
    # How long a job's writer lease lives without renewal; renewed every sixth of it.
    lease_ttl: float = 180.0
    rank: int | None = None
    world_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def resolve(
        cls,
        persistent_storage_path: str | os.PathLike[str] | None,
        persistent_time_interval: float | None,
        num_of_version_in_retention: int | None,
        more: dict[str, Any],
    ) -> "Config":
        env = os.environ
        c = cls()
        path = persistent_storage_path
        if path is None:
            path = env.get("NEBULA_PERSISTENT_STORAGE_PATH") or None
        if isinstance(path, (tuple, list)) and len(path) == 1:
            # Azure's documented example passes ("/tmp/test",): a trailing comma makes a tuple.
            path = path[0]
        if path is not None:
            path = os.fspath(path)
            if not path or "\0" in path:
                raise InvalidArgumentError(f"persistent_storage_path is not a valid path: {path!r}")
            if "://" in path and not path.startswith("file://"):
                raise InvalidArgumentError(
                    f"persistent_storage_path {path!r}: object stores are not supported by the "
                    "embedded engine; use a local or mounted path"
                )
            if path.startswith("file://"):
                path = path[len("file://"):]
            c.persistent_storage_path = os.path.abspath(path)
        interval = persistent_time_interval
        if interval is None:
            interval = env.get("NEBULA_PERSISTENT_TIME_INTERVAL")
        c.persistent_time_interval = (
            0.0 if interval is None else _parse_number("persistent_time_interval", interval, float)
        )
        if num_of_version_in_retention is not None:
            c.num_of_version_in_retention = _parse_number(
                "num_of_version_in_retention", num_of_version_in_retention, int
            )
        buf = more.pop("memory_buffer_size", None)
        if buf is None:
            buf = env.get("NEBULA_MEMORY_BUFFER_SIZE")
        if buf is not None:
            c.memory_buffer_size = _parse_number("NEBULA_MEMORY_BUFFER_SIZE", buf, int)
        for key in ("io_threads", "copy_threads"):
            if key in more:
                setattr(c, key, _parse_number(key, more.pop(key), int))
        for key in ("direct_io", "prefault"):
            if key in more:
                setattr(c, key, bool(more.pop(key)))
        agent = more.pop("agent", None)
        if agent is None:
            agent = env.get("NEBULITE_AGENT", "1").lower() not in ("0", "false", "no", "off")
        c.agent = bool(agent)
        idle = more.pop("agent_idle_exit", None)
        if idle is None:
            idle = env.get("NEBULITE_AGENT_IDLE_EXIT")
        if idle is not None:
            c.agent_idle_exit = _parse_number("agent_idle_exit", idle, float)
        flag = more.pop("async_staging", None)
        if flag is None:
            flag = env.get("NEBULITE_ASYNC_STAGING", "0").lower() in ("1", "true", "yes", "on")
        c.async_staging = bool(flag)
        shared = more.pop("shared_store", None)
        if shared is None:
            shared = env.get("NEBULITE_SHARED_STORE")
            c.shared_store = False if shared is None else _parse_bool("NEBULITE_SHARED_STORE", shared)
        else:
            c.shared_store = _parse_bool("shared_store", shared)
        ttl = more.pop("lease_ttl", None)
        if ttl is None:
            ttl = env.get("NEBULITE_LEASE_TTL")
        if ttl is not None:
            c.lease_ttl = _parse_number("lease_ttl", ttl, float)
            if c.lease_ttl < 1:
                raise InvalidArgumentError(f"lease_ttl must be at least 1 second, got {ttl!r}")
        if "commit_timeout" in more:
            c.commit_timeout = _parse_number("commit_timeout", more.pop("commit_timeout"), float)
        grace = more.pop("dead_run_grace", None)
        if grace is None:
            grace = env.get("NEBULITE_DEAD_RUN_GRACE")
        c.dead_run_grace = (
            max(3600.0, 2 * c.commit_timeout) if grace is None
            else _parse_number("dead_run_grace", grace, float))
        for key in ("rank", "world_size"):
            if key in more:
                setattr(c, key, _parse_number(key, more.pop(key), int))
        if more:
            warnings.warn(
                f"nebulite.init: ignoring unknown options {sorted(more)}", stacklevel=3
            )
            c.extra = dict(more)
        return c

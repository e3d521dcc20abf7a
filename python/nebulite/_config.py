"""Configuration: arguments of init() and the NEBULA_* environment variables."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, InvalidArgumentTypeError
# The URL schemes of the object stores nebulite persists to, and is_store_url(path): a URL
# other than file:// (nebulite.stores has the clients; importing it imports none of them).
from .stores import SCHEMES as OBJECT_STORE_SCHEMES
from .stores import is_url as is_store_url

#: Versions kept when num_of_version_in_retention is not given (Nebula's default).
DEFAULT_RETENTION = 2


_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no")
#: Thread counts above this are refused: each thread reserves its stack.
MAX_THREADS = 1024


def parse_bool(name: str, value: Any) -> bool:
    """A switch from code, a config file or the environment: a bool, 0/1, or one of
    0/1/true/false/yes/no in any case; anything else is refused (``"false"`` must not
    turn a switch on)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise InvalidArgumentError(
        f"{name} must be a boolean (true/false, yes/no or 1/0), got {value!r}")


def parse_int(name: str, value: Any, low: int = 0, high: int | None = None) -> int:
    """A whole number in [low, high]: an int, an integral float, or its decimal text.
    1.5 is refused, not rounded; so is a bool, which is not a count."""
    out: int | None = None
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        out = int(value)
    elif isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        out = int(value)
    elif isinstance(value, str):
        try:
            out = int(value.strip())
        except ValueError:
            out = None
    if out is None:
        raise InvalidArgumentError(f"{name} must be a whole number, got {value!r}")
    if out < low or (high is not None and out > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise InvalidArgumentError(f"{name} must be {bounds}, got {value!r}")
    return out


def parse_seconds(name: str, value: Any, *, finite: bool = False) -> float:
    """A duration in seconds, >= 0. ``inf`` (and anything too large to mean a deadline)
    is no limit, unless `finite`; NaN is refused."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        out = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a number of seconds, got {value!r}") from None
    if math.isnan(out) or out < 0:
        raise InvalidArgumentError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if out >= NO_LIMIT:
        if finite:
            raise InvalidArgumentError(f"{name} must be finite, got {value!r}")
        out = math.inf
    return out


def parse_file_mode(name: str, value: Any) -> int:
    """Permission bits such as 0o640; text is octal ("640", "0640", "0o640"). The owner
    must keep read and write (nebulite rewrites and removes its own files)."""
    mode: int | None = None
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        mode = int(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        text = text[2:] if text.startswith("0o") else text
        try:
            mode = int(text, 8)
        except ValueError:
            mode = None
    if mode is None or not (mode == 0 or (0 <= mode <= 0o777 and mode & 0o600 == 0o600)):
        raise InvalidArgumentError(
            f"{name} must be a permission mode of at most 0o777 that lets the owner read and "
            f"write (0o600, 0o640, 0o644, ...; 0 follows the umask), got {value!r}")
    return mode


#: Durations from this many seconds up (about 31 700 years) mean "no limit".
NO_LIMIT = 1e12


def read_threads(root: str) -> int:
    """Threads reading one data file: 4 keep a disk busy; an object store answers each
    request after a round trip, so as many as its clients have requests in flight."""
    if not is_store_url(root):
        return 4
    from .stores import StoreTuning

    return StoreTuning.from_env().concurrency


def store_exists(root: str) -> bool:
    """Whether there may be a store at `root`: a directory, or any object store's URL (the
    store says what it holds)."""
    return is_store_url(root) or os.path.isdir(root)


def _parse_url(name: str, url: str) -> str:
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme not in OBJECT_STORE_SCHEMES:
        raise InvalidArgumentError(
            f"{name} {url!r}: nebulite does not know the scheme {scheme!r}; the stores it "
            f"persists to are local or mounted paths (or file://...) and "
            f"{', '.join(s + '://' for s in OBJECT_STORE_SCHEMES)} URLs")
    rest = rest.strip("/")
    if not rest or rest.startswith("@") or "//" in rest or any(
            part in (".", "..") for part in rest.split("/")):
        raise InvalidArgumentError(
            f"{name} {url!r} is not a valid {scheme}:// URL: it needs a bucket or container, "
            f"as in {scheme}://{'container@account.dfs.core.windows.net' if scheme.startswith('abfs') else 'bucket'}/prefix")
    return f"{scheme}://{rest}"


def parse_path(name: str, value: Any) -> str:
    """A local or mounted path (str, bytes or os.PathLike; absolute on return), or an object
    store's URL (returned without trailing '/')."""
    if isinstance(value, (tuple, list)) and len(value) == 1 and isinstance(value[0], (str, os.PathLike)):
        # Azure's documented example passes ("/tmp/test",): a trailing comma makes a tuple.
        value = value[0]
    try:
        path = os.fspath(value)
    except TypeError:
        raise InvalidArgumentTypeError(
            f"{name} must be a path (str or os.PathLike), got {type(value).__name__}") from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path or "\0" in path:
        raise InvalidArgumentError(f"{name} is not a valid path: {path!r}")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(
            f"{name} {path!r} is not valid UTF-8 (nebulite records paths as UTF-8)") from None
    if is_store_url(path):
        return _parse_url(name, path)
    if path.startswith("file://"):
        path = path[len("file://"):]
    return os.path.abspath(path)


@dataclass
class Config:
    persistent_storage_path: str | None = None
    persistent_time_interval: float = 0.0
    num_of_version_in_retention: int = DEFAULT_RETENTION
    memory_buffer_size: int = 0  # bytes per node; 0 = default (25% of RAM)
    io_threads: int = 0
    copy_threads: int = 0
    direct_io: bool = True
    # Permissions of persisted files (0: 0666 less the umask, as torch.save); see README.
    file_mode: int = 0
    prefault: bool = False
    commit_timeout: float = 600.0
    # Uncommitted versions of a dead run are removed only once nothing in them changed for
    # this long (None: an hour, or twice the commit timeout if longer); see nebulite/runs.h.
    dead_run_grace: float | None = None
    async_staging: bool = False
    agent: bool = True
    agent_idle_exit: float = 60.0
    # Seconds a request may go unanswered by the agent before the trainer gets
    # AgentLostError (requests that wait by design get their own wait on top).
    agent_timeout: float = 60.0
    agent_fallback: bool = False  # on AgentLostError, go on with the embedded engine
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

        def given(key: str, var: str | None = None) -> tuple[str, Any]:
            """The value of option `key` and the name to blame for it: the argument if
            given, else environment variable `var` if set, else (key, None)."""
            value = more.pop(key, None)
            if value is None and var is not None and env.get(var) is not None:
                return var, env[var]
            return key, value

        path = persistent_storage_path
        what = "persistent_storage_path"
        if path is None and env.get("NEBULA_PERSISTENT_STORAGE_PATH"):
            what, path = "NEBULA_PERSISTENT_STORAGE_PATH", env["NEBULA_PERSISTENT_STORAGE_PATH"]
        if path is not None:
            c.persistent_storage_path = parse_path(what, path)
        interval: Any = persistent_time_interval
        what = "persistent_time_interval"
        if interval is None and env.get("NEBULA_PERSISTENT_TIME_INTERVAL") is not None:
            what, interval = "NEBULA_PERSISTENT_TIME_INTERVAL", env["NEBULA_PERSISTENT_TIME_INTERVAL"]
        if interval is not None:
            c.persistent_time_interval = parse_seconds(what, interval, finite=True)
        if num_of_version_in_retention is not None:
            c.num_of_version_in_retention = parse_int(
                "num_of_version_in_retention", num_of_version_in_retention)
        what, buf = given("memory_buffer_size", "NEBULA_MEMORY_BUFFER_SIZE")
        if buf is not None:
            c.memory_buffer_size = parse_int(what, buf)
        for key in ("io_threads", "copy_threads"):
            what, value = given(key)
            if value is not None:
                setattr(c, key, parse_int(what, value, 0, MAX_THREADS))
        for key, var in (("direct_io", None), ("prefault", None), ("agent", "NEBULITE_AGENT"),
                         ("async_staging", "NEBULITE_ASYNC_STAGING"),
                         ("agent_fallback", "NEBULITE_AGENT_FALLBACK"),
                         ("shared_store", "NEBULITE_SHARED_STORE")):
            what, value = given(key, var)
            if value is not None:
                setattr(c, key, parse_bool(what, value))
        what, mode = given("file_mode", "NEBULITE_FILE_MODE")
        if mode is not None:
            c.file_mode = parse_file_mode(what, mode)
        what, idle = given("agent_idle_exit", "NEBULITE_AGENT_IDLE_EXIT")
        if idle is not None:
            c.agent_idle_exit = parse_seconds(what, idle)
        what, timeout = given("commit_timeout")
        if timeout is not None:
            c.commit_timeout = parse_seconds(what, timeout)
        what, grace = given("dead_run_grace", "NEBULITE_DEAD_RUN_GRACE")
        c.dead_run_grace = (max(3600.0, 2 * c.commit_timeout) if grace is None
                            else parse_seconds(what, grace))
        what, timeout = given("agent_timeout", "NEBULITE_AGENT_TIMEOUT")
        if timeout is not None:
            c.agent_timeout = parse_seconds(what, timeout)
            if c.agent_timeout == 0:
                raise InvalidArgumentError(f"{what} must be positive, got {timeout!r}")
        what, ttl = given("lease_ttl", "NEBULITE_LEASE_TTL")
        if ttl is not None:
            c.lease_ttl = parse_seconds(what, ttl, finite=True)
            if c.lease_ttl < 1:
                raise InvalidArgumentError(f"{what} must be at least 1 second, got {ttl!r}")
        for key in ("rank", "world_size"):
            what, value = given(key)
            if value is not None:
                setattr(c, key, parse_int(what, value, 1 if key == "world_size" else 0))
        if c.rank is not None and c.world_size is not None and c.rank >= c.world_size:
            raise InvalidArgumentError(
                f"rank must be below world_size ({c.world_size}), got {c.rank}")
        if more:
            warnings.warn(
                f"nebulite.init: ignoring unknown options {sorted(more)}", stacklevel=3
            )
            c.extra = dict(more)
        return c

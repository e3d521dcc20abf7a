"""An fsspec filesystem over nebulite's object-store clients.

Lightning resolves a checkpoint directory such as ``s3://bucket/run`` through fsspec, which
needs a package for the scheme (s3fs, adlfs, gcsfs). Where that package is not installed,
:func:`register_missing` registers this filesystem for the scheme instead, so that
``ModelCheckpoint(dirpath="s3://...")`` with nebulite needs nothing beyond nebulite's own
clients. Where the package is installed it is left alone: it sees the same objects.

It does what a checkpoint directory needs: info, ls, exists, reads (ranged), whole-object
writes (buffered in memory, one atomic put on close), removes and copies. A directory is a
common prefix of keys; ``mkdir`` and ``makedirs`` make nothing. Paths are fsspec's: the URL
without its scheme (``bucket/run/last.ckpt``).
"""

from __future__ import annotations

import importlib.util
import io
import threading
from datetime import datetime, timezone
from typing import Any, ClassVar

import fsspec
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from nebulite.stores import SCHEMES, ObjectClient, files, open_client

#: The fsspec package each scheme belongs to, where one exists.
PACKAGES = {"az": "adlfs", "abfs": "adlfs", "abfss": "adlfs", "s3": "s3fs", "gs": "gcsfs"}


class ObjectStoreFileSystem(AbstractFileSystem):
    """The filesystem of one scheme (see :func:`filesystem_class`)."""

    protocol: ClassVar[str | tuple[str, ...]] = "nebulite-object"
    root_marker = ""
    # Clients read their endpoint and credentials from the environment when opened: an
    # instance made under other settings must not be handed out again.
    cachable = False

    def __init__(self, *args: Any, **storage_options: Any) -> None:
        super().__init__(*args, **storage_options)
        self._clients: dict[str, ObjectClient] = {}
        self._lock = threading.Lock()

    @property
    def scheme(self) -> str:
        return self.protocol if isinstance(self.protocol, str) else self.protocol[0]

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = fsspec.utils.stringify_path(path)
        for p in [cls.protocol] if isinstance(cls.protocol, str) else cls.protocol:
            if path.startswith(f"{p}://"):
                path = path[len(p) + 3:]
                break
        return path.strip("/")

    def _split(self, path: str) -> tuple[ObjectClient, str, str]:
        """(client of the container, container, key) of `path`."""
        container, _, key = self._strip_protocol(path).partition("/")
        if not container:
            raise ValueError(f"{path!r} names no bucket or container")
        with self._lock:
            client = self._clients.get(container)
            if client is None:
                client = self._clients[container] = open_client(f"{self.scheme}://{container}")
        return client, container, key

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        client, container, key = self._split(path)
        found = files.lookup(client, key)
        if found is None:
            raise FileNotFoundError(path)
        kind, size, mtime_ns = found
        name = f"{container}/{key}" if key else container
        if kind == "file":
            return {"name": name, "size": size, "type": "file", "mtime_ns": mtime_ns}
        return {"name": name, "size": 0, "type": "directory"}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        client, container, key = self._split(path)
        below, dirs = files.list_below(client, key)
        if key and not below and not dirs:  # a file lists as itself; nothing at all is an error
            entries = [self.info(path)]
        else:
            entries = [{"name": f"{container}/{k}", "size": size, "type": "file", "mtime_ns": mtime}
                       for k, size, mtime in below]
            entries += [{"name": f"{container}/{d}", "size": 0, "type": "directory"} for d in dirs]
            entries.sort(key=lambda e: e["name"])
        return entries if detail else [e["name"] for e in entries]

    def modified(self, path: str) -> datetime:
        info = self.info(path)
        if info["type"] != "file":
            raise IsADirectoryError(path)
        return datetime.fromtimestamp(info["mtime_ns"] / 1e9, tz=timezone.utc)

    def created(self, path: str) -> datetime:
        return self.modified(path)  # objects are written whole, never changed

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._split(path)  # a directory is a prefix: nothing to make

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if not exist_ok and self.exists(path):
            raise FileExistsError(path)
        self._split(path)

    def rmdir(self, path: str) -> None:
        if self.ls(path, detail=False):
            raise OSError(f"{path}: directory not empty")

    def rm_file(self, path: str) -> None:
        client, _, key = self._split(path)
        if not key:
            raise IsADirectoryError(path)
        client.delete(key)

    def _rm(self, path: str) -> None:
        if self.isfile(path):
            self.rm_file(path)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        client, container, src = self._split(path1)
        target, other, dst = self._split(path2)
        if container != other:
            self.pipe_file(path2, self.cat_file(path1))
        else:
            client.copy(src, dst)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        if "r" in mode:
            return _ObjectFile(self, path, mode, block_size="default" if block_size is None else block_size,
                               cache_options=cache_options, **kwargs)
        if mode not in ("wb", "xb"):
            raise ValueError(f"{path}: mode {mode!r} is not supported on an object store (rb, wb or xb)")
        return _ObjectWriter(self, path, exclusive=mode == "xb", autocommit=autocommit)


class _ObjectFile(AbstractBufferedFile):
    """A read-only file: ranged gets of the version opened."""

    def __init__(self, fs: ObjectStoreFileSystem, path: str, mode: str, **kwargs: Any) -> None:
        self._client, _, self._key = fs._split(path)
        size, _, self._etag = self._client.head(self._key)
        super().__init__(fs, path, mode, size=size, **kwargs)

    def _fetch_range(self, start: int, end: int) -> bytes:
        end = min(end, self.size)
        if end <= start:
            return b""
        return bytes(self._client.get(self._key, start, end - start, self._etag or None))  # type: ignore[call-overload]


class _ObjectWriter(io.BytesIO):
    """A write-only file put whole, atomically, when closed; inside an fsspec transaction
    (``autocommit=False``) when the transaction commits. A ``with`` block left by an error
    puts nothing."""

    def __init__(self, fs: ObjectStoreFileSystem, path: str, exclusive: bool, autocommit: bool) -> None:
        super().__init__()
        self._client, _, self._key = fs._split(path)
        if not self._key:
            raise IsADirectoryError(path)
        self._exclusive = exclusive
        self._autocommit = autocommit
        self._data: bytes | None = None
        self.path = path

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        if kind is not None:
            self._autocommit = False  # discarded
            self._data = None
            super().close()
            return
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self._data = self.getvalue()
        super().close()
        if self._autocommit:
            self.commit()

    def commit(self) -> None:
        data, self._data = self._data, None
        if data is not None:
            self._client.put(self._key, [memoryview(data)], self._exclusive)

    def discard(self) -> None:
        self._data = None


_classes: dict[str, type[ObjectStoreFileSystem]] = {}
_register_lock = threading.Lock()


def filesystem_class(scheme: str) -> type[ObjectStoreFileSystem]:
    """The filesystem class of `scheme` (one of SCHEMES), one per scheme so that fsspec
    never hands the filesystem of one store out for another."""
    if scheme not in SCHEMES:
        raise ValueError(f"{scheme!r} is not one of {SCHEMES}")
    with _register_lock:
        cls = _classes.get(scheme)
        if cls is None:
            name = f"Nebulite{scheme.capitalize()}FileSystem"
            cls = _classes[scheme] = type(name, (ObjectStoreFileSystem,), {"protocol": scheme})
        return cls


def register_missing() -> list[str]:
    """Registers nebulite's filesystem with fsspec for each scheme whose own fsspec package
    is not installed (and that nothing else registered); returns those schemes."""
    registered = []
    for scheme in SCHEMES:
        if scheme in fsspec.registry:
            continue
        package = PACKAGES.get(scheme)
        if package is not None and importlib.util.find_spec(package) is not None:
            continue
        fsspec.register_implementation(scheme, filesystem_class(scheme), clobber=True)
        registered.append(scheme)
    return registered

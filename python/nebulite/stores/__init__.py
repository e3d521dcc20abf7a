"""Object-store clients: one duck-typed interface for Azure Blob, S3 and GCS.

The C++ storage driver holds one client per store URL and calls it with the GIL held; the
clients release the GIL while bytes move (obstore does in Rust; the GCS client in socket
I/O). Keys are relative to the URL's prefix, '/'-separated, never starting with '/'.

    client = open_client("s3://bucket/prefix")
    client.url                                   # the URL, for messages
    client.put(key, [memoryview, ...], if_absent)  # atomic; FileExistsError if if_absent
    client.get(key, offset, length, etag)        # buffer of bytes [offset, offset+length)
    client.head(key)                             # (size, mtime_ns, etag)
    client.list(prefix, recursive)               # ([(key, size, mtime_ns)], [dir_key])
    client.copy(src, dst)
    client.delete(key)                           # a missing key is not an error
    client.abort_stale_uploads(older_than)       # keys of the uploads it aborted

Contract of `put`: `data` are read-only memoryviews over memory that is valid only during
the call; the client keeps no reference to them once it returns (or raises), and copies
at most a part at a time, never the whole object. Large objects go as parallel multipart
(Azure: blocks, S3: multipart upload, GCS: parallel composite upload).

Errors: FileNotFoundError, FileExistsError, :class:`ObjectChangedError` (the `etag` given to
`get` is no longer the object's), PermissionError (as
:class:`nebulite.errors.StoragePermissionError`); anything else an :class:`ObjectStoreError`
naming the URL, the key and the store's message. Transient failures (HTTP 408, 429, 5xx,
resets, timeouts) are retried with exponential backoff and jitter, at most 10 times and
for at most ``NEBULITE_STORE_RETRY_SECONDS`` (60 by default) from the first attempt.

Tunables (environment, read when a client is opened):

* ``NEBULITE_STORE_PART_BYTES``: part size of multipart uploads (default 16 MiB);
* ``NEBULITE_STORE_CONCURRENCY``: parts in flight per call (default 8);
* ``NEBULITE_STORE_RETRY_SECONDS``: the retry bound above.

Thread-safety: a client may be used from several threads at once.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Protocol, Sequence

from nebulite.errors import InvalidArgumentError, StorageError

__all__ = [
    "SCHEMES",
    "ObjectChangedError",
    "ObjectClient",
    "ObjectStoreError",
    "StoreTuning",
    "is_url",
    "open_client",
]

#: The URL schemes open_client() accepts (plain paths and file:// are the file driver's).
SCHEMES = ("az", "abfs", "abfss", "s3", "gs")

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class ObjectStoreError(StorageError):
    """An object-store operation failed (after the retries, where it was transient)."""


class ObjectChangedError(ObjectStoreError):
    """The object is no longer the version read before (its etag changed)."""


class ObjectClient(Protocol):
    """The interface every client implements; see the module docstring."""

    url: str

    def put(self, key: str, data: Sequence[memoryview], if_absent: bool) -> None: ...
    def get(self, key: str, offset: int, length: int, etag: str | None) -> object: ...
    def head(self, key: str) -> tuple[int, int, str]: ...
    def list(
        self, prefix: str, recursive: bool
    ) -> tuple[list[tuple[str, int, int]], list[str]]: ...
    def copy(self, src: str, dst: str) -> None: ...
    def delete(self, key: str) -> None: ...
    def abort_stale_uploads(self, older_than: float) -> list[str]: ...


def check_version(client: ObjectClient, key: str, etag: str | None) -> int:
    """The size of `key` now, after checking that it is still the version `etag` names
    (ObjectChangedError otherwise; None checks nothing)."""
    size, _, current = client.head(key)
    if etag and current != etag:
        raise ObjectChangedError(f"{client.url}/{key}: the object changed since it was read")
    return size


@dataclass(frozen=True)
class StoreTuning:
    part_bytes: int = 16 << 20
    concurrency: int = 8
    retry_seconds: float = 60.0
    max_retries: int = 10

    @classmethod
    def from_env(cls) -> "StoreTuning":
        def number(name: str, default, kind, minimum):
            raw = os.environ.get(name)
            if raw is None or raw.strip() == "":
                return default
            try:
                value = kind(raw)
            except ValueError:
                value = None
            if value is None or value < minimum:
                raise InvalidArgumentError(f"{name}={raw!r}: expected a number >= {minimum}")
            return value

        return cls(
            part_bytes=number("NEBULITE_STORE_PART_BYTES", cls.part_bytes, int, 1 << 20),
            concurrency=number("NEBULITE_STORE_CONCURRENCY", cls.concurrency, int, 1),
            retry_seconds=number("NEBULITE_STORE_RETRY_SECONDS", cls.retry_seconds, float, 0),
        )


def is_url(path: object) -> bool:
    """True for "scheme://..." other than file:// (which names a local path)."""
    if not isinstance(path, str):
        path = os.fspath(path) if isinstance(path, os.PathLike) else None
        if not isinstance(path, str):
            return False
    m = _URL.match(path)
    return m is not None and m.group(1).lower() != "file"


def open_client(url: str) -> ObjectClient:
    """A client for `url` (az://, abfs[s]://, s3://, gs://), with credentials from the
    environment as each store's own tools find them (see _obstore.py and _gcs.py)."""
    m = _URL.match(url) if isinstance(url, str) else None
    scheme = m.group(1).lower() if m else ""
    if scheme not in SCHEMES:
        raise InvalidArgumentError(
            f"unsupported storage URL {url!r}: supported are "
            + ", ".join(f"{s}://" for s in SCHEMES)
            + ", plain paths and file://"
        )
    rest = url[m.end() :]  # type: ignore[union-attr]
    container, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not container:
        raise InvalidArgumentError(f"storage URL {url!r} names no bucket or container")
    tuning = StoreTuning.from_env()
    if scheme == "gs":
        from nebulite.stores._gcs import GcsClient

        return GcsClient(url, container, prefix, tuning)
    from nebulite.stores._obstore import ObstoreClient

    return ObstoreClient(url, scheme, container, prefix, tuning)

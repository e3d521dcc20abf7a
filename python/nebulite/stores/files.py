"""Small files at object-store URLs: what a framework keeps beside its checkpoints.

Lightning names each checkpoint by a path in its checkpoint directory; with a directory
such as ``s3://bucket/run`` those paths are URLs, and nebulite keeps a small pointer file at
each (see nebulite/integrations/_lightning_io.py). These functions read, write, list and
remove such files through the same clients the storage driver uses (:func:`open_client`).
A directory of an object store is only a common prefix of keys: it exists while a key lies
below it, and making one is a no-op.

    kind(url)                 # "file", "directory" or None
    stat(url)                 # Entry of a file (FileNotFoundError if there is none)
    listdir(url)              # (files as Entry, directory URLs), each sorted
    read_bytes(url, limit)    # the file's bytes (ValueError past `limit` bytes)
    write_bytes(url, data)    # one atomic put: readers see the old bytes or the new
    remove(url)               # a missing file is not an error
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nebulite.errors import InvalidArgumentError
from nebulite.stores import _URL, SCHEMES, ObjectClient, open_client

__all__ = ["Entry", "kind", "list_below", "listdir", "lookup", "read_bytes", "remove", "split", "stat",
           "write_bytes"]


@dataclass(frozen=True)
class Entry:
    """A file: its URL, its size in bytes and when it was last written (ns since the epoch)."""

    url: str
    size: int
    mtime_ns: int


def split(url: str) -> tuple[str, str]:
    """(``scheme://container``, key) of `url`; the key has no leading or trailing '/'."""
    m = _URL.match(url)
    if m is None or m.group(1).lower() not in SCHEMES:
        raise InvalidArgumentError(
            f"{url!r} is not an object-store URL: supported are "
            + ", ".join(f"{s}://" for s in SCHEMES))
    container, _, key = url[m.end():].partition("/")
    if not container:
        raise InvalidArgumentError(f"storage URL {url!r} names no bucket or container")
    return f"{m.group(1).lower()}://{container}", key.strip("/")


def _client(url: str) -> tuple[ObjectClient, str, str]:
    root, key = split(url)
    return open_client(root), root, key


def lookup(client: ObjectClient, key: str) -> Optional[tuple[str, int, int]]:
    """What `key` is in `client`'s store: ("file", size, mtime_ns), ("directory", 0, 0)
    (a prefix with keys below it; the root always is one) or None for neither. The one
    place that says what a directory of an object store is."""
    if not key:
        return ("directory", 0, 0)
    try:
        size, mtime_ns, _ = client.head(key)
        return ("file", size, mtime_ns)
    except (FileNotFoundError, IsADirectoryError):
        pass
    files, dirs = client.list(key + "/", False)
    return ("directory", 0, 0) if files or dirs else None


def list_below(client: ObjectClient, key: str) -> tuple[list[tuple[str, int, int]], list[str]]:
    """The files ((key, size, mtime_ns)) and directory keys directly below `key`, sorted."""
    files, dirs = client.list(key + "/" if key else "", False)
    return sorted(files), sorted(dirs)


def stat(url: str) -> Entry:
    client, root, key = _client(url)
    if not key:
        raise FileNotFoundError(url)
    size, mtime_ns, _ = client.head(key)
    return Entry(f"{root}/{key}", size, mtime_ns)


def kind(url: str) -> Optional[str]:
    """"file" for an object at `url`, "directory" for a prefix with keys below it (a
    container's root always is one), None for neither."""
    client, _, key = _client(url)
    found = lookup(client, key)
    return found[0] if found else None


def listdir(url: str) -> tuple[list[Entry], list[str]]:
    """The files directly below `url` and the URLs of the directories there."""
    client, root, key = _client(url)
    files, dirs = list_below(client, key)
    return [Entry(f"{root}/{k}", size, mtime) for k, size, mtime in files], [f"{root}/{d}" for d in dirs]


def read_bytes(url: str, limit: int) -> bytes:
    """The bytes of the file at `url`; ValueError when it holds more than `limit`."""
    client, _, key = _client(url)
    if not key:
        raise IsADirectoryError(url)
    size, _, etag = client.head(key)
    if size > limit:
        raise ValueError(f"{url}: {size} bytes, more than the {limit} expected")
    return bytes(client.get(key, 0, size, etag or None))  # type: ignore[call-overload]


def write_bytes(url: str, data: bytes) -> None:
    client, _, key = _client(url)
    if not key:
        raise IsADirectoryError(url)
    client.put(key, [memoryview(data)], False)


def remove(url: str) -> None:
    client, _, key = _client(url)
    if key:
        client.delete(key)

"""What the commands read from a store, through the same functions the API uses
(``nebulite._core``, i.e. the store's driver): committed versions, their manifests and
data files, and the version directories that were never committed."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from .. import _core
from .._config import parse_path
from ..errors import CorruptCheckpointError, NebuliteError, NotFoundError


def root_of(path: str) -> str:
    """The store a PATH argument names, as ``init(persistent_storage_path=PATH)`` reads it."""
    return parse_path("PATH", path)


@dataclass
class DataFile:
    rank: int
    name: str
    size: int
    crc32: int
    path: str  # relative to the store's root


@dataclass
class Version:
    """One committed version of a tag, with its files (empty when `damaged` says why its
    manifests cannot be read)."""

    tag: str
    version: str
    seq: int
    time_unix_ns: int
    world_size: int
    files: list[DataFile] = field(default_factory=list)
    damaged: str | None = None

    @property
    def names(self) -> list[str]:
        return sorted({f.name for f in self.files})

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


def committed(root: str, with_files: bool = True) -> list[Version]:
    """Every committed version in the store, newest commit first. Catalog problems (a
    damaged commit marker) are warnings."""
    entries, problems = _core.read_catalog(root)
    for p in problems:
        warnings.warn(f"nebulite: {p}", stacklevel=2)
    out = [Version(e["tag"], e["version"], int(e["seq"]), int(e["time_unix_ns"]),
                   int(e["world_size"])) for e in entries]
    if with_files:
        for v in out:
            read_files(root, v)
    out.sort(key=lambda v: v.seq, reverse=True)
    return out


def read_files(root: str, v: Version) -> None:
    """Fills v.files from its manifests (or v.damaged)."""
    try:
        for rank in range(v.world_size):
            m = _core.read_manifest(root, v.tag, v.version, rank)
            v.files += [DataFile(rank, name, int(size), int(crc),
                                 _core.data_file_path(v.tag, v.version, rank, name))
                        for name, size, crc in m["files"]]
    except (CorruptCheckpointError, NotFoundError) as e:
        v.files, v.damaged = [], str(e)


def find(root: str, tag: str, version: str | None = None) -> Version:
    """The newest committed version of `tag` (or that `version` of it)."""
    _core.validate_tag(tag)
    for v in committed(root, with_files=False):
        if v.tag == tag and version in (None, v.version):
            read_files(root, v)
            if v.damaged:
                raise CorruptCheckpointError(f"checkpoint {tag!r} ({v.version}): {v.damaged}")
            return v
    what = f"version {version!r} of {tag!r}" if version else repr(tag)
    raise NotFoundError(f"no committed checkpoint {what} in {root}")


def uncommitted(root: str) -> list[tuple[str, str]]:
    """(tag, version) of each version directory without a commit marker: in progress, or
    left by a run that died (``nebulite gc`` removes those)."""
    out = []
    for tag in _core.list_dir(root, ""):
        if tag.startswith("."):
            continue
        try:
            _core.validate_tag(tag)
            versions = _core.list_dir(root, tag)
        except NebuliteError:
            continue  # not a tag's directory (checkpointHistories.csv, a user's file)
        for version in versions:
            if _core.parse_version_name(version) is None:
                continue
            if not _core.path_exists(root, _core.commit_marker_path(tag, version)):
                out.append((tag, version))
    return out

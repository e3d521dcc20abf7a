"""Lightning's ``CheckpointIO`` through nebulite, apart from the Lightning package that hosts
it (``lightning`` or ``pytorch_lightning``; see lightning.py and pytorch_lightning.py).

Lightning names every checkpoint by a path. Here the path's base name is the nebulite tag,
the checkpoint dict is the object ``checkpoint`` of that tag, and the path itself becomes a
symbolic link to the committed data file, a ``torch.save`` archive: Lightning's own
filesystem checks (``ckpt_path="last"``), ``torch.load`` and ``load_from_checkpoint`` all
work on it. With an object store as the persistent path, where no link can lead, the path
is a small JSON pointer file naming the store, tag and version instead: Lightning's checks
and this IO's loads work on it; ``torch.load`` does not (load through the trainer, or
``nebulite.get_checkpoint``).

Lightning's checkpoint directory may itself be an object store's URL (``dirpath=
"s3://bucket/run"``): its paths are then pointer objects there, written and read through
nebulite's clients (nebulite.stores.files). Lightning reaches that directory through fsspec;
for a scheme whose fsspec package (s3fs, adlfs, gcsfs) is not installed, importing this
module registers nebulite's own filesystem for it (nebulite.stores._fsspec).

The life of a path (Lightning saves and removes on global rank 0 only):

1. ``save_checkpoint`` first persists what the other paths name that is held in memory
   only (the memory tier keeps only the newest checkpoint it is not persisting, and a
   path must not name one that left memory unwritten), then stages a new version of the
   tag, commits it (in memory) and returns.
2. A link only ever names a version in the store or being persisted. A path that names
   nothing valid links to its newest version being persisted; a path that does keeps its
   target until a newer version is committed in the store, so it never stops naming a
   loadable checkpoint. Every call (save, remove, load, teardown) moves links so, and
   deletes the versions no path names any more (superseded ones, those of removed paths)
   once a newer version is committed in the store: as retention does, never the newest,
   commit marker first.
3. ``teardown`` persists what the paths name that is held in memory only, waits for all
   persistence (raising its errors) and settles the links.

Lightning pickles its CheckpointIO and callbacks into the processes it spawns
(``strategy="ddp_spawn"``), where nebulite is not initialised: both carry the configuration
of the process that pickled them, and a process without a session of its own adopts it
(``carry_config``, ``adopt_carried``).

Not thread-safe: Lightning calls a CheckpointIO from its training loop only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import posixpath
import re
import shutil
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .. import _core, api
from .._config import Config, is_store_url, parse_path, store_exists
from ..errors import InvalidArgumentError, NotFoundError
from ..stores import _fsspec, files

_fsspec.register_missing()

log = logging.getLogger("nebulite")

#: The object name every Lightning checkpoint is saved under; what Nebula's
#: ``get_latest_checkpoint_path("checkpoint", persist_path)`` looks for.
CHECKPOINT_NAME = "checkpoint"

#: The keys of ``trainer.save_checkpoint(..., storage_options=...)`` understood here.
STORAGE_OPTIONS = ("is_best", "persist_path")

#: Why a save off the main thread is refused (the one place that says it).
WRAPPED_REFUSAL = (
    "NebulaCheckpointIO saves on Lightning's training thread only: its saves already return "
    "once the checkpoint is in memory and persist in the background, so wrapping it in "
    "AsyncCheckpointIO (which saves on a thread of its own, removes checkpoints on another "
    "and never passes teardown on) gains nothing and would leave links to uncommitted "
    "checkpoints. Pass NebulaCheckpointIO() itself: Trainer(plugins=[NebulaCheckpointIO()])"
)

def refuse_url(path: Any) -> None:
    """Lightning's checkpoint paths are local paths or object-store URLs here: any other URL
    (``memory://...``, ``hdfs://...``) is refused instead of becoming a directory named after
    its scheme."""
    if path is not None and "://" in os.fspath(path):
        parse_path("Lightning's checkpoint path", os.fspath(path))  # refuses, naming the schemes


# -- Lightning's paths: local paths, or object-store URLs -----------------------------


def _key(path: str | os.PathLike[str]) -> str:
    """The one spelling of a checkpoint path: absolute, or a URL without trailing '/'."""
    p = os.fspath(path)
    return p.rstrip("/") if is_store_url(p) else os.path.abspath(p)


def _same_directory(a: str, b: str) -> bool:
    if is_store_url(a) or is_store_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _kind(key: str) -> Optional[str]:
    """"file", "directory" or None for what is at `key` (links followed: a dangling one
    is None)."""
    if is_store_url(key):
        return files.kind(key)
    if os.path.isfile(key):
        return "file"
    return "directory" if os.path.isdir(key) else None


def _remove(key: str) -> None:
    if is_store_url(key):
        if files.kind(key) == "file":
            files.remove(key)
    elif os.path.islink(key) or os.path.isfile(key):
        os.unlink(key)
    elif os.path.isdir(key):
        shutil.rmtree(key)


def carry_config(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (an object's ``__dict__`` being pickled) plus this process's nebulite
    configuration under ``_carried_config``."""
    return dict(state, _carried_config=api._config())


def adopt_carried(config: Optional[Config]) -> None:
    """In a process without a nebulite session (one Lightning spawned), initialises nebulite
    as the process that pickled the IO or callback was, for one rank (Lightning saves whole
    checkpoints on global rank 0).

    That process holds the store's writer lease for the job and outlives this one, so this
    one takes none (``shared_store``): as another run, it would be refused the store."""
    if config is not None and api._config() is None:
        log.info("nebulite: initialising as the process that started this one was")
        api._open(dataclasses.replace(config, rank=0, world_size=1, shared_store=True))


_RANK_DIR = re.compile(r"^rank(0|[1-9][0-9]*)$")


@dataclass(frozen=True)
class _Version:
    """One committed version of a tag in the store rooted at `root`."""

    root: str
    tag: str
    version: str

    @property
    def directory(self) -> str:
        return posixpath.join(self.root, self.tag, self.version)

    @property
    def data_file(self) -> str:
        return posixpath.join(self.root, _core.data_file_path(self.tag, self.version, 0, CHECKPOINT_NAME))

    def in_store(self) -> bool:
        return store_exists(self.root) and bool(
            _core.path_exists(self.root, _core.commit_marker_path(self.tag, self.version)))

    @property
    def linkable(self) -> bool:
        """Whether a local path can link to its data file (not in an object store: there the
        path is a pointer file, see _write_pointer)."""
        return not is_store_url(self.root)


@dataclass
class _PathState:
    current: Optional[_Version] = None  # what the link names: committed in the store
    pending: list[_Version] = field(default_factory=list)  # saved since, oldest first


def _version_of_file(path: str) -> Optional[_Version]:
    """The version a data file path `<root>/<tag>/<version>/rank<R>/<name>` lies in."""
    url = is_store_url(path)
    parts = (path.rstrip("/") if url else os.path.normpath(path)).split("/")
    if len(parts) < 5 or not _RANK_DIR.match(parts[-2]) or not _core.parse_version_name(parts[-3]):
        return None
    root = "/".join(parts[:-4]) or "/"
    config = api._config()
    if config and config.persistent_storage_path and not url and \
            os.path.realpath(config.persistent_storage_path) == root:
        root = config.persistent_storage_path  # the spelling the session knows its memory tier by
    return _Version(root, parts[-4], parts[-3])


def _delete_version(v: _Version) -> None:
    """Deletes a committed version the way retention does (docs/format.md, Retention):
    the commit marker first, durably, then the files, then the tag's directory if empty."""
    try:
        _core.retire_version(v.root, v.tag, v.version)
    except (NotFoundError, OSError) as e:
        log.warning("nebulite: cannot delete %s: %s", v.directory, e)


def _link(path: str, target: str) -> None:
    """Makes `path` a symbolic link to `target` (relative, so that a store moved together
    with the checkpoint directory keeps working), replacing what was there atomically."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.nebulite-{os.getpid()}")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    os.symlink(os.path.relpath(target, directory), tmp)
    os.replace(tmp, path)


#: The first key of a pointer file (see _write_pointer).
POINTER_KEY = "nebulite_checkpoint"
_POINTER_MAX_BYTES = 4096


def _write_pointer(path: str, v: _Version) -> None:
    """Makes `path` a pointer file naming version `v` of an object store, replacing what was
    there atomically: a small JSON object ``{"nebulite_checkpoint": 1, "store": <URL>, "tag":
    ..., "version": ...}``. It is what a link is on a disk: Lightning's own checks of the path
    (``ckpt_path="last"``, ``os.path.exists``) see a file, and this IO loads what it names.
    At an object-store URL it is one object, put whole."""
    data = (json.dumps({POINTER_KEY: 1, "store": v.root, "tag": v.tag, "version": v.version}) + "\n").encode()
    if is_store_url(path):
        files.write_bytes(path, data)
        return
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.nebulite-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_pointer(path: str) -> Optional[_Version]:
    """The version the pointer file at `path` names; None for any other file."""
    try:
        if is_store_url(path):  # the store's own errors (unreachable, refused) propagate
            raw = files.read_bytes(path, _POINTER_MAX_BYTES)
        else:
            if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > _POINTER_MAX_BYTES:
                return None
            with open(path, "rb") as f:
                raw = f.read()
        data = json.loads(raw)
    except (FileNotFoundError, IsADirectoryError, ValueError):  # nothing there, too large, not JSON
        return None
    except OSError:
        if is_store_url(path):
            raise
        return None
    if not isinstance(data, dict) or data.get(POINTER_KEY) != 1:
        return None
    try:
        return _Version(str(data["store"]), str(data["tag"]), str(data["version"]))
    except KeyError:
        return None


def _point(path: str, v: _Version) -> None:
    """Makes `path` name `v`: a link to its data file, or a pointer file where no link can
    lead (an object store holds `v`, or `path` itself is in one)."""
    if v.linkable and not is_store_url(path):
        _link(path, v.data_file)
    else:
        _write_pointer(path, v)


class NebulaCheckpointIOMixin:
    """The behaviour of ``NebulaCheckpointIO``; see the module docstring."""

    #: Loads a file nebulite did not write, as Lightning's own TorchCheckpointIO would
    #: (set by the flavour module to its package's ``cloud_io._load``).
    _torch_load: Callable[..., Any]
    #: Writes a file as Lightning's own TorchCheckpointIO would, atomically (set by the
    #: flavour module to its package's ``cloud_io._atomic_save``).
    _torch_save: Callable[[dict[str, Any], str], None]

    def __init__(self) -> None:
        super().__init__()
        self._paths: dict[str, _PathState] = {}
        self._doomed: list[_Version] = []
        self._best_hint = False
        self._warned_memory_only = False
        #: The path of the last checkpoint saved with ``is_best`` (None before).
        self.best_path: Optional[str] = None
        self._carried_config: Optional[Config] = None

    def __getstate__(self) -> dict[str, Any]:
        return carry_config(self.__dict__)

    # -- CheckpointIO ---------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Optional[Any] = None
    ) -> None:
        """Stages `checkpoint` as object ``checkpoint`` of tag ``basename(path)`` and returns
        once it is in memory; see the module docstring for what `path` becomes.

        `storage_options` may hold ``is_best`` (persist this checkpoint at once, whatever
        ``persistent_time_interval`` says) and ``persist_path`` (the persistent storage path
        to save to: a local or mounted directory, or an object store's URL such as
        ``s3://bucket/run``; nebulite is initialised, or re-initialised, with it). With an
        object store, `path` becomes a small pointer file naming the checkpoint in the store
        instead of a link (this IO loads what it names).
        """
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError(WRAPPED_REFUSAL)
        refuse_url(path)
        is_best, persist_path = self._parse_storage_options(storage_options)
        self._ensure_session(persist_path)
        key = _key(path)
        tag = posixpath.basename(key)
        if tag.startswith("."):
            # Not a checkpoint: a hidden file of Lightning's own, such as the ".temp.ckpt"
            # that carries the trained weights from a process ddp_spawn started back to the
            # main process (which loads it, then removes it). Written as Lightning would.
            self._torch_save(checkpoint, key)
            return
        config = api._config()
        root = config.persistent_storage_path if config else None
        if root and _same_directory(os.path.dirname(key), root):
            raise InvalidArgumentError(
                f"{type(self).__name__}: {key} lies in nebulite's persistent path itself, where "
                f"the directory of tag {tag!r} goes: save Lightning's checkpoints to another "
                "directory (a subdirectory of the persistent path will do)"
            )
        # The memory tier keeps only the newest of the checkpoints not being persisted: what
        # other paths name must reach the store before this save can push it out of memory.
        api._persist_versions(self._newest_pending(but=key))
        handle = api.Checkpoint(tag, num_files=1)
        handle.save(CHECKPOINT_NAME, checkpoint)
        saved = self._written(handle)
        if is_best:
            api._persist_versions([(tag, saved.version)])
            self.best_path = key
        if not saved.root:
            self._warn_memory_only()
            return
        state = self._paths.get(key)
        if state is None:
            state = self._paths[key] = _PathState(current=self._linked_version(key))
        state.pending.append(saved)
        self._settle()

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Optional[Any] = None,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Loads the checkpoint at `path`: the version this process last saved there, else
        the one its link names, else (for a path that does not exist) the newest committed
        checkpoint of tag ``basename(path)``; memory tier first. A file nebulite did not
        write is read with ``torch.load``.

        ``weights_only`` has ``torch.load``'s meaning and default (True unless given, and
        torch's ``TORCH_FORCE_(NO_)WEIGHTS_ONLY_LOAD`` switches apply): Lightning's own
        checkpoints hold only tensors and plain Python values. For a checkpoint you trust
        that holds other objects (say, a hyperparameter of your own class), pass
        ``trainer.fit(..., weights_only=False)``.
        """
        self._settle()
        key = _key(path)
        handle = self._find(key)
        if handle is None:
            if _kind(key) is not None:  # not nebulite's: say, saved by torch.save before switching
                return self._torch_load(key, map_location=map_location, weights_only=weights_only)
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return handle.load(CHECKPOINT_NAME, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Removes `path` from Lightning's view at once; the versions it named are deleted
        from the store once a newer version is committed there (retention's rule)."""
        key = _key(path)
        state = self._paths.pop(key, None) or _PathState(current=self._linked_version(key))
        self._doomed.extend(([state.current] if state.current else []) + state.pending)
        _remove(key)
        self._settle()

    def teardown(self) -> None:
        """Persists what the paths name that is in memory only, waits until every pending
        checkpoint is committed in the store, raises any background persistence error
        (``nebulite.PersistError``), and settles the links."""
        if not self._paths and not self._doomed:
            return
        if api._config() is not None:
            api._persist_versions(self._newest_pending())
            api.flush_persistence()
        self._settle()

    # -- helpers ----------------------------------------------------------------

    @contextlib.contextmanager
    def _saving_best(self, is_best: bool) -> Iterator[None]:
        """Saves within count as ``is_best`` unless storage_options say otherwise
        (NebulaCallback marks the save that becomes ``best_model_path``)."""
        self._best_hint = is_best
        try:
            yield
        finally:
            self._best_hint = False

    def _parse_storage_options(self, storage_options: Optional[Any]) -> tuple[bool, Optional[str]]:
        if storage_options is None:
            return self._best_hint, None
        if not isinstance(storage_options, Mapping):
            raise TypeError(
                f"{type(self).__name__}: storage_options must be a dict with keys among "
                f"{list(STORAGE_OPTIONS)}, got {type(storage_options).__name__}"
            )
        unknown = sorted(set(storage_options) - set(STORAGE_OPTIONS))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}: unknown storage_options {unknown}; "
                f"the keys understood are {list(STORAGE_OPTIONS)}"
            )
        persist_path = storage_options.get("persist_path")
        if persist_path is not None:  # a URL is refused here, before anything is saved
            persist_path = parse_path("storage_options['persist_path']", persist_path)
        is_best = bool(storage_options.get("is_best", self._best_hint))
        return is_best, persist_path

    def _ensure_session(self, persist_path: Optional[str]) -> None:
        """nebulite initialised for one rank (Lightning saves the whole checkpoint on global
        rank 0), at `persist_path` when given."""
        adopt_carried(self._carried_config)
        config = api._config()
        if config is None:
            kwargs: dict[str, Any] = {"rank": 0, "world_size": 1}
            if persist_path is not None:
                kwargs["persistent_storage_path"] = persist_path
            api.init(**kwargs)
        elif persist_path is not None and config.persistent_storage_path != persist_path:
            log.info("nebulite: persist_path %s: re-initialising nebulite with it", persist_path)
            api._reopen_with_path(persist_path)
        info = api.session_info()
        if info["world_size"] > 1:
            raise InvalidArgumentError(
                f"{type(self).__name__}: nebulite was initialised for {info['world_size']} ranks, but "
                "Lightning saves the whole checkpoint on global rank 0 alone, so a commit would wait "
                "for the others forever. Initialise it before torch.distributed starts, with "
                "nebulite.init(..., rank=0, world_size=1), or through NebulaCallback(config_params=...)."
            )

    @staticmethod
    def _written(handle: api.Checkpoint) -> _Version:
        """The version `handle` committed: in memory, or (with asynchronous staging) once
        the next optimizer step or nebulite call finds its copies landed."""
        config = api._config()
        root = config.persistent_storage_path if config else None
        assert handle._written is not None
        return _Version(root or "", handle.tag, handle._written)

    def _warn_memory_only(self) -> None:
        if not self._warned_memory_only:
            self._warned_memory_only = True
            warnings.warn(
                "nebulite has no persistent storage path: Lightning's checkpoints live in memory "
                "only, and the paths Lightning records do not exist on disk. Set one with "
                "NebulaCallback(config_params={'persistent_storage_path': ...}) or nebulite.init().",
                stacklevel=3,
            )

    def _newest_pending(self, but: Optional[str] = None) -> list[tuple[str, str]]:
        """(tag, version) of the newest checkpoint saved at each path (but `but`) that is
        not known to be in the store yet."""
        return [(s.pending[-1].tag, s.pending[-1].version)
                for key, s in self._paths.items() if s.pending and key != but]

    @staticmethod
    def _linked_version(key: str) -> Optional[_Version]:
        """The version the (possibly dangling) link at `key` names, if it is nebulite's."""
        if is_store_url(key) or not os.path.islink(key):
            return _read_pointer(key)
        return _version_of_file(os.path.realpath(key))

    def _find(self, key: str) -> Any:
        """A handle on the committed version `key` holds, or None."""
        candidates: list[_Version] = []
        state = self._paths.get(key)
        if state is not None:  # what this process saved there, newest first
            candidates += reversed(state.pending)
            candidates += [state.current] if state.current else []
        linked = self._linked_version(key)
        kind = _kind(key)
        if linked is None and kind == "file":  # a data file given directly
            linked = _version_of_file(key if is_store_url(key) else os.path.realpath(key))
        if linked is not None:
            candidates.append(linked)
        for v in candidates:
            handle = api.get_checkpoint(tag=v.tag, persist_path=v.root or None, version=v.version)
            if handle.tag:
                return handle
        if kind is not None and linked is None:
            return None  # a file of its own, not nebulite's
        # Nothing there (or a link to a version that is gone): the newest of the tag, as
        # Nebula did for trainer.fit(ckpt_path=".../<tag>").
        tag = posixpath.basename(key)
        try:
            handle = api.get_checkpoint(tag=tag, persist_path=linked.root if linked else None)
        except InvalidArgumentError:
            return None
        return handle if handle.tag else None

    def _settle(self) -> None:
        """Moves links to the newest of their versions committed in the store (a path that
        names nothing valid meanwhile links to the newest on its way there), and deletes the
        versions no path names any more once a newer one is committed in the store.

        A link only ever names a version in the store or being persisted: one that stays in
        memory may be superseded and dropped, and the link would dangle."""
        in_flight = self._in_flight()
        for key, state in self._paths.items():
            stored = [i for i, v in enumerate(state.pending) if v.in_store()]
            if stored:
                i = stored[-1]
                newest = state.pending[i]
                if state.current is not None:
                    self._doomed.append(state.current)
                self._doomed.extend(state.pending[:i])
                state.current, state.pending = newest, state.pending[i + 1:]
                if _kind(key) != "directory":
                    _point(key, newest)
            elif _kind(key) is None:
                coming = [v for v in state.pending if (v.tag, v.version) in in_flight]
                if coming and (is_store_url(key) or not coming[-1].linkable or
                               os.path.realpath(key) != os.path.realpath(coming[-1].data_file)):
                    _point(key, coming[-1])  # valid once persisted, even after a crash
        self._collect(in_flight)

    def _collect(self, in_flight: set[tuple[str, str]]) -> None:
        if not self._doomed:
            return
        named = {v for s in self._paths.values() for v in ([s.current] if s.current else []) + s.pending}
        catalogs: dict[str, dict[tuple[str, str], int]] = {}
        keep: list[_Version] = []
        for v in dict.fromkeys(self._doomed):  # unique, in order
            if v in named:
                continue
            if v.root not in catalogs:
                entries, _ = _core.read_catalog(v.root) if store_exists(v.root) else ([], [])
                catalogs[v.root] = {(e["tag"], e["version"]): int(e["seq"]) for e in entries}
            catalog = catalogs[v.root]
            seq = catalog.get((v.tag, v.version))
            if seq is None:
                if (v.tag, v.version) in in_flight:
                    keep.append(v)  # on its way to the store: deleted once it is there
                continue
            if any(other > seq for other in catalog.values()):
                log.info("nebulite: deleting %s (no longer named by Lightning)", v.directory)
                _delete_version(v)
                del catalog[(v.tag, v.version)]
            else:
                keep.append(v)  # the newest in the store: kept until a newer one is committed
        self._doomed = keep

    @staticmethod
    def _in_flight() -> set[tuple[str, str]]:
        session = api._session
        if session is None:
            return set()
        return {
            (v["tag"], v["version"])
            for v in session.engine.versions()
            if v["persist_requested"] and not v["failed"]
        }

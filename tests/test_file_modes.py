"""Permissions of what nebulite writes to a store: the umask by default, as torch.save;
exactly ``file_mode`` when given (stores on shared filesystems)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import nebulite
from nebulite import InvalidArgumentError


@pytest.fixture
def umask():
    old = os.umask(0o022)
    try:
        yield lambda mask: os.umask(mask)
    finally:
        os.umask(old)


def _checkpoint(store: str, **options) -> None:
    nebulite.init(store, **options)
    c = nebulite.Checkpoint("t", 1)
    c.save("model", {"w": torch.ones(16)})
    nebulite.flush_persistence()
    nebulite.shutdown()


#: Files that are the owner's only, whatever file_mode says: run locks and the writer lease.
_PRIVATE = (os.path.join(".nebulite", "lease"), os.path.join(".nebulite", "lease.lock"))


def _modes(store: str) -> tuple[dict[str, int], dict[str, int]]:
    """Modes of nebulite's own files and directories, less the private ones (checked 0600)."""
    files, dirs = {}, {}
    for here, subdirs, names in os.walk(store):
        for d in subdirs:
            dirs[os.path.relpath(os.path.join(here, d), store)] = stat.S_IMODE(
                os.stat(os.path.join(here, d)).st_mode)
        for n in names:
            rel = os.path.relpath(os.path.join(here, n), store)
            mode = stat.S_IMODE(os.stat(os.path.join(here, n)).st_mode)
            if "runs" in rel.split(os.sep) or rel in _PRIVATE:
                assert mode == 0o600, (rel, oct(mode))
            else:
                files[rel] = mode
    return files, dirs


def test_files_follow_the_umask_by_default(store, umask):
    umask(0o002)
    _checkpoint(store)
    files, dirs = _modes(store)
    assert any(f.endswith("COMMITTED") for f in files) and any(f.endswith("model") for f in files)
    assert "checkpointHistories.csv" in files
    assert set(files.values()) == {0o664}, files
    assert set(dirs.values()) == {0o775}, dirs


@pytest.mark.parametrize("mode,given", [(0o640, 0o640), (0o600, "600"), (0o640, "0o640")])
def test_file_mode_is_exact_whatever_the_umask(store, umask, mode, given):
    umask(0o077 if mode == 0o640 else 0o000)
    _checkpoint(store, file_mode=given)
    files, dirs = _modes(store)
    assert set(files.values()) == {mode}, files
    want_dir = mode | ((mode & 0o444) >> 2)
    assert set(dirs.values()) == {want_dir}, dirs
    got = nebulite.get_latest_checkpoint(store).load("model")
    assert torch.equal(got["w"], torch.ones(16))


def test_file_mode_from_the_environment(store, umask, monkeypatch):
    monkeypatch.setenv("NEBULITE_FILE_MODE", "0640")
    _checkpoint(store)
    files, _ = _modes(store)
    assert set(files.values()) == {0o640}


@pytest.mark.parametrize("bad", [0o400, 0o1777, -1, "rw-r-----", "9", 0o4644, True])
def test_a_file_mode_the_owner_cannot_write_is_refused(store, bad):
    with pytest.raises(InvalidArgumentError, match="file_mode"):
        nebulite.init(store, file_mode=bad)
    assert not os.path.exists(store)


def test_file_mode_through_the_node_agent(store, umask, agent_env):
    umask(0o077)  # the agent inherits it; the mode given still holds
    _checkpoint(store, agent=True, file_mode=0o640)
    files, dirs = _modes(store)
    assert any(f.endswith("COMMITTED") for f in files)
    assert set(files.values()) == {0o640}, files
    assert set(dirs.values()) == {0o750}, dirs

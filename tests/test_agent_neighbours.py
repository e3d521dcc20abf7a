"""The node agent among hostile or broken neighbours: a stopped agent, a same-user client
sending absurd numbers, clients that come and go with new ranks, another user's files in
the runtime directory or on the store's lock files."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
import torch

import nebulite
from nebulite.agent import client

from conftest import kill_agents_of


@pytest.fixture
def tmp_base(monkeypatch):
    """$TMPDIR for the runtime directory's default place (short: socket paths are
    limited), with neither NEBULITE_RUNTIME_DIR nor XDG_RUNTIME_DIR set."""
    tmp = Path(tempfile.mkdtemp(prefix="nbtmp-"))
    monkeypatch.delenv("NEBULITE_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp))
    yield tmp
    nebulite.api._reset_for_tests()
    for d in tmp.glob("nebulite-*"):
        if d.is_dir() and not d.is_symlink():
            kill_agents_of(d)
    shutil.rmtree(tmp, ignore_errors=True)


def _taken(path: Path, how: str) -> None:
    """Makes `path` a directory that must not be used: open to others, a symlink to a
    private directory, or (as root) another user's."""
    if how == "mode":
        path.mkdir()
        os.chmod(path, 0o777)
    elif how == "symlink":
        target = path.parent / "elsewhere"
        target.mkdir(mode=0o700)
        path.symlink_to(target)
    else:
        path.mkdir(mode=0o700)
        os.chown(path, 65534, 65534)


@pytest.mark.parametrize("how", ["mode", "symlink"] + (["owner"] if os.getuid() == 0 else []))
def test_a_runtime_directory_taken_by_someone_else_is_passed_over(tmp_base, store, how):
    base = tmp_base / f"nebulite-{os.getuid()}"
    _taken(base, how)
    before = os.lstat(base)
    chosen = client.runtime_dir()
    assert chosen == f"{base}.1"
    st = os.lstat(chosen)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.getuid()
    after = os.lstat(base)  # left as it was
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)
    assert client.runtime_dir() == chosen  # every process finds the same one
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=64 << 20)
    nebulite.Checkpoint("a").save("x", torch.ones(10))
    assert nebulite.get_latest_checkpoint().load("x").sum() == 10
    assert any(Path(chosen).glob("agent-*.sock"))


def test_the_runtime_directory_is_under_xdg_runtime_dir_when_set(tmp_base, monkeypatch):
    xdg = tmp_base / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert client.runtime_dir() == str(xdg / "nebulite")
    assert stat.S_IMODE(os.lstat(xdg / "nebulite").st_mode) == 0o700

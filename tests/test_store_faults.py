"""What a checkpoint store does to nebulite when it misbehaves or is shared: a store the
reader cannot write, an unreadable directory in it, an error that passes, a damaged
version and retention, a reused run id, tags the catalog would never list."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import nebulite
import nebulite.api
from nebulite import _core

from conftest import HANG_TIMEOUT


def _state(value: float) -> dict:
    return {"w": torch.full((64, 64), float(value)), "step": int(value)}


def _unprivileged() -> list[str]:
    """A command prefix that runs a program without the privileges that bypass file
    permissions (root keeps its uid but loses CAP_DAC_OVERRIDE and friends)."""
    return ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(nebulite.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run(_unprivileged() + [sys.executable, "-c", textwrap.dedent(code), *args],
                          env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT)


def _saved_store(store: str, steps: int = 2, retention: int = 0) -> None:
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=retention)
    for i in range(1, steps + 1):
        nebulite.Checkpoint(f"step{i}").save("model", _state(i))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()


def _flip_a_byte(path: str, offset: int = -100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x55]))


def _data_file(store: str, tag: str, name: str = "model") -> str:
    entry = next(e for e in _core.read_catalog(store)[0] if e["tag"] == tag)
    return os.path.join(store, _core.data_file_path(tag, entry["version"], 0, name))


# -- readers that cannot write ---------------------------------------------------------------


def test_a_reader_loads_from_a_store_it_cannot_write(store):
    _saved_store(store)
    os.chmod(store, 0o555)  # nobody may create anything in it
    try:
        out = _run_python("""
            import sys, nebulite
            ck = nebulite.get_latest_checkpoint(persist_path=sys.argv[1])
            print(ck.tag, ck.load("model")["step"])
            print([c["tag"] for c in nebulite.list_checkpoints(persist_path=sys.argv[1])])
            print(nebulite.get_latest_checkpoint_path("model", persist_path=sys.argv[1]))
        """, store)
    finally:
        os.chmod(store, 0o755)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "step2 2"
    assert lines[1] == "['step2', 'step1']"
    assert lines[2].startswith(os.path.join(store, "step2"))
    assert sorted(os.listdir(store)) == sorted(set(os.listdir(store)))  # nothing was added
    assert not any(n.startswith(".nebulite-probe") for n in os.listdir(store))


def test_an_unreadable_directory_in_the_store_is_skipped(store):
    _saved_store(store)
    lost = os.path.join(store, "lost+found")
    os.mkdir(lost, 0o000)  # what ext4 leaves, seen by a user who cannot read it
    try:
        out = _run_python("""
            import sys, warnings, nebulite
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                ck = nebulite.get_latest_checkpoint(persist_path=sys.argv[1])
            print(ck.tag, ck.load("model")["step"])
            print(any("lost+found" in str(x.message) for x in w))
        """, store)
    finally:
        os.chmod(lost, 0o755)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[0] == "step2 2"
    if _unprivileged() or os.geteuid() != 0:
        assert out.stdout.splitlines()[1] == "True"  # reported, not fatal


def test_init_and_saving_survive_an_unreadable_directory(store):
    _saved_store(store)
    lost = os.path.join(store, "lost+found")
    os.mkdir(lost, 0o000)
    try:
        out = _run_python("""
            import sys, torch, nebulite
            nebulite.init(persistent_storage_path=sys.argv[1], agent=False)
            nebulite.Checkpoint("step3").save("model", {"w": torch.ones(3), "step": 3})
            nebulite.flush_persistence()
            print(nebulite.get_latest_checkpoint().tag)
        """, store)
    finally:
        os.chmod(lost, 0o755)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "step3"


# -- errors that pass are not damage ----------------------------------------------------------


def test_a_version_that_could_not_be_read_once_is_found_again(store):
    _saved_store(store)
    entry = next(e for e in _core.read_catalog(store)[0] if e["tag"] == "step2")
    manifest = os.path.join(store, "step2", entry["version"], "rank0.manifest")
    os.rename(manifest, manifest + ".away")  # as a stale NFS handle would, for a moment
    with pytest.warns(UserWarning, match="step2"):
        assert nebulite.get_latest_checkpoint(persist_path=store).tag == "step1"
    os.rename(manifest + ".away", manifest)
    assert nebulite.get_latest_checkpoint(persist_path=store).tag == "step2"


def test_a_data_file_that_could_not_be_read_once_is_found_again(store):
    """EACCES for a moment (a permission being fixed, an expired credential): skipped then,
    not forgotten."""
    _saved_store(store)
    path = _data_file(store, "step2")
    os.chmod(path, 0o000)
    try:
        env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(nebulite.__file__)))
        env["PYTHONPATH"] = pkg_root
        proc = subprocess.Popen(
            _unprivileged() + [sys.executable, "-c", textwrap.dedent("""
                import sys, nebulite
                print(nebulite.get_latest_checkpoint(persist_path=sys.argv[1]).tag, flush=True)
                sys.stdin.readline()  # the parent gives the file back
                print(nebulite.get_latest_checkpoint(persist_path=sys.argv[1]).tag, flush=True)
            """), store], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        first = proc.stdout.readline().strip()
        os.chmod(path, 0o644)
        rest, err = proc.communicate("go\n", timeout=HANG_TIMEOUT)
    finally:
        os.chmod(path, 0o644)
    assert proc.returncode == 0, err[-3000:]
    if _unprivileged() or os.geteuid() != 0:
        assert first == "step1"
    assert rest.strip() == "step2"


# -- damage and retention ---------------------------------------------------------------------


def test_retention_never_counts_a_damaged_version(store):
    """Retention 2: the newest checkpoint is damaged, one more is saved: the intact older
    one is kept as the fallback, and is what loads once the new one is damaged too."""
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=2)
    for i in (1, 2):
        nebulite.Checkpoint(f"step{i}").save("model", _state(i))
        nebulite.flush_persistence()
    _flip_a_byte(_data_file(store, "step2"))
    nebulite.Checkpoint("step3").save("model", _state(3))
    nebulite.flush_persistence()
    committed = [e["tag"] for e in _core.read_catalog(store)[0]]
    assert "step1" in committed and "step3" in committed
    nebulite.api._reset_for_tests()
    _flip_a_byte(_data_file(store, "step3"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = nebulite.get_latest_checkpoint(persist_path=store)
    assert ck.tag == "step1" and ck.load("model")["step"] == 1


def test_list_checkpoints_reports_a_damaged_manifest_instead_of_raising(store):
    _saved_store(store)
    entry = next(e for e in _core.read_catalog(store)[0] if e["tag"] == "step1")
    _flip_a_byte(os.path.join(store, "step1", entry["version"], "rank0.manifest"), 20)
    listed = {c["tag"]: c for c in nebulite.list_checkpoints(persist_path=store)}
    assert listed["step2"]["damaged"] is None and listed["step2"]["names"] == ["model"]
    assert listed["step1"]["damaged"] and listed["step1"]["names"] == []


# -- names --------------------------------------------------------------------------------------


def test_a_tag_starting_with_a_dot_is_refused(store):
    nebulite.init(persistent_storage_path=store)
    with pytest.raises(nebulite.InvalidArgumentError, match="starts with '.'"):
        nebulite.Checkpoint(".hidden").save("model", _state(1))
    with pytest.raises(nebulite.InvalidArgumentError):
        nebulite.Checkpoint(".hidden", -2)
    nebulite.Checkpoint("step.1").save("model", _state(1))  # a dot elsewhere is fine
    nebulite.flush_persistence()
    assert nebulite.get_latest_checkpoint().tag == "step.1"


def test_a_reused_run_id_never_overwrites_committed_files(store, monkeypatch):
    """A job restarted with the same NEBULITE_RUN_ID continues the version counter: the
    checkpoints of its earlier incarnation stay whole and loadable."""
    monkeypatch.setenv("NEBULITE_RUN_ID", "fixedid")
    _saved_store(store, steps=2)
    before = {e["tag"]: e["version"] for e in _core.read_catalog(store)[0]}
    nebulite.init(persistent_storage_path=store, num_of_version_in_retention=0)
    nebulite.Checkpoint("step1").save("model", _state(101))  # the same tags again
    nebulite.Checkpoint("step2").save("model", _state(102))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    for tag, version in before.items():
        ck = nebulite.get_checkpoint(tag=tag, version=version, persist_path=store)
        assert ck.tag == tag, (tag, version)
        assert ck.load("model")["step"] == int(tag[4:])
    assert nebulite.get_latest_checkpoint(persist_path=store).load("model")["step"] == 102
    versions = [e["version"] for e in _core.read_catalog(store)[0]]
    assert len(versions) == len(set(versions)) == 4


# -- odd entries left by other tools and people ------------------------------------------------


def _version_dir(store: str, tag: str) -> str:
    return os.path.join(store, tag, next(e for e in _core.read_catalog(store)[0]
                                         if e["tag"] == tag)["version"])


def _replace(path: str, make) -> None:
    os.remove(path)
    make(path)


def _link_from_outside(store: str, outside: str, tag: str) -> None:
    """Moves a committed tag out of the store and links it back in under its name."""
    os.rename(os.path.join(store, tag), os.path.join(outside, tag))
    os.symlink(os.path.join(outside, tag), os.path.join(store, tag))


# name -> (how to make it, the checkpoint found before init, text naming it in a warning,
# whether it needs permissions to bite)
_ODD_ENTRIES = {
    "directory named COMMITTED": (
        lambda s, o: os.makedirs(os.path.join(s, "step5", "vzz-000001", "COMMITTED")),
        "step2", "step5/vzz-000001/COMMITTED", False),
    "FIFO named COMMITTED": (
        lambda s, o: (os.makedirs(os.path.join(s, "step5", "vzz-000001")),
                      os.mkfifo(os.path.join(s, "step5", "vzz-000001", "COMMITTED"))),
        "step2", "step5/vzz-000001/COMMITTED", False),
    "data file that is a directory": (
        lambda s, o: _replace(os.path.join(_version_dir(s, "step2"), "rank0", "model"), os.mkdir),
        "step1", "rank0/model", False),
    "data file that is a FIFO": (
        lambda s, o: _replace(os.path.join(_version_dir(s, "step2"), "rank0", "model"), os.mkfifo),
        "step1", "rank0/model", False),
    "manifest that is a FIFO": (
        lambda s, o: _replace(os.path.join(_version_dir(s, "step2"), "rank0.manifest"), os.mkfifo),
        "step1", "rank0.manifest", False),
    "FIFO among the commit number claims": (
        lambda s, o: os.mkfifo(os.path.join(s, ".nebulite", "seq", "%020d" % 99)),
        "step2", None, False),
    "history CSV that is a FIFO": (
        lambda s, o: _replace(os.path.join(s, "checkpointHistories.csv"), os.mkfifo),
        "step2", None, False),
    "symlink loop in the root": (
        lambda s, o: os.symlink("loopy", os.path.join(s, "loopy")),
        "step2", "loopy", False),
    "symlink loop as a version directory": (
        lambda s, o: os.symlink("vzz-000001", os.path.join(s, "step2", "vzz-000001")),
        "step2", "step2/vzz-000001", False),
    "symlink out of the store holding a dead run's version": (
        lambda s, o: (os.makedirs(os.path.join(o, "vdead-000001")),
                      os.utime(os.path.join(o, "vdead-000001"), (1, 1)),
                      os.symlink(o, os.path.join(s, "linked"))),
        "step2", "linked", False),
    "committed tag linked in from outside the store": (
        lambda s, o: _link_from_outside(s, o, "step1"), "step2", None, False),
    "unreadable COMMITTED": (
        lambda s, o: os.chmod(os.path.join(_version_dir(s, "step2"), "COMMITTED"), 0),
        "step1", "COMMITTED", True),
    "unreadable tag directory": (
        lambda s, o: os.chmod(os.path.join(s, "step2"), 0), "step1", "'step2'", True),
    "unreadable foreign directory": (
        lambda s, o: os.mkdir(os.path.join(s, "foreign"), 0), "step2", "'foreign'", True),
}


@pytest.mark.parametrize("odd", list(_ODD_ENTRIES))
def test_an_odd_entry_is_skipped_and_the_rest_of_the_store_works(tmp_path, odd):
    make, latest, named, needs_permissions = _ODD_ENTRIES[odd]
    if needs_permissions and os.geteuid() == 0 and not _unprivileged():
        pytest.skip("running as root without setpriv: file permissions cannot bite")
    store, outside = str(tmp_path / "ckpt"), str(tmp_path / "outside")
    os.makedirs(outside)
    with open(os.path.join(outside, "precious"), "w") as f:
        f.write("not nebulite's")
    _saved_store(store)
    make(store, outside)
    before = {os.path.join(d, n) for d, ds, fs in os.walk(outside) for n in ds + fs}
    try:
        # In a process of its own with a deadline (_run_python): a FIFO opened the blocking
        # way would hang it, and fails the test instead of the suite.
        out = _run_python("""
            import sys, warnings, torch, nebulite
            warnings.simplefilter("always")
            store = sys.argv[1]
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                ck = nebulite.get_latest_checkpoint(persist_path=store)
                print(ck.tag, ck.load("model")["step"])
                nebulite.list_checkpoints(persist_path=store)
                nebulite.init(persistent_storage_path=store, agent=False,
                              num_of_version_in_retention=1, dead_run_grace=0)
                for step in (3, 4):
                    nebulite.Checkpoint(f"step{step}").save("model", {"w": torch.ones(2), "step": step})
                    nebulite.flush_persistence()
                ck = nebulite.get_latest_checkpoint()
                print(ck.tag, ck.load("model")["step"])
            print(repr(" ".join(str(x.message) for x in w)))
        """, store)
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(tmp_path)], check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == f"{latest} {latest[-1]}"  # older intact checkpoints are found, loaded
    assert lines[1] == "step4 4"
    if named is not None:
        assert named in lines[2] + out.stderr, lines[2]  # the odd entry is named
    # Nothing outside the store, and nothing that is not nebulite's, was touched.
    assert {os.path.join(d, n) for d, ds, fs in os.walk(outside) for n in ds + fs} == before
    assert os.path.lexists(os.path.join(store, "foreign")) or odd != "unreadable foreign directory"
    assert os.path.islink(os.path.join(store, "step1")) or "linked in" not in odd

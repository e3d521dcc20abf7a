"""Two jobs writing one persistent store: the writer lease (docs/format.md, "Writer
lease"). A second job is refused at init() naming the first, unless the jobs opt into
sharing; a job restarted after a crash, or a lease whose holder stopped renewing it, is
taken over; readers are never refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import HANG_TIMEOUT
import torch

import nebulite
import nebulite.api
from nebulite import _core

# A job that writes one checkpoint, says which run it is, and holds the store until told
# to finish (a line on stdin) or killed.
_HOLDER = """
import sys, torch, nebulite
nebulite.init(persistent_storage_path=sys.argv[1], **eval(sys.argv[2]))
nebulite.Checkpoint("a1").save("model", {"w": torch.ones(4), "step": 1})
nebulite.flush_persistence()
print(nebulite.session_info()["run_id"], flush=True)
sys.stdin.readline()
"""

# A second job: writes one checkpoint and reports what happened.
_SECOND = """
import sys, torch, nebulite
try:
    nebulite.init(persistent_storage_path=sys.argv[1], **eval(sys.argv[2]))
except nebulite.StoreInUseError as e:
    print("REFUSED", e, flush=True)
    sys.exit(0)
nebulite.Checkpoint("b1").save("model", {"w": torch.zeros(4), "step": 2})
nebulite.flush_persistence()
print("WROTE", nebulite.get_latest_checkpoint().tag, flush=True)
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(nebulite.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("NEBULITE_RUN_ID", None)
    env.update(extra)
    return env


class _Holder:
    """The first job, in its own process, holding the store until closed."""

    def __init__(self, store: str, options: str = "{}", **env: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_HOLDER), store, options], env=_env(**env),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()  # the pipe closes if it fails: no hang
        if not line:
            self.proc.kill()
            raise AssertionError(f"the first job failed: {self.proc.communicate(timeout=HANG_TIMEOUT)[1][-3000:]}")
        self.run_id = line

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        self.proc.communicate(timeout=HANG_TIMEOUT)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=HANG_TIMEOUT)


def _second(store: str, options: str = "{}", **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_SECOND), store, options],
                         env=_env(**env), capture_output=True, text=True, timeout=HANG_TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def _write_lease(store: str, run: str, host: str, renewed_unix_ns: int, ttl: int = 180) -> None:
    os.makedirs(os.path.join(store, ".nebulite"), exist_ok=True)
    text = (f"nebulite-lease 1\nrun {run}\nhost {host}\npid 4242\n"
            f"renewed_unix_ns {renewed_unix_ns}\nttl_seconds {ttl}\n")
    import zlib
    text += "end %08x\n" % zlib.crc32(text.encode())
    with open(os.path.join(store, ".nebulite", "lease"), "w") as f:
        f.write(text)


@pytest.mark.parametrize("agent", [False, True], ids=["embedded", "agent"])
def test_a_second_job_is_refused_at_init_naming_the_first(store, agent, request):
    env = {}
    if agent:
        env["NEBULITE_RUNTIME_DIR"] = str(request.getfixturevalue("agent_env"))
    first = _Holder(store, f"dict(agent={agent})", **env)
    try:
        out = _second(store, f"dict(agent={agent})", **env)
        assert out.startswith("REFUSED"), out
        assert f"run {first.run_id}" in out and f"host {os.uname().nodename}" in out
        assert f"pid {first.proc.pid}" in out and "last renewed" in out
        assert "shared_store=True" in out and "NEBULITE_SHARED_STORE=1" in out
        # Readers are never refused, before init or without one, nor is the CLI.
        ck = nebulite.get_latest_checkpoint(persist_path=store)
        assert ck.tag == "a1" and ck.load("model")["step"] == 1
        cli = subprocess.run([sys.executable, "-m", "nebulite.cli", "list", store], env=_env(),
                             capture_output=True, text=True, timeout=HANG_TIMEOUT)
        assert cli.returncode == 0 and '"a1"' in cli.stdout, cli.stderr[-3000:]
    finally:
        first.finish()
    # The first job's checkpoint is untouched; once it finished, the next job writes.
    assert _second(store, f"dict(agent={agent})", **env) == "WROTE b1"
    assert sorted(c["tag"] for c in nebulite.list_checkpoints(persist_path=store)) == ["a1", "b1"]


@pytest.mark.parametrize("agent", [False, True], ids=["embedded", "agent"])
def test_jobs_that_opt_into_sharing_both_write(store, agent, request):
    env = {}
    if agent:
        env["NEBULITE_RUNTIME_DIR"] = str(request.getfixturevalue("agent_env"))
    first = _Holder(store, f"dict(agent={agent}, shared_store=True, num_of_version_in_retention=0)",
                    **env)
    try:
        out = _second(store, f"dict(agent={agent}, num_of_version_in_retention=0)",
                      NEBULITE_SHARED_STORE="yes", **env)
        assert out == "WROTE b1", out
    finally:
        first.finish()
    assert sorted(c["tag"] for c in nebulite.list_checkpoints(persist_path=store)) == ["a1", "b1"]


@pytest.mark.parametrize("agent", [False, True], ids=["embedded", "agent"])
def test_a_job_restarted_after_a_crash_on_the_same_node_takes_over(store, agent, request):
    env = {}
    if agent:  # the node agent outlives the trainer; it never holds the lease
        env["NEBULITE_RUNTIME_DIR"] = str(request.getfixturevalue("agent_env"))
    first = _Holder(store, f"dict(agent={agent})", **env)
    first.kill()  # its lease stays, just renewed, but its process (and lock) is gone
    assert os.path.exists(os.path.join(store, ".nebulite", "lease"))
    assert _second(store, f"dict(agent={agent})", **env) == "WROTE b1"
    assert sorted(c["tag"] for c in nebulite.list_checkpoints(persist_path=store)) == ["a1", "b1"]


def test_a_lease_of_another_host_lives_until_its_ttl(store):
    now = time.time_ns()
    _write_lease(store, "otherjob", "some-other-node", now - 10 * 10**9)
    out = _second(store, "dict(agent=False)")
    assert out.startswith("REFUSED") and "run otherjob on host some-other-node (pid 4242)" in out
    _write_lease(store, "otherjob", "some-other-node", now - 3600 * 10**9)  # it died
    assert _second(store, "dict(agent=False)") == "WROTE b1"


def test_the_lease_is_private_and_released_at_the_end(store):
    nebulite.init(persistent_storage_path=store, agent=False)
    path = os.path.join(store, ".nebulite", "lease")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert nebulite.session_info()["run_id"] in open(path).read()
    nebulite.api._reset_for_tests()
    assert not os.path.exists(path)


@pytest.mark.parametrize("odd", ["empty", "garbage", "directory", "fifo"])
def test_an_odd_lease_file_has_no_live_holder(store, odd):
    path = os.path.join(store, ".nebulite", "lease")
    os.makedirs(os.path.dirname(path))
    if odd == "empty":
        open(path, "w").close()
    elif odd == "garbage":
        with open(path, "w") as f:
            f.write("nebulite-lease 1\nrun x\n\x00\x01")
    elif odd == "directory":
        os.mkdir(path)
    else:
        os.mkfifo(path)
    # In a process of its own, with a deadline: a FIFO opened the blocking way would hang.
    out = subprocess.run([sys.executable, "-W", "always", "-c", textwrap.dedent(_SECOND), store,
                          "dict(agent=False)"], env=_env(), capture_output=True, text=True,
                         timeout=HANG_TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "WROTE b1"  # a directory cannot be replaced: written without
    assert ".nebulite/lease" in out.stderr  # named in a warning


@pytest.mark.parametrize("value,expected", [("1", True), ("yes", True), ("TRUE", True),
                                            ("0", False), ("no", False), ("false", False)])
def test_the_sharing_switch_is_parsed_strictly(monkeypatch, value, expected):
    from nebulite._config import Config
    monkeypatch.setenv("NEBULITE_SHARED_STORE", value)
    assert Config.resolve(None, None, None, {}).shared_store is expected


@pytest.mark.parametrize("value", ["maybe", "2", "on", ""])
def test_a_sharing_switch_that_is_not_a_boolean_is_an_error(monkeypatch, value):
    from nebulite._config import Config
    monkeypatch.setenv("NEBULITE_SHARED_STORE", value)
    with pytest.raises(nebulite.InvalidArgumentError, match="NEBULITE_SHARED_STORE"):
        Config.resolve(None, None, None, {})
    with pytest.raises(nebulite.InvalidArgumentError, match="shared_store"):
        Config.resolve(None, None, None, {"shared_store": value or "x"})


def test_a_job_whose_lease_was_taken_commits_nothing_more(store):
    nebulite.init(persistent_storage_path=store, agent=False)
    nebulite.Checkpoint("a1").save("model", {"w": torch.ones(2)})
    nebulite.flush_persistence()
    # Another job on another node took the store (this one looked dead to it: paused, or
    # cut off from the store longer than the TTL). The next renewal notices.
    _write_lease(store, "otherjob", "some-other-node", time.time_ns())
    with pytest.raises(nebulite.StoreInUseError, match="run otherjob"):
        nebulite.api._session._lease.renew()
    with pytest.raises(nebulite.StoreInUseError, match="run otherjob"):
        nebulite.Checkpoint("a2").save("model", {"w": torch.ones(2)})
    assert [c["tag"] for c in nebulite.list_checkpoints(persist_path=store)] == ["a1"]
    nebulite.api._reset_for_tests()
    assert "otherjob" in open(os.path.join(store, ".nebulite", "lease")).read()  # left alone

"""Crash consistency: a training process saving checkpoints is SIGKILLed at random and at
chosen instants; afterwards the store must hold only whole, verifiable committed
checkpoints, the latest one must load with exactly the content saved at its step, and a
restarted run must be able to keep saving into the same path.

The "training" runs in tests/workers/crash_worker.py with the parent's environment.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import nebulite
import nebulite.api
from nebulite import _core

WORKER = os.path.join(os.path.dirname(__file__), "workers", "crash_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))
import crash_worker  # noqa: E402  (expected values shared with the worker)
from conftest import HANG_TIMEOUT  # noqa: E402

RETENTION = crash_worker.RETENTION
NAMES = ("model", "optim")


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(nebulite.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in [env.get("PYTHONPATH")] if p])
    env["NEBULA_MEMORY_BUFFER_SIZE"] = str(64 * 1024 * 1024)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("NEBULITE_TEST_KILL", None)
    env.pop("NEBULITE_RUN_ID", None)
    env.update(extra)
    return env


class Run:
    """A worker process; optionally SIGKILLed `delay` s after it prints line `kill_on`."""

    def __init__(self, store: str, first: int, last: int, flush_every: int, *,
                 kill_on: str | None = None, delay: float = 0.0, env: dict[str, str] | None = None):
        self.lines: list[str] = []
        self.killed_by_parent = False
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, store, str(first), str(last), str(flush_every)],
            env=env or _child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self._kill_on, self._delay = kill_on, delay
        self._stderr: list[str] = []
        self._t_out = threading.Thread(target=self._read_stdout, daemon=True)
        self._t_err = threading.Thread(target=lambda: self._stderr.append(self.proc.stderr.read()), daemon=True)
        self._t_out.start()
        self._t_err.start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if self._kill_on is not None and line.strip() == self._kill_on:
                if self._delay:
                    time.sleep(self._delay)
                self.killed_by_parent = True
                self.proc.send_signal(signal.SIGKILL)
                self._kill_on = None

    def wait(self, timeout: float = HANG_TIMEOUT) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._t_out.join(HANG_TIMEOUT)  # its output ends with it
        self._t_err.join(HANG_TIMEOUT)
        return rc

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)[-4000:]

    def last(self, what: str) -> int | None:
        steps = [int(m.group(1)) for l in self.lines if (m := re.fullmatch(rf"{what} (\d+)", l))]
        return max(steps) if steps else None


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _step_of(tag: str) -> int:
    m = re.fullmatch(r"step(\d+)", tag)
    assert m, tag
    return int(m.group(1))


def _check_store(store: str) -> list[dict]:
    """Every version with a commit marker is whole and verifies; the catalog lists exactly
    those; each committed checkpoint loads with the content saved at its step. Returns
    list_checkpoints(store) (newest first)."""
    nebulite.api._reset_for_tests()
    marked = set()
    if os.path.isdir(store):
        for tag in os.listdir(store):
            tdir = os.path.join(store, tag)
            if not os.path.isdir(tdir):
                continue
            for version in os.listdir(tdir):
                vdir = os.path.join(tdir, version)
                if not os.path.isfile(os.path.join(vdir, "COMMITTED")):
                    continue
                marked.add((tag, version))
                assert os.path.isfile(os.path.join(vdir, "rank0.manifest")), f"{tag}/{version}: marker without manifest"
                m = _core.read_manifest(store, tag, version, 0)
                assert (m["tag"], m["version"], m["world_size"]) == (tag, version, 1)
                assert sorted(f[0] for f in m["files"]) == sorted(NAMES), m["files"]
                for name, size, crc in m["files"]:
                    rel = _core.data_file_path(tag, version, 0, name)
                    assert os.path.isfile(os.path.join(store, rel)), f"{rel} listed in a committed manifest is missing"
                    _core.verify_data_file(store, rel, name, size, crc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skipping damaged checkpoint", no catalog problems
        listed = nebulite.list_checkpoints(store) if os.path.isdir(store) else []
        assert {(e["tag"], e["version"]) for e in listed} == marked
        # A crash between the marker and retention may leave one version too many.
        assert len(listed) <= RETENTION + 1, [e["tag"] for e in listed]
        steps = [_step_of(e["tag"]) for e in listed]
        assert steps == sorted(steps, reverse=True), "commit order does not follow save order"
        for e in listed:  # every committed checkpoint, not only the latest, loads exactly
            ck = nebulite.get_checkpoint(tag=e["tag"], persist_path=store)
            assert ck.version == e["version"]
            exp = crash_worker.expected(_step_of(e["tag"]))
            for name in NAMES:
                assert _same(ck.load(name, map_location="cpu"), exp[name]), (e["tag"], name)
    return listed


def _latest_step(store: str) -> int | None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        latest = nebulite.get_latest_checkpoint(persist_path=store)
        if latest.tag == "":
            return None
        step = _step_of(latest.tag)
        exp = crash_worker.expected(step)
        for name in NAMES:
            assert _same(latest.load(name), exp[name]), (latest.tag, name)
        return step


def _check_after_kill(store: str, run: Run, *, lowest: int | None, highest: int | None) -> int | None:
    """Store checks, then: latest is '' (only if `lowest` is None) or a step in
    [lowest, highest] whose objects load with exactly the values saved at that step."""
    listed = _check_store(store)
    step = _latest_step(store)
    if listed:
        assert step == _step_of(listed[0]["tag"])
    ctx = f"lines={run.lines[-6:]} latest={step} allowed=[{lowest}, {highest}]\nstderr:{run.stderr}"
    if step is None:
        assert lowest is None, "nothing committed although a flush had completed: " + ctx
    else:
        if lowest is not None:
            assert step >= lowest, ctx
        if highest is not None:
            assert step <= highest, ctx
    return step


def _bounds_from_progress(run: Run) -> tuple[int | None, int | None]:
    """What the child's output allows: at least the last flushed step (flush returned, so
    it is committed in the store), at most the last step reported saved (a step is only
    committed after its "saved" line)."""
    flushed, saved = run.last("flushed"), run.last("saved")
    return flushed, saved


# -- random instants ----------------------------------------------------------------

@pytest.mark.parametrize(
    "kill_on,delay",
    # Delays after "ready": the 30 steps take roughly 0.1-0.5 s after it on an idle machine.
    [("ready", 0.0), ("ready", 0.1), ("ready", 0.14), ("ready", 0.18), ("ready", 0.22),
     ("ready", 0.27), ("ready", 0.33), ("ready", 0.45),
     ("saved 3", 0.0), ("committed 4", 0.0), ("committed 5", 0.003), ("flushed 5", 0.0),
     ("saved 8", 0.001)],
)
def test_kill_at_random_instants(store, kill_on, delay):
    run = Run(store, 0, 29, 2, kill_on=kill_on, delay=delay)
    rc = run.wait()
    if rc == 0:  # the child finished before the kill instant
        assert run.lines[-1] == "done", run.lines[-3:]
        assert _check_after_kill(store, run, lowest=29, highest=29) == 29
        return
    assert rc == -signal.SIGKILL, (rc, run.stderr)
    lowest, highest = _bounds_from_progress(run)
    _check_after_kill(store, run, lowest=lowest, highest=highest)


# -- chosen instants (the child kills itself) -------------------------------------------

@pytest.mark.parametrize(
    "point,step,flush_every,allowed",
    [
        # Flushed after every step: step4 is committed in the store before step5 is saved.
        ("after_save", 5, 1, {4}),          # step5 saved to memory, never committed
        ("after_commit", 5, 1, {4, 5}),     # step5 committed in memory, persisting
        ("after_flush", 5, 1, {5}),         # step5 committed in the store
        ("after_commit", 0, 1, {None, 0}),  # the very first checkpoint may be lost
        ("after_save", 0, 1, {None}),
        # Never flushed: whatever reached the store must still be whole and exact.
        ("after_commit", 6, 0, set(range(7)) | {None}),
    ],
)
def test_kill_at_chosen_points(store, point, step, flush_every, allowed):
    run = Run(store, 0, 19, flush_every, env=_child_env(NEBULITE_TEST_KILL=f"{point}:{step}"))
    rc = run.wait()
    assert rc == -signal.SIGKILL, (rc, run.lines[-3:], run.stderr)
    expected_last = {"after_save": f"saved {step}", "after_commit": f"committed {step}",
                     "after_flush": f"flushed {step}"}[point]
    assert run.lines[-1] == expected_last, run.lines[-3:]
    got = _check_after_kill(store, run, lowest=None, highest=step)
    assert got in allowed, (got, allowed, run.lines[-4:])


@pytest.mark.parametrize("at_least", [0, 4, 11])
def test_kill_while_a_step_is_being_persisted(store, at_least):
    # Never flushed: the parent kills the child as soon as a data file of a step >= at_least
    # exists without its commit marker, i.e. in the middle of persisting it.
    run = Run(store, 0, 29, 0)
    deadline = time.monotonic() + HANG_TIMEOUT
    seen = None
    while run.proc.poll() is None and time.monotonic() < deadline:
        seen = _persisting_step(store, at_least)
        if seen is not None:
            run.proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.0005)
    rc = run.wait()
    if rc == 0:  # persisted and committed faster than we could look
        assert _check_after_kill(store, run, lowest=29, highest=29) == 29
        return
    assert rc == -signal.SIGKILL, (rc, run.stderr)
    _check_after_kill(store, run, lowest=None, highest=run.last("saved"))


# -- restart after a crash ------------------------------------------------------------

def _persisting_step(store: str, at_least: int) -> int | None:
    """A step >= at_least with a data file in the store but no commit marker, if any."""
    try:
        tags = os.listdir(store)
    except FileNotFoundError:
        return None
    for tag in tags:
        m = re.fullmatch(r"step(\d+)", tag)
        if not m or int(m.group(1)) < at_least:
            continue
        try:
            for v in os.listdir(os.path.join(store, tag)):
                vdir = os.path.join(store, tag, v)
                if os.path.isdir(os.path.join(vdir, "rank0")) and os.listdir(os.path.join(vdir, "rank0")) \
                        and not os.path.exists(os.path.join(vdir, "COMMITTED")):
                    return int(m.group(1))
        except FileNotFoundError:
            continue
    return None


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """A run killed while persisting a step >= 6 (it flushes every 3 steps), then a second
    run resuming after the latest committed step into the same path, to completion."""
    store = str(tmp_path_factory.mktemp("restart") / "ckpt")
    # First run: flushes every 3 steps; the parent SIGKILLs it while it is persisting a
    # step >= 6 (as soon as that step's first data file appears, before its marker).
    run1 = Run(store, 0, 29, 3)
    deadline = time.monotonic() + HANG_TIMEOUT
    while run1.proc.poll() is None and time.monotonic() < deadline:
        if _persisting_step(store, at_least=6) is not None:
            run1.proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.0005)
    assert run1.wait() == -signal.SIGKILL, (run1.lines[-3:], run1.stderr)
    before = _check_after_kill(store, run1, lowest=5, highest=None)
    debris = sorted(
        f"{tag}/{v}"
        for tag in os.listdir(store)
        if os.path.isdir(os.path.join(store, tag)) and not tag.startswith(".")
        for v in os.listdir(os.path.join(store, tag))
        if not os.path.exists(os.path.join(store, tag, v, "COMMITTED"))
    )
    # Leave extra debris of the kind a crash leaves: a temp file in the store root.
    with open(os.path.join(store, ".tmp-crashed-write"), "wb") as f:
        f.write(b"\0" * 100)

    # Second run resumes after the latest committed step, reusing the tags that the first
    # run saved but never committed (their version directories are still there).
    first = before + 1
    last = first + 5
    # (Leftovers are removed once nothing in them changed for the grace period: none here.)
    run2 = Run(store, first, last, 2, env=_child_env(NEBULITE_DEAD_RUN_GRACE="0"))
    assert run2.wait() == 0, run2.stderr
    assert run2.lines[-1] == "done", run2.lines[-3:]
    return store, before, first, last, debris


def test_restart_after_crash_keeps_saving_into_the_same_path(restarted):
    store, before, first, last, debris = restarted

    listed = _check_store(store)
    assert [_step_of(e["tag"]) for e in listed] == [last, last - 1, last - 2]  # retention 3
    assert _latest_step(store) == last
    assert len({e["version"] for e in listed}) == 3

    # And a fresh process finds and loads the new latest.
    code = (
        "import sys, torch, nebulite as nm; sys.path.insert(0, sys.argv[2]); import crash_worker as w\n"
        "ck = nm.get_latest_checkpoint(persist_path=sys.argv[1])\n"
        "step = int(ck.tag[4:]); exp = w.expected(step)\n"
        "for n in ('model', 'optim'):\n"
        "    got = ck.load(n)\n"
        "    assert all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in exp[n].items())\n"
        "print(ck.tag)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, store, os.path.dirname(WORKER)],
                         env=_child_env(), capture_output=True, text=True, timeout=HANG_TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == f"step{last}"


def test_crashed_runs_uncommitted_versions_are_cleaned_up(restarted):
    store, before, first, last, debris = restarted
    if not debris:
        pytest.skip("the kill left no uncommitted version directory this time")
    left = [d for d in debris if os.path.exists(os.path.join(store, d))]
    assert left == [], f"uncommitted versions of the crashed run still in the store: {left}"

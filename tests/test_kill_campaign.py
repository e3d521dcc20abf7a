"""Durability under SIGKILL: a short kill campaign (tests/kill_campaign.py) across the four
configurations (embedded engine and node agent, 1 and 2 ranks). A committed checkpoint is
whole and found again; a kill at any instant leaves the previous committed checkpoint
loadable and never exposes a torn one; a checkpoint whose flush_persistence() returned is
never lost. `make reliability` runs the same campaign at scale.

NEBULITE_KILL_SEED=<n> reruns the campaign of a failure (the seed is in its message).
"""

from __future__ import annotations

import io
import os
import random
import sys
import threading

import pytest

import nebulite.api

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
import kill_campaign  # noqa: E402
import kill_verify  # noqa: E402
import kill_worker  # noqa: E402

KILLS = 30


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _our_processes(paths: list[str]) -> list[str]:
    """Processes whose command line names one of `paths` (node agents name their runtime
    directory; forked workers carry the fork server's command line, checked by pid)."""
    return [f"{pid}: {cmd}" for pid in os.listdir("/proc") if pid.isdigit()
            and any(p in (cmd := _cmdline(int(pid))) for p in paths)]


def test_kill_campaign_keeps_the_durability_promise():
    env_seed = os.environ.get("NEBULITE_KILL_SEED")
    seed = int(env_seed) if env_seed else random.SystemRandom().randrange(1 << 31)
    threads_before = set(threading.enumerate())
    log = io.StringIO()
    configs = list(kill_campaign.CONFIGS.values())

    stats, table = kill_campaign.run(KILLS, seed, configs, per_scenario=8, out=log)

    report = f"seed {seed} (NEBULITE_KILL_SEED={seed} reruns it)\n{log.getvalue()}\n{table}"
    assert not stats.failures, report
    # Every configuration was killed, and the checks had committed checkpoints to verify.
    for c in configs:
        assert stats.kills[c.name] >= 1, report
        assert stats.runs[c.name] >= stats.kills[c.name], report
    assert sum(stats.kills.values()) >= KILLS * 3 // 4, report
    assert len(stats.verified) >= 1 and sum(stats.journaled.values()) >= 1, report

    # Nothing is left behind: no process, no thread, no file. (Pids are reused quickly on a
    # busy machine: a pid counts as ours only with our fork server's command line.)
    assert stats.paths and _our_processes(stats.paths) == [], report
    started = [stats.zygote_pid] + stats.pids
    assert len(started) > KILLS, report
    assert [p for p in started if kill_campaign.ZYGOTE in _cmdline(p)] == [], report
    assert set(threading.enumerate()) <= threads_before, report
    assert [p for p in stats.paths if os.path.exists(p)] == [], report


def _check(store, journal) -> dict:
    nebulite.api._reset_for_tests()  # a fresh reader: nothing verified yet
    return kill_verify.Check(str(store), 1, str(journal), live=False).run()


@pytest.mark.parametrize("tags", ["step", "last"])
def test_the_checks_catch_a_torn_or_a_lost_checkpoint(tmp_path, tags):
    """The campaign's checks pass on what a run left and fail on a damaged store."""
    store, journal = tmp_path / "store", tmp_path / "journal"
    journal.mkdir()
    assert kill_worker.main(["--store", str(store), "--journal-dir", str(journal),
                             "--steps", "4", "--flush-every", "1", "--tag", tags]) == 0
    result = _check(store, journal)
    assert result["problems"] == []
    newest_tag = "step3" if tags == "step" else "last"
    assert [e["tag"] for e in result["listed"]] == (  # retention 2
        ["step3", "step2"] if tags == "step" else ["last", "last"])
    assert len(result["verified"]) == 2 and result["latest"] == 3 and result["journal"] == 3

    newest = os.path.join(str(store), newest_tag, result["listed"][0]["version"])
    model = os.path.join(newest, "rank0", "model")
    with open(model, "r+b") as f:  # one flipped bit in a tensor's bytes
        f.seek(8192 + 1000)
        byte = f.read(1)
        f.seek(8192 + 1000)
        f.write(bytes([byte[0] ^ 1]))
    problems = _check(store, journal)["problems"]
    assert any(p["kind"] == "torn" and f"{newest_tag}/" in p["detail"] for p in problems), problems

    os.unlink(os.path.join(newest, "COMMITTED"))  # as if step3 had never been committed
    result = _check(store, journal)
    assert result["latest"] == 2
    assert [p["kind"] for p in result["problems"]] == ["lost"], result["problems"]

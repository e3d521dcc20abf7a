"""The benchmark programs run end to end on tiny states, so that they cannot rot.
(They assert that the programs work and report their figures, never a timing.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

#: Bounds a hang only: each program takes a minute or two on an idle 2-core machine, and
#: several times that on a busy one.
HANG_TIMEOUT = 3600
pytestmark = pytest.mark.timeout(HANG_TIMEOUT + 300)  # beyond the suite's default


def _run(args: list[str]) -> subprocess.CompletedProcess:
    """Runs a benchmark program; one that hangs is killed with every worker it started."""
    with subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=HANG_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            pytest.fail(f"{args[0]} hung:\n{out[-3000:]}{err[-3000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _assert_agents_stopped(new_agents: Callable[[], list[psutil.Process]]) -> None:
    """The program stopped every node agent it started."""
    assert new_agents() == [], [" ".join(p.cmdline()) for p in new_agents()]


def test_bench_suite_smoke(tmp_path: Path, new_agents: Callable[[], list[psutil.Process]]) -> None:
    out = tmp_path / "results"
    work = tmp_path / "work"
    result = _run([str(BENCH / "bench_suite.py"), "--smoke", "--dir", str(work), "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "blocking time per save" in result.stdout and "targets" in result.stdout
    data = json.loads((out / "latest.json").read_text())
    s = data["summaries"]["syn-tiny"]
    assert s["state_bytes"] > 0
    for key in ("torch.save+fsync", "dcp.save", "dcp.async_save", "dcp.async_save+stager",
                "dcp.async_save+async_stager", "nebulite", "nebulite async staging", "nebulite agent"):
        assert s["blocking_s"].get(key, 0) > 0, key
        assert s["committed_s"].get(key, 0) > 0, key
    for key in ("torch.load", "dcp.load", "nebulite store", "nebulite memory agent", "nebulite memory embedded"):
        assert s["load_s"].get(key, 0) > 0, key
    assert s["load_tier_agent"] == "memory" and s["load_tier_embedded"] == "memory"
    for key in ("nebulite", "nebulite agent", "dcp.async_save"):
        assert key in s["memory_beyond_bytes"], key
    # every load got back every byte of the state
    for load in data["workloads"]["syn-tiny"]["loads"].values():
        assert load["bytes"] == s["state_bytes"]
    assert {v["variant"] for v in data["train"]["variants"]} >= {"none", "nebulite agent"}
    assert data["targets"] and (out / "latest.png").stat().st_size > 0
    # the suite cleans up after itself: no bench files, no agent left behind
    assert not any(work.iterdir())
    _assert_agents_stopped(new_agents)


def test_bench_suite_resume_smoke(tmp_path: Path, new_agents: Callable[[], list[psutil.Process]]) -> None:
    """The resume workload with 2 ranks of 1 MiB: every rank resumes its own shard with
    nebulite and with DCP, and the result holds what the table, targets and plot need."""
    out = tmp_path / "results"
    work = tmp_path / "work"
    result = _run([str(BENCH / "bench_suite.py"), "--smoke", "--workloads", "resume", "--no-train",
                   "--dir", str(work), "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resume time, s" in result.stdout and "bytes read (rchar) / own share" in result.stdout
    data = json.loads((out / "latest.json").read_text())
    assert data["summaries"] == {} and "train" not in data
    r = data["resume"]
    assert (r["ranks"], r["shard_mb"], r["checkpoints"], r["retention"], r["reps"]) == (2, 1, 3, 2, 1)
    assert [s["rank"] for s in r["save"]] == [0, 1] and all(s["step"] == 3 for s in r["save"])
    for kind in ("nebulite", "dcp"):
        (run,) = r[kind]
        assert run["cold"]["method"]
        assert [x["rank"] for x in run["ranks"]] == [0, 1]
        for x in run["ranks"]:
            assert x["seconds"] > 0
            assert x["own_bytes"] >= 1 << 20 and x["own_bytes"] == sum(x["own_files"].values())
            assert x["io"]["rchar"] > 0 and x["io"]["read_bytes"] >= 0
    # nebulite: each rank resumed the newest of the two checkpoints retention kept, from its
    # own data file; DCP: each rank's items are in a file of its own.
    for x in r["nebulite"][0]["ranks"]:
        assert x["tag"] == "step3" and x["store"] == ["step2", "step3"]
        assert list(x["own_files"]) == [f"shard{x['rank']}"] and 0 < x["find_s"] <= x["seconds"]
    dcp_files = [list(x["own_files"]) for x in r["dcp"][0]["ranks"]]
    assert all(len(f) == 1 for f in dcp_files) and dcp_files[0] != dcp_files[1]
    assert all(x["files_shared_with"] == [] for x in r["dcp"][0]["ranks"])
    s = r["summary"]
    for kind in ("nebulite", "dcp"):
        k = s["kinds"][kind]
        assert len(k["rank_s"]) == 2 and k["max_s"] == max(k["rank_s"])
        assert len(k["rchar_ratio"]) == 2 and len(k["read_bytes_ratio"]) == 2
    rows = [t for t in data["targets"] if t["target"].startswith(("resume", "(no target) resume"))]
    assert len(rows) == 3 and all(t["single"] and t["value"] > 0 for t in rows)
    assert (out / "latest.png").stat().st_size > 0
    assert not any(work.iterdir())
    _assert_agents_stopped(new_agents)


def test_profile_load_smoke(tmp_path: Path) -> None:
    result = _run([str(BENCH / "profile_load.py"), "--workload", "syn-tiny", "--dir", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "get_latest_checkpoint" in result.stdout and "O_DIRECT" in result.stdout
    assert not any(tmp_path.iterdir())


def test_profile_save_smoke(new_agents: Callable[[], list[psutil.Process]]) -> None:
    result = _run([str(BENCH / "profile_save.py"), "--workload", "syn-tiny", "--reps", "1"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "copy engine" in result.stdout and "(agent)" in result.stdout
    _assert_agents_stopped(new_agents)


@pytest.mark.parametrize("agent", [False, True], ids=["embedded", "agent"])
def test_profile_scan_smoke(agent: bool, new_agents: Callable[[], list[psutil.Process]]) -> None:
    result = _run([str(BENCH / "profile_scan.py"), "--workload", "syn-tiny", "--reps", "1"]
                  + (["--agent", "--gap", "0.01"] if agent else []))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ("10 ms idle before each checkpoint" in result.stdout) == agent
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:]}
    for name in ("model", "optimizer", "meta"):  # every object scanned, in each setting
        warm, cold, loop, cpu = (float(x) for x in rows[name][1:5])
        assert min(warm, cold, loop, cpu) > 0 and "tensors" in " ".join(rows[name][5:])
    assert "save() blocking" in result.stdout
    _assert_agents_stopped(new_agents)


def test_profile_device_host_smoke() -> None:
    result = _run([str(BENCH / "profile_device_host.py"), "--tensors", "4", "--numel", "256",
                   "--reps", "2", "--warmup", "1", "--profile"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # a host time per save and per barrier in each mode, and a profile of the saves
    for mode in ("blocking", "async", "async-scanned"):
        row = next(line.split() for line in result.stdout.splitlines()
                   if line.split()[:1] == [mode])
        assert row[1] == "save()" and float(row[2]) > 0 and row[3] == "ms", row
        assert row[-3] == "barrier" and float(row[-2]) >= 0 and row[-1] == "ms", row
    assert result.stdout.count("function calls") == 3


def _emulator_alive(pid: int) -> bool:
    """Whether `pid` is still an emulator process (not one that took the number since)."""
    try:
        p = psutil.Process(pid)
        cmd = " ".join(p.cmdline())
        return p.status() != psutil.STATUS_ZOMBIE and any(
            n in cmd for n in ("azurite", "moto_server", "gcp-storage-emulator"))
    except psutil.Error:
        return False


def test_bench_object_stores_smoke(tmp_path: Path) -> None:
    """Every store's emulator started, every candidate ran and got the saved bytes back, the
    table and its targets were printed, and every emulator is gone with its files."""
    out = tmp_path / "results"
    result = _run([str(BENCH / "bench_object_stores.py"), "--smoke", "--stores", "az,s3,gs",
                   "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for scheme in ("az", "s3", "gs"):
        assert f"{scheme}:// through" in result.stdout
    assert result.stdout.count("upload / persistence") == 3 and result.stdout.count("download / load") == 3
    assert result.stdout.count("persistence >= 90% of direct") == 3
    assert result.stdout.count("load >= 90% of direct") == 3
    data = json.loads((out / "object-stores-latest.json").read_text())
    assert [s["store"] for s in data["stores"]] == ["az", "s3", "gs"]
    for store in data["stores"]:
        s = store["summary"]
        assert s["state_bytes"] == 8 << 20 and s["data_file_bytes"] > s["state_bytes"]
        assert s["all_equal"]
        assert len(store["runs"]) == 1 and len(s["targets"]) == 2
        for kind in ("upload", "download"):
            for name, figures in s[kind].items():
                assert figures["seconds"] > 0 and figures["mib_s"] > 0, (store["store"], name)
        # nebulite's requests were recorded: one upload of the data file, and its reads
        assert s["upload"]["nebulite save -> committed"]["requests"]["data_put"]["count"] == 1
        assert s["download"]["nebulite get_checkpoint + load"]["requests"]["data_get_large"]["count"] >= 1
        # a checkpoint of one data file, its manifest, its commit marker
        objects = store["runs"][0]["upload"]["nebulite save -> committed"]["objects"]
        assert any(k.endswith("/rank0/model") for k in objects), objects
        assert any(k.endswith("/COMMITTED") for k in objects), objects
        assert store["emulator_pid"] and not _emulator_alive(store["emulator_pid"]), store["emulator"]
        assert not os.path.exists(store["emulator_dir"])


def test_compare_store_clients_smoke() -> None:
    """Each emulator, each client installed here measured (the others said to be missing),
    obstore's failure on the GCS emulator (JSON API only) said, a table printed."""
    result = _run([str(BENCH / "compare_store_clients.py"), "--mb", "2", "--reps", "1"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("Azurite", "moto", "gcp"))]
    assert any(r.startswith("Azurite") and "obstore" in r and "MB" not in r and "failed" not in r for r in rows), rows
    assert any(r.startswith("moto") and "obstore" in r and "failed" not in r for r in rows), rows
    assert any(r.startswith("gcp") and "google-cloud-storage" in r and "failed" not in r for r in rows), rows
    assert any(r.startswith("gcp") and "obstore" in r and "failed" in r for r in rows), rows


def test_bench_async_staging_smoke(tmp_path: Path, new_agents: Callable[[], list[psutil.Process]]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "async.json"
    result = _run([str(BENCH / "bench_async_staging.py"), "--smoke", "--dir", str(work),
                   "--json", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "blocking DCP" in result.stdout and "staged DCP" in result.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"syn-tiny", "gpt2-tiny"}
    for figures in data.values():
        for who in ("dcp", "nebulite"):
            assert figures[who] and all(r["blocking_s"] > 0 and r["staged_s"] >= r["blocking_s"]
                                        for r in figures[who]), who
        assert figures["blocking_ratio"] > 0
    assert not any(work.iterdir())  # the benchmark cleans up after itself
    _assert_agents_stopped(new_agents)


def test_bench_deepspeed_staging_smoke(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "deepspeed.json"
    result = _run([str(BENCH / "bench_deepspeed_staging.py"), "--smoke", "--stages", "0,1",
                   "--dir", str(work), "--json", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "async / torch.save" in result.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"0", "1"}
    for figures in data.values():
        assert set(figures) == {"torch.save", "nebulite", "async, caller", "async"}
        assert all(len(times) == 2 and all(t > 0 for t in times) for times in figures.values())
    assert not any(work.iterdir())  # the benchmark cleans up after itself


@pytest.mark.parametrize("program", ["bench_gpu.py", "profile_gpu_staging.py"])
def test_gpu_programs_say_there_is_nothing_to_measure_without_cuda(program: str) -> None:
    # On a machine with CUDA they measure for minutes: benchmarks/gpu_check.sh runs them.
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: benchmarks/gpu_check.sh measures with it")
    result = _run([str(BENCH / program), "--help"])
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-3000:]
    result = _run([str(BENCH / program)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no CUDA device: nothing to measure" in result.stdout

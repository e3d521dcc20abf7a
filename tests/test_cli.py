"""The ``nebulite`` command, run as a subprocess on stores written by the API, by
DeepSpeed's "nebula" block and by Lightning's NebulaCallback."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import nebulite
import nebulite.api

from conftest import HANG_TIMEOUT


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(nebulite.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def cli(*args: str, code: int | None = 0, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs `nebulite ARGS...`; checks its exit status unless `code` is None."""
    p = subprocess.run([sys.executable, "-m", "nebulite.cli", *map(str, args)], env=_env(**env),
                       capture_output=True, text=True, timeout=HANG_TIMEOUT)
    if code is not None:
        assert p.returncode == code, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p


def _state(step: int) -> dict[str, Any]:
    return {"layer": {"weight": torch.full((4, 3), float(step)), "bias": torch.zeros(4,
            dtype=torch.bfloat16)}, "step": step, "note": "hello"}


def write_store(root: str, steps: int = 3, retention: int = 3) -> None:
    """`steps` committed checkpoints global_step0.. with objects model and optimizer."""
    nebulite.init(persistent_storage_path=root, persistent_time_interval=0,
                  num_of_version_in_retention=retention)
    for step in range(steps):
        c = nebulite.Checkpoint(f"global_step{step}", num_files=2)
        c.save("model", _state(step))
        c.save("optimizer", {"lr": 0.1 * (step + 1), "exp_avg": [torch.ones(5) * step]})
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()


@pytest.fixture
def api_store(store):
    write_store(store)
    return store


def test_ls_lists_committed_checkpoints_newest_first(api_store):
    out = cli("ls", api_store).stdout
    lines = out.splitlines()
    assert lines[0].split() == ["TAG", "VERSION", "COMMITTED", "(UTC)", "AGE", "SIZE", "OBJECTS",
                                "STATE"]
    assert [line.split()[0] for line in lines[1:]] == ["global_step2", "global_step1",
                                                       "global_step0"]
    assert all(line.rstrip().endswith("committed") for line in lines[1:])
    rows = json.loads(cli("ls", api_store, "--json").stdout)
    assert [r["tag"] for r in rows] == ["global_step2", "global_step1", "global_step0"]
    assert rows[0]["objects"] == ["model", "optimizer"] and rows[0]["bytes"] > 0
    assert rows[0]["state"] == "committed" and rows[0]["committed_unix_ns"] > 0
    # `nebulite list` is list_checkpoints() as before
    assert [e["tag"] for e in json.loads(cli("list", api_store).stdout)][0] == "global_step2"


def test_ls_shows_uncommitted_leftovers(api_store):
    leftover = Path(api_store) / "global_step9" / "vdeadrun-000001" / "rank0"
    leftover.mkdir(parents=True)
    (leftover / "model").write_bytes(b"partial")
    rows = json.loads(cli("ls", api_store, "--json").stdout)
    assert rows[-1]["tag"] == "global_step9" and rows[-1]["state"] == "uncommitted"
    assert "uncommitted" in cli("ls", api_store).stdout.splitlines()[-1]


def test_ls_of_a_missing_store_is_one_line_on_stderr(tmp_path):
    p = cli("ls", tmp_path / "nothing", code=2)
    assert p.stdout == "" and len(p.stderr.strip().splitlines()) == 1
    assert str(tmp_path / "nothing") in p.stderr


def test_show_lists_tensors_and_values_without_loading(api_store):
    out = cli("show", api_store, "global_step1").stdout
    assert "object model" in out and "object optimizer" in out
    assert any(line.split()[:4] == ["layer.weight", "float32", "[4,", "3]"] and line.split()[-1] == "48"
               for line in out.splitlines())
    assert "step = 1" in out and "note = 'hello'" in out
    d = json.loads(cli("show", api_store, "global_step1", "model", "--json").stdout)
    (obj,) = d["objects"]
    assert {t["key"]: (t["dtype"], t["shape"], t["bytes"]) for t in obj["tensors"]} == {
        "layer.weight": ("float32", [4, 3], 48), "layer.bias": ("bfloat16", [4], 8)}
    assert {v["key"]: v["value"] for v in obj["values"]} == {"step": 1, "note": "hello"}
    p = cli("show", api_store, "global_step1", "nope", code=2)
    assert "nope" in p.stderr and "model" in p.stderr
    assert "global_step7" in cli("show", api_store, "global_step7", code=2).stderr


def _data_file(root: str, tag: str, name: str) -> Path:
    (entry,) = [e for e in nebulite.list_checkpoints(root) if e["tag"] == tag]
    return Path(entry["path"]) / "rank0" / name


def test_verify_is_0_when_intact_and_1_naming_each_damaged_file(api_store):
    out = cli("verify", api_store, "--all").stdout
    assert out.count("): intact") == 3
    assert "global_step2" in cli("verify", api_store).stdout  # the newest by default
    victim = _data_file(api_store, "global_step1", "model")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(data)
    p = cli("verify", api_store, "--all", code=1)
    assert "global_step1" in p.stdout and "DAMAGED" in p.stdout and str(victim) in p.stdout
    assert p.stdout.count("): intact") == 2
    assert str(victim) in cli("verify", api_store, "global_step1", code=1).stdout
    cli("verify", api_store, "global_step2")  # the others are intact
    victim.unlink()
    assert str(victim) in cli("verify", api_store, "global_step1", code=1).stdout


def test_progress_says_bytes_throughput_and_time_left():
    from nebulite.cli.progress import describe

    text = describe("verify", 500_000_000, 1_000_000_000, 2.0)
    assert "50%" in text and "500.0 MB / 1.0 GB" in text
    assert "250.0 MB/s" in text and "2.0 s left" in text


def test_history_is_one_row_per_checkpoint_and_plots_a_png(api_store, tmp_path):
    out = cli("history", api_store).stdout.splitlines()
    assert out[0].split()[:3] == ["SAVED", "(UTC)", "TAG"]
    assert [line.split()[2] for line in out[1:]] == ["global_step0", "global_step1", "global_step2"]
    assert all(line.endswith("committed") for line in out[1:])
    rows = json.loads(cli("history", api_store, "--json").stdout)
    with open(Path(api_store) / "checkpointHistories.csv", newline="") as f:
        commits = [r for r in csv.DictReader(f) if r["outcome"] == "committed"]
    assert [r["bytes"] for r in rows] == [int(c["bytes"]) for c in commits]
    assert all(r["persist_seconds"] > 0 and r["throughput_mb_s"] > 0 and r["blocking_seconds"] >= 0
               for r in rows)
    # the CSV of a finished job, copied anywhere, and a plot of it
    copy = tmp_path / "run1.csv"
    copy.write_bytes((Path(api_store) / "checkpointHistories.csv").read_bytes())
    png = tmp_path / "run1.png"
    out = cli("history", copy, "--plot", png).stdout
    assert "global_step2" in out and str(png) in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == sorted(["run1.csv", "run1.png", "ckpt"])


def test_gc_removes_only_dead_runs_leftovers_and_dry_run_removes_nothing(api_store):
    from nebulite import _core

    for run in ("deadrun", "liverun"):
        d = Path(api_store) / "global_step9" / f"v{run}-000001" / "rank0"
        d.mkdir(parents=True)
        (d / "model").write_bytes(b"partial")
    live = _core.hold_run(api_store, "liverun")
    try:
        # fresh leftovers are kept for the grace period, whatever their run
        assert "nothing to remove" in cli("gc", api_store).stdout
        out = cli("gc", api_store, "--dry-run", "--grace", "0").stdout
        assert out.splitlines() == ["would remove global_step9/vdeadrun-000001"]
        assert (Path(api_store) / "global_step9" / "vdeadrun-000001").is_dir()
        out = cli("gc", api_store, "--grace", "0").stdout
        assert out.splitlines() == ["removed global_step9/vdeadrun-000001"]
        assert not (Path(api_store) / "global_step9" / "vdeadrun-000001").exists()
        assert (Path(api_store) / "global_step9" / "vliverun-000001" / "rank0" / "model").exists()
    finally:
        live.release()
    assert [e["tag"] for e in nebulite.list_checkpoints(api_store)] == [
        "global_step2", "global_step1", "global_step0"]
    cli("verify", api_store, "--all")


def test_export_torch_and_safetensors_then_import_them_back(api_store, tmp_path):
    from safetensors.torch import load_file

    out = cli("export", api_store, "global_step1", "--to", tmp_path / "pt").stdout
    assert f"wrote {tmp_path / 'pt' / 'model.pt'}" in out
    plain = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)  # no nebulite needed
    assert torch.equal(plain["layer"]["weight"], _state(1)["layer"]["weight"])
    assert plain["layer"]["bias"].dtype == torch.bfloat16 and plain["note"] == "hello"
    cli("export", api_store, "global_step2", "--to", tmp_path / "st", "--format", "safetensors")
    tensors = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert set(tensors) == {"layer.weight", "layer.bias"}
    assert torch.equal(tensors["layer.weight"], _state(2)["layer"]["weight"])
    assert json.loads((tmp_path / "st" / "model.json").read_text()) == {"step": 2, "note": "hello"}
    assert set(load_file(str(tmp_path / "st" / "optimizer.safetensors"))) == {"exp_avg.0"}
    assert sorted(os.listdir(tmp_path / "st")) == ["model.json", "model.safetensors",
                                                   "optimizer.json", "optimizer.safetensors"]
    # ... and back: each file becomes an object of a committed checkpoint
    other = str(tmp_path / "other")
    out = cli("import", other, "from_torch", "--from", tmp_path / "pt").stdout
    assert "committed from_torch" in out
    cli("import", other, "from_st", "--from", tmp_path / "st")
    latest = nebulite.get_latest_checkpoint(other)
    assert latest.tag == "from_st" and sorted(latest.list_names()) == ["model", "optimizer"]
    model = latest.load("model")
    assert torch.equal(model["layer.weight"], _state(2)["layer"]["weight"]) and model["step"] == 2
    back = nebulite.get_checkpoint(tag="from_torch", persist_path=other).load("model")
    assert torch.equal(back["layer"]["weight"], _state(1)["layer"]["weight"])
    cli("verify", other, "--all")
    # importing into a store with checkpoints keeps them all (no retention)
    cli("import", api_store, "imported", "--from", tmp_path / "pt")
    assert [e["tag"] for e in nebulite.list_checkpoints(api_store)] == [
        "imported", "global_step2", "global_step1", "global_step0"]


def test_export_refuses_a_damaged_file(api_store, tmp_path):
    victim = _data_file(api_store, "global_step1", "model")
    data = bytearray(victim.read_bytes())
    data[-100] ^= 1
    victim.write_bytes(data)
    p = cli("export", api_store, "global_step1", "--to", tmp_path / "out", code=2)
    assert str(victim) in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "model.pt").exists()
    assert [n for n in os.listdir(tmp_path / "out") if ".tmp" in n] == []


def test_agent_status_ls_and_stop_wait_persist_what_memory_holds(agent_env, store):
    nebulite.init(persistent_storage_path=store, agent=True, persistent_time_interval=3600,
                  memory_buffer_size=64 << 20)
    nebulite.Checkpoint("global_step0", num_files=1).save("model", _state(0))
    nebulite.flush_persistence()  # the first one is in the store
    nebulite.Checkpoint("global_step1", num_files=1).save("model", _state(1))  # memory only
    agent_pid = nebulite.api.session_info()["agent_pid"]
    (a,) = json.loads(cli("agent", "status", "--json").stdout)
    assert a["pid"] == agent_pid and a["root"] == store and a["trainers"] == 1
    assert 0 < a["used"] <= a["capacity"] == 64 << 20
    assert {v["tag"] for v in a["versions"] if v["in_memory"]} >= {"global_step1"}
    table = cli("agent", "status").stdout.splitlines()
    assert table[0].split()[:2] == ["PID", "STORE"] and table[1].split()[:2] == [str(agent_pid), store]
    rows = {r["tag"]: r["state"] for r in json.loads(cli("ls", store, "--json").stdout)}
    assert rows == {"global_step1": "in memory only", "global_step0": "committed"}
    # a trainer is attached: stop is refused unless forced
    p = cli("agent", "stop", code=2)
    assert "trainer" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    nebulite.shutdown()  # the trainer leaves; the agent keeps global_step1 in memory
    assert nebulite.list_checkpoints(store)[0]["tag"] == "global_step0"
    out = cli("agent", "stop", "--wait").stdout
    assert f"stopping agent {agent_pid}" in out and f"agent {agent_pid} exited" in out
    assert "no nebulite agent" in cli("agent", "status").stdout
    rows = {r["tag"]: r["state"] for r in json.loads(cli("ls", store, "--json").stdout)}
    assert rows == {"global_step1": "committed", "global_step0": "committed"}
    assert torch.equal(nebulite.get_latest_checkpoint(store).load("model")["layer"]["weight"],
                       _state(1)["layer"]["weight"])
    (log,) = agent_env.glob("agent-*.log")  # the agent's log, beside its socket
    assert f"nebulite agent {agent_pid} serving" in log.read_text()


def test_every_read_command_works_on_a_store_deepspeeds_nebula_block_wrote(tmp_path, store):
    ds = pytest.importorskip("test_deepspeed")
    save_dir = tmp_path / "ds"
    for step in (1, 2):
        tag = f"global_step{step}"
        (save_dir / tag).mkdir(parents=True)
        engine = ds._engine(store)
        info = ds._commit_info(tag, save_dir)
        engine.create(info)
        engine.save({"module": {"w": torch.full((2, 3), float(step))}, "loss_scaler": ds._ScaleState(2.0),
                     "global_steps": step}, str(save_dir / tag / ds.MODEL))
        assert engine.commit(info) is True
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    rows = json.loads(cli("ls", store, "--json").stdout)
    assert [(r["tag"], r["objects"]) for r in rows] == [("global_step2", [ds.MODEL]),
                                                        ("global_step1", [ds.MODEL])]
    # DeepSpeed's own objects are shown by class name, never imported
    d = json.loads(cli("show", store, "global_step2", "--json").stdout)
    (obj,) = d["objects"]
    assert obj["tensors"] == [{"key": "module.w", "dtype": "float32", "shape": [2, 3], "bytes": 24}]
    values = {v["key"]: v["value"] for v in obj["values"]}
    assert values["global_steps"] == 2 and values["loss_scaler.scale"] == 2.0
    assert values["loss_scaler"] == "<test_deepspeed._ScaleState>"
    assert "loss_scaler = <test_deepspeed._ScaleState>" in cli("show", store, "global_step2").stdout
    cli("verify", store, "--all")
    assert [line.split()[2] for line in cli("history", store).stdout.splitlines()[1:]] == [
        "global_step1", "global_step2"]
    cli("export", store, "global_step2", "--to", tmp_path / "out", "--format", "safetensors")
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(tmp_path / "out" / f"{ds.MODEL}.safetensors"))["module.w"],
                       torch.full((2, 3), 2.0))


def test_every_read_command_works_on_a_store_lightnings_callback_wrote(tmp_path, store):
    lt = pytest.importorskip("test_lightning")
    callback = lt._callback(tmp_path / "ckpts", store)
    trainer = lt._trainer(tmp_path, 4, [callback], [lt.NebulaCheckpointIO()])
    trainer.fit(lt.TinyModule(), lt.loader())
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    rows = json.loads(cli("ls", store, "--json").stdout)
    assert rows and all(r["state"] == "committed" and r["objects"] == ["checkpoint"] for r in rows)
    tag = os.path.basename(callback.last_model_path)
    assert tag in {r["tag"] for r in rows}
    d = json.loads(cli("show", store, tag, "checkpoint", "--json").stdout)
    keys = {t["key"] for t in d["objects"][0]["tensors"]}
    assert "state_dict.layer.weight" in keys
    assert any(v["key"] == "global_step" for v in d["objects"][0]["values"])
    cli("verify", store, "--all")
    assert tag in cli("history", store).stdout
    cli("export", store, tag, "--to", tmp_path / "out")
    plain = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    assert torch.equal(plain["state_dict"]["layer.weight"],
                       torch.load(callback.last_model_path, weights_only=True)["state_dict"]["layer.weight"])


@pytest.mark.parametrize("command", ["ls", "show", "verify", "history", "gc", "export", "import",
                                     "agent", "list"])
def test_help_of_every_command_shows_an_example(command):
    out = cli(command, "--help").stdout
    assert "example" in out and f"nebulite {command}" in out


def test_running_an_agent_through_the_command_does_not_load_torch():
    script = ("import sys, nebulite.cli\n"
              "assert 'torch' not in sys.modules, 'torch loaded'\n")
    p = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, text=True,
                       timeout=HANG_TIMEOUT)
    assert p.returncode == 0, p.stderr[-2000:]


def test_looking_for_agents_creates_no_runtime_directory(api_store, tmp_path):
    """ls and agent status/stop only look: on a node where no agent ever ran, they find
    none and leave no runtime directory behind."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {"TMPDIR": str(tmpdir), "XDG_RUNTIME_DIR": "", "NEBULITE_RUNTIME_DIR": ""}
    assert "global_step2" in cli("ls", api_store, **env).stdout
    cli("agent", "status", **env)
    cli("agent", "stop", "--root", api_store, code=None, **env)
    assert list(tmpdir.iterdir()) == []

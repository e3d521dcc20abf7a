"""Persisting to object stores (Azure Blob and ADLS Gen2 through Azurite, S3 through moto,
GCS through gcp-storage-emulator): the same guarantees as on a disk, against real endpoints
that the tests start and stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import nebulite
import nebulite.api
from nebulite import InvalidArgumentError, PersistError
from nebulite.stores import open_client

from conftest import HANG_TIMEOUT
from http_faults import FaultProxy
from object_stores import azurite, gcs_emulator, moto_s3, object_store, start_azurite, store_env, store_url  # noqa: F401

MIB = 1024 * 1024


def _state(value: int, n: int = 1_500_000) -> dict:
    return {"w": torch.arange(n, dtype=torch.float32) + value, "step": value}


def _assert_state(obj: dict, value: int, n: int = 1_500_000) -> None:
    assert obj["step"] == value
    assert torch.equal(obj["w"], torch.arange(n, dtype=torch.float32) + value)


def _keys(url: str) -> list[str]:
    return sorted(k for k, _, _ in open_client(url).list("", True)[0])


def _committed(url: str) -> list[str]:
    return [e["tag"] for e in nebulite._core.read_catalog(url)[0]]


def _child(code: str, timeout: float = HANG_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


def test_save_commit_load_list_and_retention(store_url):
    nebulite.init(persistent_storage_path=store_url, num_of_version_in_retention=2)
    assert nebulite.session_info()["persistent_storage_path"] == store_url
    for step in (1, 2, 3):
        ck = nebulite.Checkpoint(f"global_step{step}", 2)
        ck.save("model", _state(step))
        ck.save("optimizer", {"lr": 0.1 * step, "moments": torch.ones(300_000) * step})
    nebulite.flush_persistence()
    assert _committed(store_url) == ["global_step2", "global_step3"]
    keys = _keys(store_url)
    assert not [k for k in keys if k.startswith("global_step1/")], "retention kept the oldest"
    assert not [k for k in keys if ".partial" in k], keys  # data files go straight to their name
    assert [k for k in keys if k.endswith("/COMMITTED")] == [
        k for k in keys if k.startswith(("global_step2/", "global_step3/")) and k.endswith("/COMMITTED")]

    nebulite.api._reset_for_tests()  # a fresh process: everything comes from the store
    listed = nebulite.list_checkpoints(persist_path=store_url)
    assert sorted(c["tag"] for c in listed) == ["global_step2", "global_step3"]
    latest = nebulite.get_latest_checkpoint(persist_path=store_url)
    assert latest.tag == "global_step3"
    _assert_state(latest.load("model"), 3)
    assert torch.equal(latest.load("optimizer")["moments"], torch.ones(300_000) * 3)
    older = nebulite.get_checkpoint(tag="global_step2", persist_path=store_url)
    _assert_state(older.load("model"), 2)
    path = nebulite.get_latest_checkpoint_path("model", persist_path=store_url)
    assert path.startswith(store_url + "/global_step3/") and path.endswith("/rank0/model")
    # A new session goes on in commit order after what is stored.
    nebulite.init(persistent_storage_path=store_url, num_of_version_in_retention=2)
    nebulite.Checkpoint("a").save("model", _state(4))
    nebulite.flush_persistence()
    assert _committed(store_url) == ["global_step3", "a"]


def test_a_damaged_object_is_caught_by_its_crc(store_url):
    nebulite.init(persistent_storage_path=store_url)
    nebulite.Checkpoint("t").save("model", _state(5))
    nebulite.flush_persistence()
    client = open_client(store_url)
    (data_key,) = [k for k in _keys(store_url) if k.endswith("/rank0/model")]
    size = client.head(data_key)[0]
    data = bytearray(client.get(data_key, 0, size, None))
    data[size // 2] ^= 0xFF
    client.put(data_key, [memoryview(bytes(data))], False)
    nebulite.api._reset_for_tests()
    with pytest.warns(UserWarning, match="fails its CRC-32 check"):
        assert nebulite.get_checkpoint(tag="t", persist_path=store_url).tag == ""  # skipped


def test_an_unsupported_scheme_is_refused_at_init(tmp_path):
    for url in ("memory://bucket/x", "hdfs://namenode/ckpt", "ftp://host/x"):
        with pytest.raises(InvalidArgumentError, match="s3://") as e:
            nebulite.init(persistent_storage_path=url)
        assert url.split("://")[0] in str(e.value)
    assert not os.path.exists("memory:") and not os.path.exists("hdfs:")
    with pytest.raises(InvalidArgumentError, match="bucket"):
        nebulite.init(persistent_storage_path="s3://")


def test_the_agent_persists_after_its_trainer_was_sigkilled(store_url, agent_env):
    code = f"""
        import os, signal, torch, nebulite
        nebulite.init(persistent_storage_path={store_url!r}, agent=True,
                      memory_buffer_size=128 << 20)
        ck = nebulite.Checkpoint("last", 2)
        ck.save("a", torch.full((4_000_000,), 7, dtype=torch.int32))
        ck.save("b", {{"step": 9, "t": torch.ones(10)}})
        os.kill(os.getpid(), signal.SIGKILL)  # right after save() returned
    """
    r = _child(code)
    assert r.returncode == -signal.SIGKILL, r.stderr
    deadline = time.monotonic() + HANG_TIMEOUT
    while "last" not in _committed(store_url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _committed(store_url) == ["last"]
    ck = nebulite.get_latest_checkpoint(persist_path=store_url)
    assert torch.equal(ck.load("a"), torch.full((4_000_000,), 7, dtype=torch.int32))
    assert ck.load("b")["step"] == 9


@pytest.fixture
def persistent_azurite(monkeypatch):
    """An Azurite of this test alone, keeping its data across a kill and a restart."""
    emu = start_azurite(persist=True)
    try:
        for k in list(os.environ):
            if k.startswith(("AWS_", "AZURE_", "STORAGE_EMULATOR_HOST", "GOOGLE_")):
                monkeypatch.delenv(k)
        for k, v in emu.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("NEBULITE_STORE_RETRY_SECONDS", "3")
        yield emu
    finally:
        emu.stop()


def test_the_endpoint_killed_mid_upload_leaves_the_previous_checkpoint(persistent_azurite):
    url = persistent_azurite.new_url()
    nebulite.init(persistent_storage_path=url)
    nebulite.Checkpoint("good").save("model", _state(1))
    nebulite.flush_persistence()
    # Azurite writes its metadata to disk every few seconds: wait until the commit is
    # there, so that the restarted Azurite has it (a real store has it once the put returned).
    persistent_azurite.wait_saved([k for k in _keys(url) if k.endswith("/COMMITTED")][0])
    # A large checkpoint, and the store dies while it is being uploaded.
    nebulite.Checkpoint("torn").save("model", _state(2, n=48_000_000))
    deadline = time.monotonic() + HANG_TIMEOUT
    while not any(c["tag"] == "torn" for c in nebulite.list_checkpoints()) and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    persistent_azurite.kill()
    with pytest.raises(PersistError) as e:
        nebulite.flush_persistence()
    assert url in str(e.value) or "torn" in str(e.value)
    nebulite.api._reset_for_tests()
    persistent_azurite.restart()
    assert _committed(url) == ["good"]  # nothing of the torn one is committed
    latest = nebulite.get_latest_checkpoint(persist_path=url)
    assert latest.tag == "good"
    _assert_state(latest.load("model"), 1)


@pytest.mark.parametrize("status", [503, 429, 500])
def test_throttling_and_server_errors_are_retried(moto_s3, monkeypatch, status):
    with FaultProxy(moto_s3.endpoint) as proxy:
        for k, v in moto_s3.env_for(proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        url = moto_s3.new_url()
        nebulite.init(persistent_storage_path=url)
        proxy.fail_next(4, status=status, methods=("PUT",))
        nebulite.Checkpoint("t").save("model", _state(3))
        nebulite.flush_persistence()  # no error: every refused request was sent again
        assert proxy.injected == 4
        nebulite.api._reset_for_tests()
        _assert_state(nebulite.get_latest_checkpoint(persist_path=url).load("model"), 3)


def test_a_store_that_keeps_failing_ends_in_a_persist_error(moto_s3, monkeypatch):
    monkeypatch.setenv("NEBULITE_STORE_RETRY_SECONDS", "2")
    with FaultProxy(moto_s3.endpoint) as proxy:
        for k, v in moto_s3.env_for(proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        url = moto_s3.new_url()
        nebulite.init(persistent_storage_path=url)
        nebulite.Checkpoint("good").save("model", _state(1))
        nebulite.flush_persistence()
        proxy.fail_always(status=503, methods=("PUT", "POST"))
        nebulite.Checkpoint("bad").save("model", _state(2))
        with pytest.raises(PersistError, match="503|Service Unavailable|SlowDown|retr"):
            nebulite.flush_persistence()
        proxy.clear()
        nebulite.api._reset_for_tests()
        assert _committed(url) == ["good"]
        _assert_state(nebulite.get_latest_checkpoint(persist_path=url).load("model"), 1)


def test_the_command_line_reads_an_object_store(store_url, tmp_path):
    nebulite.init(persistent_storage_path=store_url)
    nebulite.Checkpoint("global_step7").save("model", _state(7))
    nebulite.flush_persistence()
    nebulite.shutdown()
    env = dict(os.environ)
    out = {}
    for args in (["ls", store_url], ["verify", store_url, "--all"], ["show", store_url, "global_step7"],
                 ["history", store_url], ["gc", store_url, "--dry-run"],
                 ["export", store_url, "global_step7", "--to", str(tmp_path / "pt")]):
        r = subprocess.run([sys.executable, "-m", "nebulite.cli", *args], env=env,
                           capture_output=True, text=True, timeout=HANG_TIMEOUT)
        assert r.returncode == 0, (args, r.stderr)
        out[args[0]] = r.stdout
    assert "global_step7" in out["ls"] and "global_step7" in out["show"]
    assert "global_step7" in out["history"]
    (exported,) = (tmp_path / "pt").iterdir()
    _assert_state(torch.load(exported, weights_only=True), 7)


# -- the frameworks, with an object store as the persistent path ------------------------


def test_deepspeeds_nebula_engine_with_a_url_persistent_path(tmp_path, store_url):
    """DeepSpeed's own NebulaCheckpointEngine, its "nebula" block naming the store's URL:
    save and commit, load from memory and, in a new session, from the store."""
    import test_deepspeed as ds

    save_dir = tmp_path / "ds"
    (save_dir / "global_step3").mkdir(parents=True)
    path = str(save_dir / "global_step3" / ds.MODEL)
    state = {"module": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3}
    engine = ds._engine(store_url)
    info = ds._commit_info("global_step3", save_dir)
    engine.create(info)
    engine.save(state, path)
    assert engine.commit(info) is True
    from_memory = engine.load(path, map_location=lambda storage, loc: storage)
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    from_store = ds._engine(store_url).load(path, map_location=torch.device("cpu"))
    for loaded in (from_memory, from_store):
        assert loaded["step"] == 3 and torch.equal(loaded["module"]["w"], state["module"]["w"])
    assert _committed(store_url) == ["global_step3"]


def test_deepspeed_zero3_two_ranks_persist_to_and_load_from_an_object_store(tmp_path, moto_s3, monkeypatch):
    """Two DeepSpeed ranks, ZeRO 3, the "nebula" block naming an S3 URL: each scenario of
    DeepSpeed's own checkpoint tests loads straight after saving, through the store."""
    import test_deepspeed as ds

    for k, v in moto_s3.env.items():
        monkeypatch.setenv(k, v)
    url = moto_s3.new_url()
    nebula = {"enabled": True, "persistent_storage_path": url, "persistent_time_interval": 100}
    results = ds._run_reload_worker(tmp_path, 2, nebula, ds._child_env())
    for rank, result in enumerate(results):
        for scenario, got in result.items():
            assert got["placeholders"] == [], (rank, scenario)
            assert got["files_differ"] == [], (rank, scenario)
    assert _committed(url), "nothing was committed in the store"


def _assert_resumes(tmp_path, callback, first, ckpt_paths) -> None:
    """Each of `ckpt_paths` resumes a new trainer (in a fresh nebulite session) at step 4
    with the weights `first` ended with, bit for bit."""
    from nebulite.integrations.lightning import NebulaCheckpointIO
    from test_lightning import _trainer
    from lightning_worker import Probe, TinyModule, loader

    for ckpt_path in ckpt_paths:
        nebulite.api._reset_for_tests()  # a new process, as far as nebulite is concerned
        resumed = Probe()
        _trainer(tmp_path, 6, [callback(), resumed], [NebulaCheckpointIO()]).fit(
            TinyModule(), loader(), ckpt_path=ckpt_path)
        assert resumed.seen["start_step"] == 4, ckpt_path
        assert resumed.seen["start_weights"] == first.seen["end_weights"]  # bit for bit


def test_lightning_saves_to_and_resumes_from_an_object_store(tmp_path, store_url):
    """NebulaCheckpointIO with NebulaCallback, config_params naming the store's URL: the
    checkpoints are committed there, and a new process resumes from one bit for bit."""
    from nebulite.integrations.lightning import NebulaCallback, NebulaCheckpointIO
    from test_lightning import _trainer
    from lightning_worker import Probe, TinyModule, loader

    def callback() -> NebulaCallback:
        return NebulaCallback(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2, save_top_k=-1, save_last=True,
                              config_params={"persistent_storage_path": store_url})

    first = Probe()
    _trainer(tmp_path, 4, [callback(), first], [NebulaCheckpointIO()]).fit(TinyModule(), loader())
    assert sorted(_committed(store_url)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    # Each path Lightning recorded is a pointer file naming its checkpoint in the store.
    for name in ("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"):
        pointer = json.loads((tmp_path / "ckpts" / name).read_text())
        assert pointer["store"] == store_url and pointer["tag"] == name, pointer
        assert not (tmp_path / "ckpts" / name).is_symlink()

    _assert_resumes(tmp_path, callback, first, ["last", str(tmp_path / "ckpts" / "epoch=0-step=4.ckpt")])


@pytest.mark.parametrize("scheme", ["abfs", "abfss"])
def test_adls_gen2_urls_reach_the_account_s_blob_endpoint(azurite, monkeypatch, scheme):
    """abfs[s]://<container>@<account>.dfs.core.windows.net/<prefix>: the container and
    account from the URL, the keys from the connection string."""
    for k, v in azurite.env.items():
        monkeypatch.setenv(k, v)
    prefix = azurite.new_url().split("/", 3)[3]
    url = f"{scheme}://{azurite.container}@devstoreaccount1.dfs.core.windows.net/{prefix}"
    nebulite.init(persistent_storage_path=url)
    nebulite.Checkpoint("t").save("model", _state(6))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    _assert_state(nebulite.get_checkpoint(tag="t", persist_path=url).load("model"), 6)
    # The same objects, by their az:// name.
    assert _committed(f"az://{azurite.container}/{prefix}") == ["t"]


def test_a_dead_run_s_abandoned_multipart_upload_is_aborted(moto_s3, monkeypatch):
    """An upload cut short by a crash stays hidden in S3 (and billed) until it is aborted:
    the next run's clean-up of dead runs aborts those older than the grace period."""
    import boto3

    for k, v in moto_s3.env.items():
        monkeypatch.setenv(k, v)
    url = moto_s3.new_url()
    prefix = url.split("/", 3)[3]
    s3 = boto3.client("s3")
    started = s3.create_multipart_upload(Bucket=moto_s3.container,
                                         Key=f"{prefix}/t/vdeadrun-000001/rank0/model")
    s3.upload_part(Bucket=moto_s3.container, Key=f"{prefix}/t/vdeadrun-000001/rank0/model",
                   UploadId=started["UploadId"], PartNumber=1, Body=b"x" * (5 << 20))
    other = s3.create_multipart_upload(Bucket=moto_s3.container, Key="elsewhere/model")

    # (moto dates every upload in 2010, so the grace cannot be seen to keep a recent one.)
    nebulite.init(persistent_storage_path=url, dead_run_grace=60)
    uploads = s3.list_multipart_uploads(Bucket=moto_s3.container).get("Uploads", [])
    assert [u["UploadId"] for u in uploads] == [other["UploadId"]]  # only below the prefix
    s3.abort_multipart_upload(Bucket=moto_s3.container, Key="elsewhere/model", UploadId=other["UploadId"])


def _pointer(url: str) -> dict:
    from nebulite.stores import files

    return json.loads(files.read_bytes(url, 4096))


@pytest.mark.parametrize("how", ["callback", "model_checkpoint"])
def test_lightning_checkpoint_directory_in_an_object_store(tmp_path, store_url, how):
    """``dirpath="s3://..."`` (and az://, gs://): every path Lightning records is a pointer
    object at that URL naming its checkpoint in the store; Lightning's own checks of the
    directory see them, the trainer resumes from one bit for bit (``ckpt_path="last"`` with
    NebulaCallback; an explicit URL with either), and the paths top-k drops are removed."""
    import lightning as L

    from nebulite.integrations.lightning import NebulaCallback, NebulaCheckpointIO
    from nebulite.stores import files
    from test_lightning import _trainer
    from lightning_worker import Probe, TinyModule, loader

    dirpath = store_url + "-lightning/ckpts"

    def callback(where: str = dirpath, store: str = store_url, top_k: int = -1):
        if how == "callback":
            return NebulaCallback(dirpath=where, every_n_train_steps=2, save_top_k=top_k, save_last=True,
                                  config_params={"persistent_storage_path": store})
        # What to keep is ModelCheckpoint's decision (save_top_k), not retention's.
        nebulite.init(persistent_storage_path=store, rank=0, world_size=1, num_of_version_in_retention=0)
        return L.pytorch.callbacks.ModelCheckpoint(dirpath=where, every_n_train_steps=2, save_top_k=top_k,
                                                   save_last=True)

    first = Probe()
    _trainer(tmp_path, 4, [callback(), first], [NebulaCheckpointIO()]).fit(TinyModule(), loader())
    names = ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert sorted(_committed(store_url)) == names
    listed, _ = files.listdir(dirpath)
    assert [e.url.rsplit("/", 1)[1] for e in listed] == names
    for name in names:
        pointer = _pointer(f"{dirpath}/{name}")
        assert (pointer["nebulite_checkpoint"], pointer["store"], pointer["tag"]) == (1, store_url, name)
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(("s3:", "az:", "gs:"))]

    # "last" first: each resumed run saves step 6 and moves last.ckpt there.
    resumes = (["last"] if how == "callback" else []) + [f"{dirpath}/epoch=0-step=4.ckpt"]
    _assert_resumes(tmp_path, callback, first, resumes)

    # save_top_k=1: the paths Lightning drops are removed, and their versions leave the store.
    nebulite.api._reset_for_tests()
    where, store = dirpath + "-top1", store_url + "-top1"
    _trainer(tmp_path, 6, [callback(where, store, top_k=1)], [NebulaCheckpointIO()]).fit(TinyModule(), loader())
    listed, _ = files.listdir(where)
    kept = [e.url.rsplit("/", 1)[1] for e in listed]
    assert len(kept) == 2 and kept[0].endswith("-step=6.ckpt") and kept[1] == "last.ckpt", kept
    assert sorted(_committed(store)) == kept


def test_saving_a_checkpoint_waits_for_no_request_to_the_store(moto_s3, monkeypatch):
    # save() returns once the state is in memory: committing a checkpoint must not wait for
    # the store, whose requests take milliseconds to seconds. With every request to the
    # store held unanswered, a checkpoint kept in memory (within persistent_time_interval)
    # and one to be persisted (an interval of 0) are saved and committed all the same; their
    # requests go out from the background once the store answers again.
    from nebulite.cli.history import read_rows

    with FaultProxy(moto_s3.endpoint) as proxy:
        for k, v in moto_s3.env_for(proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        url = moto_s3.new_url()
        for interval, tag in ((3600, "in_memory"), (0, "persisted")):
            nebulite.init(persistent_storage_path=url, persistent_time_interval=interval,
                          num_of_version_in_retention=5)
            nebulite.Checkpoint(f"before_{tag}").save("model", _state(1))
            nebulite.flush_persistence()

            def saves(tag: str = tag) -> None:
                ck = nebulite.Checkpoint(tag, 2)
                ck.save("model", _state(2))
                ck.save("optimizer", {"lr": 0.1})

            proxy.hold()
            try:
                t = threading.Thread(target=saves)
                t.start()
                # A save that sent a request would wait until the client's own timeout (300
                # s): 120 s tells the two apart, whatever the load.
                t.join(120)
                assert not t.is_alive(), f"saving {tag!r} waited for a request to the store"
            finally:
                proxy.release()
            assert nebulite.list_checkpoints()[0]["tag"] == tag  # the newest first
            nebulite.flush_persistence()
            _assert_state(nebulite.get_latest_checkpoint().load("model"), 2)
            nebulite.api._reset_for_tests()
        # (shutdown persisted the checkpoint kept in memory)
        assert _committed(url) == ["before_in_memory", "in_memory", "before_persisted", "persisted"]
        outcomes = {(r["tag"], r["outcome"]) for r in read_rows(url)}
        assert ("in_memory", "in_memory") in outcomes and ("persisted", "committed") in outcomes

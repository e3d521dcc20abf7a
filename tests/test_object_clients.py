"""The object-store clients (nebulite.stores) against real emulators: Azurite, moto and
gcp-storage-emulator, each behind a fault-injecting proxy where a test needs faults."""

from __future__ import annotations

import os
import re
import threading
import uuid

import pytest
from conftest import HANG_TIMEOUT

from http_faults import FaultProxy
from object_stores import (  # noqa: F401 - fixtures
    azurite,
    gcs_emulator,
    import_stores,
    moto_s3,
    object_store,
    store_env,
    store_url,
)

stores = import_stores()
from nebulite.errors import InvalidArgumentError  # noqa: E402

MiB = 1 << 20


def pattern(n: int, seed: int = 0) -> bytes:
    block = bytes((i * 31 + seed) & 0xFF for i in range(4093))  # period prime to parts
    return (block * (n // len(block) + 1))[:n]


def put(client, key: str, data: bytes, if_absent: bool = False) -> None:
    mv = memoryview(data)
    client.put(key, [mv], if_absent)
    mv.release()  # BufferError if the client kept an export of it


def read_all(client, key: str) -> bytes:
    size, _, etag = client.head(key)
    return bytes(client.get(key, 0, size, etag)) if size else b""


@pytest.fixture
def client(store_url):
    return stores.open_client(store_url)


# --- round trips -------------------------------------------------------------------------


def test_put_get_head_roundtrip(client):
    put(client, "a/b.bin", b"hello world")
    size, mtime_ns, etag = client.head("a/b.bin")
    assert size == 11 and mtime_ns > 1_600_000_000 * 10**9 and etag
    assert bytes(client.get("a/b.bin", 0, 11, None)) == b"hello world"
    assert bytes(client.get("a/b.bin", 6, 5, etag)) == b"world"
    assert bytes(client.get("a/b.bin", 6, 100, None)) == b"world"  # short at the end
    assert bytes(client.get("a/b.bin", 11, 4, None)) == b""  # at the end
    put(client, "a/b.bin", b"replaced")
    assert read_all(client, "a/b.bin") == b"replaced"


def test_put_of_several_views_and_formats(client):
    parts = [b"abc", b"", b"defgh", b"i"]
    client.put("v", [memoryview(p) for p in parts], False)
    assert read_all(client, "v") == b"abcdefghi"
    import array

    a = array.array("I", range(1000))
    mv = memoryview(a)  # format "I", itemsize 4: sent as its bytes
    client.put("ints", [mv], False)
    mv.release()
    assert read_all(client, "ints") == a.tobytes()


def test_zero_length_object(client):
    put(client, "empty", b"")
    size, _, etag = client.head("empty")
    assert size == 0
    assert bytes(client.get("empty", 0, 0, etag)) == b""
    assert bytes(client.get("empty", 0, 10, None)) == b""
    client.put("empty2", [], False)
    assert client.head("empty2")[0] == 0


def test_missing_objects(client):
    with pytest.raises(FileNotFoundError):
        client.head("nope")
    with pytest.raises(FileNotFoundError):
        client.get("nope", 0, 10, None)
    with pytest.raises(FileNotFoundError):
        client.copy("nope", "other")
    client.delete("nope")  # not an error


def test_list_recursive_and_not(client):
    for k in ("top.txt", "d1/a", "d1/b", "d1/sub/c", "d2/x", "d10/y"):
        put(client, k, k.encode())
    objects, dirs = client.list("", False)
    assert [o[0] for o in objects] == ["top.txt"] and objects[0][1] == len("top.txt")
    assert sorted(dirs) == ["d1", "d10", "d2"]
    objects, dirs = client.list("d1/", False)
    assert sorted(o[0] for o in objects) == ["d1/a", "d1/b"] and dirs == ["d1/sub"]
    objects, dirs = client.list("d1/", True)
    assert sorted(o[0] for o in objects) == ["d1/a", "d1/b", "d1/sub/c"] and dirs == []
    assert all(o[2] > 0 for o in objects)
    objects, _ = client.list("", True)
    assert len(objects) == 6
    assert client.list("nothing/", True) == ([], [])


def test_copy_and_delete(client):
    put(client, "src", b"payload")
    client.copy("src", "dir/dst")
    assert read_all(client, "dir/dst") == b"payload"
    client.delete("src")
    with pytest.raises(FileNotFoundError):
        client.head("src")
    assert read_all(client, "dir/dst") == b"payload"


def test_multipart_upload_of_a_large_view(client, monkeypatch):
    monkeypatch.setenv("NEBULITE_STORE_PART_BYTES", str(5 * MiB))
    monkeypatch.setenv("NEBULITE_STORE_CONCURRENCY", "4")
    c = stores.open_client(client.url)
    data = pattern(42 * MiB + 12345)
    put(c, "big.bin", data)
    size, _, etag = c.head("big.bin")
    assert size == len(data)
    assert bytes(c.get("big.bin", 0, size, etag)) == data
    off = 17 * MiB + 3
    assert bytes(c.get("big.bin", off, 3 * MiB, etag)) == data[off : off + 3 * MiB]
    # From several views that cross part boundaries too.
    views = [memoryview(data)[i : i + 7 * MiB + 1] for i in range(0, len(data), 7 * MiB + 1)]
    c.put("big2.bin", views, False)
    for v in views:
        v.release()
    assert read_all(c, "big2.bin") == data
    # Nothing temporary is left next to the objects.
    assert sorted(o[0] for o in c.list("", True)[0]) == ["big.bin", "big2.bin"]


def test_many_parts_compose_recursively(gcs_emulator, monkeypatch):
    """GCS composes at most 32 objects at a time: 70 parts take two levels."""
    for k, v in gcs_emulator.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("NEBULITE_STORE_PART_BYTES", str(1 * MiB))
    c = stores.open_client(gcs_emulator.new_url())
    data = pattern(70 * MiB - 5, seed=3)
    put(c, "k", data)
    assert read_all(c, "k") == data
    assert [o[0] for o in c.list("", True)[0]] == ["k"]


# --- conditional operations -------------------------------------------------------------


@pytest.mark.parametrize("size", [10, 12 * MiB], ids=["small", "multipart"])
def test_if_absent_refuses_an_existing_key(client, monkeypatch, size):
    monkeypatch.setenv("NEBULITE_STORE_PART_BYTES", str(5 * MiB))
    c = stores.open_client(client.url)
    first, second = pattern(size, 1), pattern(size, 2)
    put(c, "once", first, if_absent=True)
    with pytest.raises(FileExistsError):
        put(c, "once", second, if_absent=True)
    assert read_all(c, "once") == first
    assert [o[0] for o in c.list("", True)[0]] == ["once"]


def test_get_with_a_stale_etag(client, object_store):
    if object_store.scheme == "gs":
        pytest.skip("gcp-storage-emulator ignores ifGenerationMatch (GCS enforces it)")
    put(client, "k", b"version 1")
    etag = client.head("k")[2]
    put(client, "k", b"version 2")
    with pytest.raises(stores.ObjectChangedError):
        client.get("k", 0, 4, etag)
    assert isinstance(stores.ObjectChangedError("x"), OSError)


def test_put_keeps_no_reference_to_the_views(client, monkeypatch):
    monkeypatch.setenv("NEBULITE_STORE_PART_BYTES", str(5 * MiB))
    c = stores.open_client(client.url)
    buf = bytearray(pattern(11 * MiB))
    for key, if_absent in (("a", False), ("b", True), ("small", False)):
        mv = memoryview(buf) if key != "small" else memoryview(buf)[:100]
        ro = mv.toreadonly()
        c.put(key, [ro, ro[:10]], if_absent)
        ro.release()
        mv.release()  # raises BufferError where an export is still held
    buf.extend(b"x")  # a bytearray with exports cannot be resized


def test_put_failure_keeps_no_reference(object_store, store_env, monkeypatch):
    monkeypatch.setenv("NEBULITE_STORE_RETRY_SECONDS", "0.5")
    with FaultProxy(_upstream(object_store)) as proxy:
        _point_at(object_store, proxy, monkeypatch)
        c = stores.open_client(object_store.new_url())
        proxy.fail_always(503)
        buf = bytearray(1000)
        mv = memoryview(buf)
        with pytest.raises(OSError):
            c.put("k", [mv], False)
        mv.release()


# --- faults ------------------------------------------------------------------------------


def _upstream(emu) -> str:
    return f"http://127.0.0.1:{emu.port}"


def _point_at(emu, proxy: FaultProxy, monkeypatch) -> None:
    for k, v in emu.env_for(proxy.endpoint).items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("status", [503, 429, 500])
def test_transient_failures_are_retried(object_store, store_env, monkeypatch, status):
    monkeypatch.setenv("NEBULITE_STORE_PART_BYTES", str(5 * MiB))
    with FaultProxy(_upstream(object_store)) as proxy:
        _point_at(object_store, proxy, monkeypatch)
        c = stores.open_client(object_store.new_url())
        data = pattern(12 * MiB, 5)
        for methods in (("PUT", "POST"), ("GET",)):
            proxy.fail_next(2, status=status, methods=methods)
            if methods == ("GET",):
                assert read_all(c, "big") == data
                assert bytes(c.get("small", 0, 5, None)) == b"small"
            else:
                put(c, "small", b"small")
                proxy.fail_next(3, status=status, methods=methods)
                put(c, "big", data)  # some parts fail, then succeed
            assert proxy.injected >= 2
            proxy.clear()
            proxy.reset_counters()
        proxy.fail_next(2, status=status)
        assert c.head("small")[0] == 5
        proxy.fail_next(2, status=status)
        assert [o[0] for o in c.list("", True)[0]] == ["big", "small"]


def test_a_gs_client_sends_no_request_beside_its_calls(gcs_emulator, monkeypatch):
    """google-cloud-storage (3.17 and later) fetches a bucket's metadata on a thread of its
    own at a client's first call, for tracing attributes; nebulite's client asks for none.
    That request would need storage.buckets.get, which a checkpoint writer may lack, and
    it would run alongside the calls (a fault test counting one call's requests met it)."""
    before = set(threading.enumerate())
    with FaultProxy(_upstream(gcs_emulator)) as proxy:
        _point_at(gcs_emulator, proxy, monkeypatch)
        c = stores.open_client(gcs_emulator.new_url())
        put(c, "k", b"data")
        assert read_all(c, "k") == b"data"
        # What the calls left running (a client's own threads) ends before the count.
        for t in set(threading.enumerate()) - before:
            if not t.name.endswith(("(serve_forever)", "(process_request_thread)")):
                t.join(timeout=HANG_TIMEOUT)
        on_the_bucket = [r for r in proxy.requests
                         if re.fullmatch(r"/storage/v1/b/[^/?]+(\?.*)?", r[1])]
        assert on_the_bucket == [], proxy.requests


def test_connection_resets_are_retried(object_store, store_env, monkeypatch):
    with FaultProxy(_upstream(object_store)) as proxy:
        _point_at(object_store, proxy, monkeypatch)
        c = stores.open_client(object_store.new_url())
        proxy.reset_next(1, methods=("PUT", "POST"))
        put(c, "k", b"data")
        proxy.reset_next(1, methods=("GET",))
        assert read_all(c, "k") == b"data"


def test_persistent_failure_ends_with_a_typed_error(object_store, store_env, monkeypatch):
    monkeypatch.setenv("NEBULITE_STORE_RETRY_SECONDS", "1")
    with FaultProxy(_upstream(object_store)) as proxy:
        _point_at(object_store, proxy, monkeypatch)
        url = object_store.new_url()
        c = stores.open_client(url)
        put(c, "k", b"data")
        proxy.fail_always(503)
        for call in (lambda: put(c, "k2", b"x"), lambda: c.get("k", 0, 4, None), lambda: c.head("k")):
            sent = len(proxy.requests)
            with pytest.raises(stores.ObjectStoreError) as info:
                call()
            assert url in str(info.value) and "/k" in str(info.value)
            # One request, retried at most 10 times: nothing else spends a second budget.
            tried = proxy.requests[sent:]
            assert len({m for m, _, _ in tried}) == 1 and 1 <= len(tried) <= 11, tried
        assert 2 <= proxy.injected <= 3 * 11
        proxy.clear()
        proxy.fail_always(403)
        with pytest.raises(PermissionError):
            c.head("k")


def test_emulator_restart_is_survived(monkeypatch):
    """Connection refused while the store is down, then the same data after a restart."""
    import object_stores

    emu = object_stores.start_azurite(persist=True)
    try:
        for k, v in emu.env.items():
            monkeypatch.setenv(k, v)
        c = stores.open_client(emu.new_url())
        put(c, "k", b"persisted")
        emu.wait_saved(c.url.rsplit("/", 1)[1] + "/k")
        emu.kill()
        monkeypatch.setenv("NEBULITE_STORE_RETRY_SECONDS", "1")
        with pytest.raises(stores.ObjectStoreError):
            stores.open_client(c.url).head("k")
        emu.restart()
        assert read_all(c, "k") == b"persisted"  # the same client reconnects
    finally:
        emu.stop()


# --- URLs --------------------------------------------------------------------------------


def test_unsupported_scheme():
    for url in ("ftp://host/x", "http://host/x", "hdfs://nn/x", "nope"):
        with pytest.raises(InvalidArgumentError) as info:
            stores.open_client(url)
        for scheme in ("az://", "abfs://", "abfss://", "s3://", "gs://", "file://"):
            assert scheme in str(info.value)
    with pytest.raises(InvalidArgumentError):
        stores.open_client("s3://")


def test_is_url():
    assert stores.is_url("s3://b/p") and stores.is_url("az://c") and stores.is_url("gs://b")
    assert not stores.is_url("/tmp/x") and not stores.is_url("file:///tmp/x")
    assert not stores.is_url("relative/path") and not stores.is_url(None)
    assert set(stores.SCHEMES) == {"az", "abfs", "abfss", "s3", "gs"}


def test_adls_urls_reach_the_blob_endpoint(azurite, monkeypatch):
    for k, v in azurite.env.items():
        monkeypatch.setenv(k, v)
    prefix = "t-" + uuid.uuid4().hex[:8]
    account = "devstoreaccount1"
    for url in (
        f"abfs://{azurite.container}@{account}.dfs.core.windows.net/{prefix}",
        f"abfss://{azurite.container}/{prefix}",
    ):
        c = stores.open_client(url)
        put(c, "k", url.encode())
        assert read_all(stores.open_client(f"az://{azurite.container}/{prefix}"), "k") == url.encode()


def test_azure_account_and_key_variables(azurite, monkeypatch):
    """Without a connection string: account name and key, the endpoint from obstore's own
    variable."""
    from object_stores import AZURITE_ACCOUNT, AZURITE_KEY

    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", AZURITE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_KEY", AZURITE_KEY)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", azurite.endpoint)
    c = stores.open_client(azurite.new_url())
    put(c, "k", b"v")
    assert read_all(c, "k") == b"v"


def test_tuning_from_environment(monkeypatch):
    monkeypatch.setenv("NEBULITE_STORE_PART_BYTES", "12")
    with pytest.raises(InvalidArgumentError):
        stores.StoreTuning.from_env()
    monkeypatch.setenv("NEBULITE_STORE_PART_BYTES", str(8 * MiB))
    monkeypatch.setenv("NEBULITE_STORE_CONCURRENCY", "3")
    monkeypatch.setenv("NEBULITE_STORE_RETRY_SECONDS", "2.5")
    t = stores.StoreTuning.from_env()
    assert (t.part_bytes, t.concurrency, t.retry_seconds) == (8 * MiB, 3, 2.5)
    monkeypatch.delenv("NEBULITE_STORE_PART_BYTES")
    assert stores.StoreTuning.from_env().part_bytes == 16 * MiB
    assert os.environ.get("NEBULITE_STORE_CONCURRENCY") == "3"


def test_failed_multipart_upload_leaves_nothing(object_store, store_env, monkeypatch):
    """S3: the multipart upload is aborted; GCS: the composite's parts are deleted; Azure
    has no abort (uncommitted blocks expire in the store) but no blob appears."""
    monkeypatch.setenv("NEBULITE_STORE_PART_BYTES", str(5 * MiB))
    monkeypatch.setenv("NEBULITE_STORE_RETRY_SECONDS", "0.5")
    with FaultProxy(_upstream(object_store)) as proxy:
        _point_at(object_store, proxy, monkeypatch)
        url = object_store.new_url()
        c = stores.open_client(url)
        # The upload's last step fails: S3's complete, GCS's compose, Azure's block list.
        last = {"s3": ("POST", "uploadId="), "gs": ("POST", "/compose"), "az": ("PUT", "blocklist")}
        method, marker = last[object_store.scheme]
        proxy.fail_next(1 << 30, status=503, methods=(method,), path_contains=marker)
        with pytest.raises(stores.ObjectStoreError):
            put(c, "k", pattern(12 * MiB))
        proxy.clear()
        assert c.list("", True) == ([], [])
        if object_store.scheme == "s3":
            import boto3

            s3 = boto3.client("s3", endpoint_url=object_store.endpoint, **_aws_keys(object_store))
            uploads = s3.list_multipart_uploads(Bucket=object_store.container).get("Uploads", [])
            assert [u for u in uploads if u["Key"].startswith(url.split("/", 3)[3])] == []


def _aws_keys(emu) -> dict:
    env = emu.env
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_REGION"],
    }

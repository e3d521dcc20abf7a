"""Small files at object-store URLs (nebulite.stores.files) and the fsspec filesystem over
them (nebulite.stores._fsspec), on each emulator: what Lightning's checkpoint directory in
an object store is made of."""

from __future__ import annotations

import datetime
import importlib
import io

import fsspec
import pytest
import torch

from nebulite.errors import InvalidArgumentError
from nebulite.stores import _fsspec, files

from object_stores import azurite, gcs_emulator, moto_s3, object_store, store_env, store_url  # noqa: F401


def test_files_write_read_list_remove(store_url):
    assert files.kind(store_url) is None  # nothing below the fresh prefix yet
    files.write_bytes(f"{store_url}/d/a.json", b'{"a": 1}')
    files.write_bytes(f"{store_url}/d/e/b", b"bb")
    assert files.kind(f"{store_url}/d/a.json") == "file"
    assert files.kind(f"{store_url}/d") == files.kind(f"{store_url}/d/e/") == "directory"
    assert files.kind(f"{store_url}/d/a") is None  # a prefix of a key's name is not a directory
    assert files.read_bytes(f"{store_url}/d/a.json", 100) == b'{"a": 1}'
    with pytest.raises(ValueError, match="more than the 3 expected"):
        files.read_bytes(f"{store_url}/d/a.json", 3)
    with pytest.raises(FileNotFoundError):
        files.read_bytes(f"{store_url}/d/missing", 100)
    listed, dirs = files.listdir(f"{store_url}/d")
    assert [(e.url, e.size) for e in listed] == [(f"{store_url}/d/a.json", 8)]
    assert dirs == [f"{store_url}/d/e"]
    entry = files.stat(f"{store_url}/d/e/b")
    assert entry.size == 2 and entry.mtime_ns > 0
    files.write_bytes(f"{store_url}/d/a.json", b"{}")  # replaced whole
    assert files.read_bytes(f"{store_url}/d/a.json", 100) == b"{}"
    files.remove(f"{store_url}/d/a.json")
    files.remove(f"{store_url}/d/a.json")  # a missing file is not an error
    assert files.kind(f"{store_url}/d/a.json") is None


def test_files_refuse_what_is_not_an_object_store():
    for url in ("/tmp/x", "memory://x/y", "s3:///key"):
        with pytest.raises(InvalidArgumentError):
            files.split(url)


def test_fsspec_filesystem_does_what_lightning_asks_of_a_directory(store_url):
    scheme = store_url.split("://")[0]
    fs = _fsspec.filesystem_class(scheme)()  # ours, whatever else is registered
    path = fs._strip_protocol(store_url)
    assert not fs.exists(path)
    fs.makedirs(f"{path}/run", exist_ok=True)  # a directory is a prefix: nothing is made
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with fs.open(f"{path}/run/last.ckpt", "wb") as f:
        f.write(buffer.getvalue())
    with fs.open(f"{store_url}/run/best_k_models.yaml", "w") as f:  # text mode, full URL
        f.write("a: 1\n")
    assert fs.exists(f"{path}/run") and fs.isdir(f"{path}/run") and fs.isfile(f"{path}/run/last.ckpt")
    assert fs.ls(f"{path}/run", detail=False) == [f"{path}/run/best_k_models.yaml", f"{path}/run/last.ckpt"]
    assert fs.info(f"{path}/run/last.ckpt")["size"] == len(buffer.getvalue())
    assert isinstance(fs.modified(f"{path}/run/last.ckpt"), datetime.datetime)
    with fs.open(f"{path}/run/last.ckpt", "rb") as f:  # ranged reads of the version opened
        f.seek(10)
        assert f.read(20) == buffer.getvalue()[10:30]
        f.seek(0)
        assert torch.equal(torch.load(f, weights_only=True)["w"], state["w"])
    assert fs.cat_file(f"{path}/run/best_k_models.yaml") == b"a: 1\n"
    with pytest.raises(RuntimeError):
        with fs.open(f"{path}/run/torn", "wb") as f:
            f.write(b"half")
            raise RuntimeError("cut short")
    assert not fs.exists(f"{path}/run/torn")  # a write left by an error puts nothing
    with fs.transaction:  # as Lightning's _atomic_save writes
        with fs.open(f"{path}/run/in-transaction", "wb") as f:
            f.write(b"x")
        assert not fs.exists(f"{path}/run/in-transaction")
    assert fs.cat_file(f"{path}/run/in-transaction") == b"x"
    with pytest.raises(FileExistsError):
        with fs.open(f"{path}/run/last.ckpt", "xb") as f:
            f.write(b"x")
    fs.cp_file(f"{path}/run/last.ckpt", f"{path}/run/copy.ckpt")
    assert fs.cat_file(f"{path}/run/copy.ckpt") == buffer.getvalue()
    fs.rm(f"{path}/run/last.ckpt")
    assert not fs.exists(f"{path}/run/last.ckpt")
    with pytest.raises(ValueError, match="not supported"):
        fs.open(f"{path}/run/x", "ab")


def test_registered_only_where_no_fsspec_package_serves_the_scheme(monkeypatch):
    """nebulite's filesystem fills in for a missing s3fs/adlfs/gcsfs; one that is installed,
    or a filesystem registered already, is left alone."""
    registry = importlib.import_module("fsspec.registry")

    class Registered(fsspec.AbstractFileSystem):
        protocol = "gs"

    saved = dict(registry._registry)
    monkeypatch.setitem(_fsspec.PACKAGES, "s3", "json")  # a package that is installed
    monkeypatch.setitem(_fsspec.PACKAGES, "az", "no_such_package_here")
    try:
        for scheme in _fsspec.PACKAGES:
            registry._registry.pop(scheme, None)
        registry._registry["gs"] = Registered
        registered = _fsspec.register_missing()
        assert "s3" not in registered and "gs" not in registered and "az" in registered
        assert fsspec.get_filesystem_class("gs") is Registered
        assert "s3" not in fsspec.registry
        assert fsspec.get_filesystem_class("az") is _fsspec.filesystem_class("az")
    finally:
        registry._registry.clear()
        registry._registry.update(saved)
    ours = _fsspec.filesystem_class("s3")
    assert ours is _fsspec.filesystem_class("s3") and ours is not _fsspec.filesystem_class("gs")
    assert ours.protocol == "s3" and issubclass(ours, _fsspec.ObjectStoreFileSystem)


def test_the_lightning_integration_registers_the_missing_schemes():
    import nebulite.integrations.lightning  # noqa: F401

    for scheme, package in _fsspec.PACKAGES.items():
        cls = fsspec.get_filesystem_class(scheme)
        if _fsspec.importlib.util.find_spec(package) is None:
            assert cls is _fsspec.filesystem_class(scheme)
        else:
            assert cls is not _fsspec.filesystem_class(scheme)

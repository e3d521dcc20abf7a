"""Format compatibility: the golden v1 store (tests/golden/v1) must stay loadable forever.

These tests never write the golden files; they read a copy in tmp. See tests/golden/README.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

import nebulite as nm
from nebulite import _core

GOLDEN_V1 = Path(__file__).parent / "golden" / "v1"

_spec = importlib.util.spec_from_file_location("golden_v1_expected", GOLDEN_V1 / "expected.py")
expected_v1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(expected_v1)

DESCRIBED = json.loads((GOLDEN_V1 / "expected.json").read_text())
ALL_FILES = [(tag, name) for tag, names in expected_v1.COMMITS for name in names]


@pytest.fixture
def golden_store(tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(GOLDEN_V1 / "store", dst)
    return str(dst)


def assert_same(got, want, path="obj"):
    """Exact structural equality: types, dtypes, shapes, strides and values."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert got.stride() == want.stride(), f"{path}: stride {got.stride()} != {want.stride()}"
        assert got.storage_offset() == want.storage_offset(), path
        assert got.device.type == "cpu", path
        assert torch.equal(got, want), f"{path}: values differ"
        # bit-exact (torch.equal treats -0.0 == 0.0)
        assert got.reshape(-1).contiguous().view(torch.uint8).tolist() == want.reshape(-1).contiguous().view(torch.uint8).tolist(), path
    elif isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _get(obj, keys):
    for k in keys:
        obj = obj[k]
    return obj


def assert_shared_storage(obj, tag, name):
    for view_keys, base_keys in expected_v1.SHARED_STORAGE.get((tag, name), []):
        view, base = _get(obj, view_keys), _get(obj, base_keys)
        assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), (view_keys, base_keys)
        base_before = base.clone()
        view.add_(1)  # writes through to the base
        assert not torch.equal(base, base_before), f"{view_keys} does not write through to {base_keys}"


def _data_files(root):
    """(tag, name, relative path) of every data file, found through catalog and manifests."""
    entries, problems = _core.read_catalog(root)
    assert problems == []
    out = []
    for e in sorted(entries, key=lambda e: e["seq"]):
        for r in range(e["world_size"]):
            m = _core.read_manifest(root, e["tag"], e["version"], r)
            assert (m["tag"], m["version"], m["rank"], m["world_size"]) == (e["tag"], e["version"], r, 1)
            for name, size, crc in m["files"]:
                out.append((e["tag"], name, _core.data_file_path(e["tag"], e["version"], r, name), size, crc))
    return out


def test_golden_files_are_small_and_complete():
    files = [p for p in GOLDEN_V1.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sum(p.stat().st_size for p in files) < 200 * 1024
    assert DESCRIBED["format_version"] == 1
    assert [(c["tag"], [f["name"] for f in c["files"]]) for c in DESCRIBED["commits"]] == [
        (t, list(n)) for t, n in expected_v1.COMMITS
    ]


def test_catalog_and_latest(golden_store):
    entries, problems = _core.read_catalog(golden_store)
    assert problems == []
    assert [(e["tag"], e["seq"]) for e in sorted(entries, key=lambda e: e["seq"])] == [
        ("global_step5", 1),
        ("global_step10", 2),
    ]
    latest = nm.get_latest_checkpoint(persist_path=golden_store)
    assert latest.tag == "global_step10"  # by commit order; "global_step5" > "global_step10" as strings
    assert latest.list_names() == ["model"]
    assert_same(latest.load("model"), expected_v1.model_step10())

    listed = nm.list_checkpoints(persist_path=golden_store)
    assert [(c["tag"], c["seq"], c["names"]) for c in listed] == [
        ("global_step10", 2, ["model"]),
        ("global_step5", 1, ["model", "optimizer"]),
    ]


@pytest.mark.parametrize("weights_only", [True, False])
def test_get_checkpoint_loads_expected_values(golden_store, weights_only):
    ck = nm.get_checkpoint(tag="global_step5", persist_path=golden_store)
    assert ck.tag == "global_step5"
    assert ck.list_names() == ["model", "optimizer"]
    for name in ("model", "optimizer"):
        got = ck.load(name, weights_only=weights_only)
        assert_same(got, expected_v1.expected("global_step5", name))
        assert_shared_storage(got, "global_step5", name)


def test_manifests_match_expected_json(golden_store):
    described = {(c["tag"], f["name"]): f for c in DESCRIBED["commits"] for f in c["files"]}
    found = _data_files(golden_store)
    assert [(t, n) for t, n, *_ in found] == ALL_FILES
    for tag, name, rel, size, crc in found:
        d = described[(tag, name)]
        assert (size, f"{crc:08x}") == (d["size"], d["crc32"])
        path = os.path.join(golden_store, rel)
        assert os.path.getsize(path) == size
        _core.verify_data_file(golden_store, rel, name, size, crc)
        a = _core.StoredArchive.open(golden_store, rel)
        assert a.prefix == "archive"
        assert [r[0] for r in a.records()] == d["records"]


@pytest.mark.parametrize("how", ["latest_path", "manifest"])
@pytest.mark.parametrize("mode", ["default", "weights_only", "mmap", "mmap_weights_only"])
def test_torch_load_without_nebulite(golden_store, how, mode):
    kwargs = {
        "default": {"weights_only": False},
        "weights_only": {"weights_only": True},
        "mmap": {"mmap": True, "weights_only": False},
        "mmap_weights_only": {"mmap": True, "weights_only": True},
    }[mode]
    if how == "latest_path":
        files = [("global_step10", name, nm.get_latest_checkpoint_path(name, persist_path=golden_store))
                 for name in ("model",)]
        files.append(("global_step5", "optimizer",
                      nm.get_latest_checkpoint_path("optimizer", persist_path=golden_store)))
    else:
        files = [(t, n, os.path.join(golden_store, rel)) for t, n, rel, _, _ in _data_files(golden_store)]
    assert len(files) == (2 if how == "latest_path" else 3)
    for tag, name, path in files:
        got = torch.load(path, map_location="cpu", **kwargs)
        assert_same(got, expected_v1.expected(tag, name), f"{tag}/{name}")
        assert_shared_storage(got, tag, name)


def test_zip_structure(golden_store):
    for tag, name, rel, size, _ in _data_files(golden_store):
        path = os.path.join(golden_store, rel)
        raw = Path(path).read_bytes()
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None
            infos = z.infolist()
            names = [i.filename for i in infos]
            assert len(set(names)) == len(names)
            assert all(n.startswith("archive/") for n in names)
            index = json.loads(z.read("archive/.nebulite/index.json"))
            assert z.read("archive/.storage_alignment") == b"4096"
            assert z.read("archive/version") == b"3\n"
            assert z.read("archive/byteorder") == b"little"
        assert index["format"] == "nebulite" and index["format_version"] == 1
        assert (index["tag"], index["name"], index["rank"]) == (tag, name, 0)

        expected_header = 0
        for info in infos:
            assert info.compress_type == zipfile.ZIP_STORED and info.flag_bits == 0
            assert info.compress_size == info.file_size
            assert info.header_offset == expected_header, "no holes between records"
            sig, *_, nlen, xlen = struct.unpack_from("<IHHHHHIIIHH", raw, info.header_offset)
            assert sig == 0x04034B50
            payload = info.header_offset + 30 + nlen + xlen
            assert payload % 4096 == 0, f"{tag}/{name}: {info.filename} payload at {payload}"
            # the padding field "NB" (0x4E42) ends the local extra fields
            extra = raw[info.header_offset + 30 + nlen:payload]
            pos, ids = 0, []
            while pos < len(extra):
                hid, hlen = struct.unpack_from("<HH", extra, pos)
                ids.append(hid)
                pos += 4 + hlen
            assert pos == len(extra) and ids[-1] == 0x4E42
            expected_header = payload + info.file_size
        # the tail (central directory, end records) follows the last payload
        eocd = struct.unpack_from("<IHHHHIIH", raw, len(raw) - 22)
        assert eocd[0] == 0x06054B50 and eocd[6] == expected_header and eocd[7] == 0
        assert eocd[6] + eocd[5] == len(raw) - 22

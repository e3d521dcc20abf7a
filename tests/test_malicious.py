"""Untrusted data files: crafted and fuzzed archives are rejected with CorruptCheckpointError.

tests/golden/malicious/<case>.nbz.gz are data files crafted by scripts/make_golden.py from
valid.nbz.gz (a small valid data file), gzip-compressed. The reader must reject each one
with CorruptCheckpointError: never another exception, a crash, a hang or a huge allocation.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
from conftest import HANG_TIMEOUT
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nebulite as nm
import nebulite.api
from nebulite import CorruptCheckpointError, NebuliteError, _core

MALICIOUS = Path(__file__).parent / "golden" / "malicious"

#: case -> where the reader must reject it: "open" (StoredArchive.open, i.e. while the
#: directory is parsed, before any payload is read) or "read" (a payload's CRC-32).
CASES = {
    "truncated_eocd": "open",
    "truncated_mid_payload": "open",
    "empty": "open",
    "cd_offset_past_eof": "open",
    "cd_size_past_eof": "open",
    "cd_size_just_past_eof": "open",
    "zip64_locator_outside": "open",
    "cd_claims_1e9_entries": "open",
    "cd_count_unholdable": "open",
    "overlap_local_header": "open",
    "local_offset_past_cd": "open",
    "local_offset_into_payload": "open",
    "local_extra_past_cd": "open",
    "zip64_field_missing": "open",
    "zip64_offset_overflow": "open",
    "compression_deflate": "open",
    "encrypted_flag": "open",
    "sizes_disagree": "open",
    "duplicate_names": "open",
    "dotdot_name": "open",
    "name_with_nul": "open",
    "local_name_mismatch": "open",
    "crc_mismatch": "read",
    "record_size_2p62": "open",
    "multi_disk": "open",
    "eocd_comment_length_lies": "open",
}


def crafted(case: str) -> bytes:
    return gzip.decompress((MALICIOUS / f"{case}.nbz.gz").read_bytes())


VALID = crafted("valid")


def base_object() -> dict:
    """What valid.nbz.gz holds (see scripts/make_golden.py)."""
    return {"a": torch.arange(64, dtype=torch.int32), "b": torch.tensor([1.0, 2.0, 3.0])}


def _zip_records(raw: bytes, tmp: Path) -> dict[str, bytes]:
    p = tmp / "ref.zip"
    p.write_bytes(raw)
    with zipfile.ZipFile(p) as z:
        return {i.filename.split("/", 1)[1]: z.read(i) for i in z.infolist()}


def read_all(root: str, rel: str) -> dict[str, bytes]:
    a = _core.StoredArchive.open(root, rel)
    return {name: a.read(name) for name, *_ in a.records()}


def test_every_file_has_an_expectation():
    files = {p.name[: -len(".nbz.gz")] for p in MALICIOUS.glob("*.nbz.gz")}
    assert files == set(CASES) | {"valid"}
    assert sum(p.stat().st_size for p in MALICIOUS.iterdir()) < 100 * 1024


def test_valid_control_reads(tmp_path):
    (tmp_path / "valid").write_bytes(VALID)
    got = read_all(str(tmp_path), "valid")
    assert got == _zip_records(VALID, tmp_path)
    obj = torch.load(tmp_path / "valid", weights_only=True)
    assert torch.equal(obj["a"], base_object()["a"]) and torch.equal(obj["b"], base_object()["b"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_reader_rejects(tmp_path, case):
    (tmp_path / case).write_bytes(crafted(case))
    if CASES[case] == "open":
        with pytest.raises(CorruptCheckpointError):
            _core.StoredArchive.open(str(tmp_path), case)
    else:
        a = _core.StoredArchive.open(str(tmp_path), case)
        with pytest.raises(CorruptCheckpointError):
            for name, *_ in a.records():
                a.read(name)
            buf = torch.empty(max(r[2] for r in a.records()), dtype=torch.uint8)
            for name, *_ in a.records():
                a.read_into(name, buf.data_ptr(), 4)


def test_no_crash_hang_or_huge_allocation(tmp_path):
    """All cases in a child process with a 1 GiB address-space allowance and a time limit."""
    for case in list(CASES) + ["valid"]:
        (tmp_path / case).write_bytes(crafted(case))
    child = textwrap.dedent(
        """
        import json, resource, sys
        from nebulite import _core, CorruptCheckpointError
        def vm_bytes():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        allowance = vm_bytes() + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (allowance, allowance))
        out = {}
        for case in sys.argv[2:]:
            try:
                a = _core.StoredArchive.open(sys.argv[1], case)
                for name, *_ in a.records():
                    a.read(name)
                out[case] = "ok"
            except CorruptCheckpointError:
                out[case] = "corrupt"
            except BaseException as e:
                out[case] = type(e).__name__ + ": " + str(e)
        print(json.dumps(out))
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(Path(nm.__file__).parent.parent), env.get("PYTHONPATH")] if p)
    proc = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path), *CASES, "valid"],
        capture_output=True, text=True, timeout=HANG_TIMEOUT, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {**{c: "corrupt" for c in CASES}, "valid": "ok"}


# ---------------------------------------------------------------------------
# The same files as data files of a committed checkpoint in a store.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def template_store(tmp_path_factory):
    """A store with two committed checkpoints: "good" (seq 1) then "bad" (seq 2)."""
    root = tmp_path_factory.mktemp("template") / "store"
    nm.init(persistent_storage_path=str(root), persistent_time_interval=0,
            num_of_version_in_retention=0, memory_buffer_size=64 << 20)
    try:
        nm.Checkpoint("good", num_files=1).save("obj", base_object())
        nm.Checkpoint("bad", num_files=1).save("obj", base_object())
        nm.flush_persistence()
    finally:
        nebulite.api._reset_for_tests()
    return root


@pytest.fixture
def store(template_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(template_store, root)
    entries, problems = _core.read_catalog(str(root))
    assert problems == [] and sorted(e["tag"] for e in entries) == ["bad", "good"]
    bad = next(e for e in entries if e["tag"] == "bad")
    return str(root), bad


def _data_path(root, entry):
    return os.path.join(root, _core.data_file_path(entry["tag"], entry["version"], 0, "obj"))


def _reseal(root: str, entry: dict, data: bytes) -> None:
    """Rewrites the manifest and commit marker so that they vouch for `data` (an attacker
    or a buggy writer that produced a consistent store around a bad file)."""
    vdir = Path(root) / entry["tag"] / entry["version"]

    def with_end(lines):
        body = "".join(line + "\n" for line in lines).encode()
        return body + f"end {zlib.crc32(body):08x}\n".encode()

    lines = (vdir / "rank0.manifest").read_text().splitlines()[:-1]
    lines = [f"file {len(data)} {zlib.crc32(data):08x} obj" if ln.startswith("file ") else ln for ln in lines]
    manifest = with_end(lines)
    (vdir / "rank0.manifest").write_bytes(manifest)
    lines = (vdir / "COMMITTED").read_text().splitlines()[:-1]
    lines = [f"manifest 0 {zlib.crc32(manifest):08x}" if ln.startswith("manifest ") else ln for ln in lines]
    (vdir / "COMMITTED").write_bytes(with_end(lines))


def _assert_obj(got):
    want = base_object()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_store_skips_damaged_file(store, case):
    root, bad = store
    with open(_data_path(root, bad), "wb") as f:
        f.write(crafted(case))
    with pytest.warns(UserWarning, match=r"skipping damaged checkpoint 'bad'"):
        latest = nm.get_latest_checkpoint(persist_path=root)
    assert latest.tag == "good"
    _assert_obj(latest.load("obj"))
    assert nm.get_checkpoint(tag="bad", persist_path=root).tag == ""
    good_path = nm.get_latest_checkpoint_path("obj", persist_path=root)
    assert "/good/" in good_path
    _assert_obj(torch.load(good_path, weights_only=True))


@pytest.mark.parametrize("case", sorted(CASES))
def test_handle_load_rejects_file_damaged_after_verification(store, case):
    root, bad = store
    handle = nm.get_checkpoint(tag="bad", persist_path=root)
    assert handle.tag == "bad"
    with open(_data_path(root, bad), "wb") as f:
        f.write(crafted(case))
    # The handle's first load returns the bytes it read and verified when it was taken;
    # every later read of the damaged file is rejected.
    _assert_obj(handle.load("obj"))
    with pytest.raises(CorruptCheckpointError):
        handle.load("obj")


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_rejects_file_with_consistent_manifest(store, case):
    """Manifest and marker vouch for the bad bytes: verification passes, the reader rejects."""
    root, bad = store
    data = crafted(case)
    with open(_data_path(root, bad), "wb") as f:
        f.write(data)
    _reseal(root, bad, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        latest = nm.get_latest_checkpoint(persist_path=root)
    assert latest.tag == "bad"
    with pytest.raises(CorruptCheckpointError):
        latest.load("obj")
    with pytest.raises(CorruptCheckpointError):
        latest.load("obj", weights_only=False)


def test_reseal_control(store):
    """_reseal itself keeps a valid store valid (so the test above is not vacuous)."""
    root, bad = store
    data = Path(_data_path(root, bad)).read_bytes()
    _reseal(root, bad, data)
    nebulite.api._reset_for_tests()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        latest = nm.get_latest_checkpoint(persist_path=root)
    assert latest.tag == "bad"
    _assert_obj(latest.load("obj"))


# ---------------------------------------------------------------------------
# Fuzzing: random damage to a valid file gives the right data or CorruptCheckpointError.
# ---------------------------------------------------------------------------


def _regions(raw: bytes) -> list[tuple[int, int]]:
    """Byte ranges worth damaging: local headers (with their first extra bytes), payloads,
    and the tail (central directory and end record)."""
    import struct

    regions = []
    eocd = len(raw) - 22
    cdsize, cdoff = struct.unpack_from("<II", raw, eocd + 12)
    pos = cdoff
    while pos < cdoff + cdsize:
        (nlen, xlen, clen) = struct.unpack_from("<HHH", raw, pos + 28)
        (off,) = struct.unpack_from("<I", raw, pos + 42)
        (csize,) = struct.unpack_from("<I", raw, pos + 20)
        lnlen, lxlen = struct.unpack_from("<HH", raw, off + 26)
        data = off + 30 + lnlen + lxlen
        regions.append((off, off + 30 + lnlen + 8))
        if csize:
            regions.append((data, data + csize))
        pos += 46 + nlen + xlen + clen
    regions.append((cdoff, len(raw)))
    regions.append((eocd, len(raw)))
    return regions


REGIONS = _regions(VALID)


@st.composite
def damage(draw):
    """A short list of damage operations (kept symbolic so that failures print small)."""
    ops = []
    size = len(VALID)
    for _ in range(draw(st.integers(1, 3))):
        lo, hi = draw(st.sampled_from(REGIONS + [(0, size)]))
        hi = min(hi, size)
        if lo >= hi:
            continue
        kind = draw(st.sampled_from(["flip", "overwrite", "truncate", "set_ff", "insert", "delete"]))
        pos = draw(st.integers(lo, hi - 1))
        if kind == "flip":
            ops.append((kind, pos, draw(st.integers(0, 7))))
        elif kind in ("overwrite", "insert"):
            ops.append((kind, pos, draw(st.binary(min_size=1, max_size=16))))
        elif kind == "set_ff":
            ops.append((kind, pos, draw(st.sampled_from([1, 2, 4, 8]))))
        elif kind == "truncate":
            ops.append((kind, pos, None))
        else:
            ops.append((kind, pos, draw(st.integers(1, 64))))
        size = len(apply_damage(VALID, ops))
    return ops


def apply_damage(raw: bytes, ops) -> bytes:
    out = bytearray(raw)
    for kind, pos, arg in ops:
        pos = min(pos, len(out))
        if kind == "flip":
            if pos < len(out):
                out[pos] ^= 1 << arg
        elif kind == "overwrite":
            out[pos:pos + len(arg)] = arg
        elif kind == "set_ff":
            out[pos:pos + arg] = b"\xff" * arg
        elif kind == "truncate":
            del out[pos:]
        elif kind == "insert":
            out[pos:pos] = arg
        else:
            del out[pos:pos + arg]
    return bytes(out)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    return d, _zip_records(VALID, d)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=damage())
def test_fuzz_reader(fuzz_dir, ops):
    d, reference = fuzz_dir
    (d / "f").write_bytes(apply_damage(VALID, ops))
    try:
        a = _core.StoredArchive.open(str(d), "f")
        records = a.records()
        got = {name: a.read(name) for name, *_ in records}
        buf = torch.empty(max([r[2] for r in records] + [1]), dtype=torch.uint8)
        for name, _, size, _ in records:
            a.read_into(name, buf.data_ptr(), 2)
            assert bytes(buf[:size].numpy()) == got[name]
    except CorruptCheckpointError:
        return
    except NebuliteError as e:
        pytest.fail(f"{type(e).__name__} (a NebuliteError, not CorruptCheckpointError): {e}")
    # Accepted: it must be exactly the original records (a harmless change, e.g. DOS time).
    assert got == reference


# ---------------------------------------------------------------------------
# Names that are not UTF-8 are corruption, never a UnicodeDecodeError.
# ---------------------------------------------------------------------------


def _craft(mutate) -> bytes:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        import make_golden
    finally:
        sys.path.pop(0)
    z = make_golden.Zip(VALID)
    mutate(z)
    return z.build()


def test_non_utf8_name_in_error_message(tmp_path):
    # One record's name (central and local) starts with byte 0x80: "does not share the prefix".
    data = _craft(lambda z: z.rename(z.entry("data/1"), b"\x80rchive/data/1"))
    (tmp_path / "f").write_bytes(data)
    with pytest.raises(CorruptCheckpointError):
        _core.StoredArchive.open(str(tmp_path), "f")


@pytest.mark.parametrize("which", ["record_name", "prefix"])
def test_non_utf8_record_names(tmp_path, which):
    def mutate(z):
        if which == "record_name":
            z.rename(z.entry("data/1"), b"archive/data/\xff")
        else:
            for e in z.entries:
                z.rename(e, b"\x80" + e.name[1:])

    (tmp_path / "f").write_bytes(_craft(mutate))
    with pytest.raises(CorruptCheckpointError, match="UTF-8|prefix"):
        _core.StoredArchive.open(str(tmp_path), "f")


def test_non_utf8_directory_in_store(template_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(template_store, root)
    # A stray copy of tag "good" under a name that is not UTF-8 (its marker names "good").
    shutil.copytree(os.fsencode(root / "good"), os.fsencode(root) + b"/good\xff")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        latest = nm.get_latest_checkpoint(persist_path=str(root))
    assert latest.tag == "bad"

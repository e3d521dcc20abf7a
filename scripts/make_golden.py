#!/usr/bin/env python3
"""Writes the format-compatibility fixtures under tests/golden/.

    PYTHONPATH=python .venv/bin/python scripts/make_golden.py v1         # once, ever
    PYTHONPATH=python .venv/bin/python scripts/make_golden.py malicious  # crafted files

`v1` writes tests/golden/v1/store (a persistent store written by the current library)
and tests/golden/v1/expected.json. It refuses to overwrite an existing store: golden
files of a released format are never regenerated (see tests/golden/README.md); a new
format version gets a new folder beside (`v2`, ...), written by a new subcommand.

`malicious` writes tests/golden/malicious/<case>.nbz.gz: data files crafted from a small
valid one, gzip-compressed to keep the repository small (each is ~40 KB of mostly zero
padding uncompressed). tests/test_malicious.py lists them from MALICIOUS_CASES.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
sys.path.insert(0, str(REPO / "python"))

# ---------------------------------------------------------------------------
# A minimal zip model: enough to parse a nebulite data file and write it back.
# ---------------------------------------------------------------------------

LFH = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
CDH = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
EOCD = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
Z64EOCD = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory, 56 bytes
Z64LOC = struct.Struct("<IIQI")  # zip64 locator, 20 bytes
SIG_LFH, SIG_CDH, SIG_EOCD = 0x04034B50, 0x02014B50, 0x06054B50
SIG_Z64EOCD, SIG_Z64LOC = 0x06064B50, 0x07064B50


class Entry:
    """One central directory entry (fields by name) and what its local header says."""

    FIELDS = ("sig", "made", "need", "flags", "method", "time", "date", "crc", "csize", "usize",
              "nlen", "xlen", "clen", "disk", "iattr", "eattr", "offset")

    def __init__(self, raw: bytes, pos: int):
        vals = CDH.unpack_from(raw, pos)
        self.__dict__.update(zip(self.FIELDS, vals))
        p = pos + CDH.size
        self.name = raw[p:p + self.nlen]
        self.extra = raw[p + self.nlen:p + self.nlen + self.xlen]
        self.comment = raw[p + self.nlen + self.xlen:p + self.nlen + self.xlen + self.clen]
        self.end = p + self.nlen + self.xlen + self.clen
        lf = LFH.unpack_from(raw, self.offset)
        self.local_xlen = lf[10]
        self.data_offset = self.offset + LFH.size + lf[9] + lf[10]

    def pack(self) -> bytes:
        self.nlen, self.xlen, self.clen = len(self.name), len(self.extra), len(self.comment)
        return CDH.pack(*(getattr(self, f) for f in self.FIELDS)) + self.name + self.extra + self.comment


class Zip:
    """body = everything before the central directory (local headers and payloads)."""

    def __init__(self, raw: bytes):
        (sig, _, _, _, count, cdsize, cdoff, clen) = EOCD.unpack_from(raw, len(raw) - EOCD.size)
        assert sig == SIG_EOCD and clen == 0 and count < 0xFFFF, "unexpected test input"
        self.body = bytearray(raw[:cdoff])
        self.entries: list[Entry] = []
        pos = cdoff
        for _ in range(count):
            e = Entry(raw, pos)
            self.entries.append(e)
            pos = e.end
        assert pos == cdoff + cdsize

    def entry(self, name: str) -> Entry:
        return next(e for e in self.entries if e.name == b"archive/" + name.encode())

    def set_local(self, e: Entry, **fields: int) -> None:
        """Rewrites fields of `e`'s local header in the body."""
        names = ("sig", "need", "flags", "method", "time", "date", "crc", "csize", "usize", "nlen", "xlen")
        vals = dict(zip(names, LFH.unpack_from(self.body, e.offset)))
        vals.update(fields)
        LFH.pack_into(self.body, e.offset, *(vals[n] for n in names))

    def set_crc(self, e: Entry) -> None:
        """Recomputes `e`'s CRC (central and local) from its current payload bytes."""
        e.crc = zlib.crc32(self.body[e.data_offset:e.data_offset + e.usize])
        self.set_local(e, crc=e.crc)

    def rename(self, e: Entry, new: bytes) -> None:
        assert len(new) == len(e.name), "renames keep the length"
        self.body[e.offset + LFH.size:e.offset + LFH.size + len(new)] = new
        e.name = new

    def cd(self) -> bytes:
        return b"".join(e.pack() for e in self.entries)

    def build(self, *, count: int | None = None, cdsize: int | None = None, cdoff: int | None = None,
              zip64: tuple[int, int] | None = None, z64_count: int | None = None) -> bytes:
        """The file: body, central directory, [zip64 record + locator], end record.

        zip64=(record_offset_in_locator, total_entries) writes a locator (and, when
        record_offset_in_locator is None, a real zip64 record before it)."""
        cd = self.cd()
        off = len(self.body)
        out = bytes(self.body) + cd
        n = len(self.entries) if count is None else count
        size = len(cd) if cdsize is None else cdsize
        where = off if cdoff is None else cdoff
        if z64_count is not None:  # a real zip64 end record whose count is z64_count
            rec_off = len(out)
            out += Z64EOCD.pack(SIG_Z64EOCD, 44, 45, 45, 0, 0, z64_count, z64_count, size, where)
            out += Z64LOC.pack(SIG_Z64LOC, 0, rec_off, 1)
        elif zip64 is not None:
            out += Z64LOC.pack(SIG_Z64LOC, 0, zip64[0], 1)
        return out + EOCD.pack(SIG_EOCD, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                               min(size, 0xFFFFFFFF), min(where, 0xFFFFFFFF), 0)


# ---------------------------------------------------------------------------
# Malicious cases. Each returns the crafted bytes from the valid base file.
# "open": StoredArchive.open must reject it; "read": open may succeed, reading
# every record must then raise (a CRC mismatch is only seen when the payload is read).
# ---------------------------------------------------------------------------


def _truncated_eocd(raw: bytes) -> bytes:
    return raw[:-10]


def _truncated_mid_payload(raw: bytes) -> bytes:
    z = Zip(raw)
    return raw[:z.entry("data/0").data_offset + 100]


def _empty(raw: bytes) -> bytes:
    return b""


def _cd_offset_past_eof(raw: bytes) -> bytes:
    z = Zip(raw)
    return z.build(cdoff=len(raw) + 4096)


def _cd_size_past_eof(raw: bytes) -> bytes:
    z = Zip(raw)
    return z.build(cdsize=0xFFFFFFF0)


def _zip64_locator_outside(raw: bytes) -> bytes:
    z = Zip(raw)
    return z.build(count=0xFFFF, zip64=(1 << 40, 0))


def _cd_claims_1e9_entries(raw: bytes) -> bytes:
    z = Zip(raw)
    return z.build(z64_count=10**9)


def _cd_count_unholdable(raw: bytes) -> bytes:
    # 0xFFFE entries (no zip64 needed) in a directory of 9 entries' bytes.
    z = Zip(raw)
    return z.build(count=0xFFFE)


def _overlap_local_header(raw: bytes) -> bytes:
    # A complete, valid-looking local header + payload for `version` is planted inside
    # data/0's payload (whose CRC is fixed up), and `version`'s directory entry points at
    # it: every check passes except "no two records overlap".
    z = Zip(raw)
    host, victim = z.entry("data/0"), z.entry("version")
    payload = bytes(z.body[victim.data_offset:victim.data_offset + victim.usize])
    fake = LFH.pack(SIG_LFH, 20, 0, 0, 0, 0x21, victim.crc, victim.usize, victim.usize,
                    len(victim.name), 0) + victim.name + payload
    at = host.data_offset + 16
    assert len(fake) + 16 <= host.usize
    z.body[at:at + len(fake)] = fake
    z.set_crc(host)
    victim.offset = at
    return z.build()


def _local_offset_past_cd(raw: bytes) -> bytes:
    z = Zip(raw)
    z.entry("byteorder").offset = len(z.body) + 8
    return z.build()


def _local_offset_into_payload(raw: bytes) -> bytes:
    # An entry whose local header offset points into another record's payload (no header there).
    z = Zip(raw)
    z.entry("version").offset = z.entry("data/0").data_offset + 8
    return z.build()


def _compression_deflate(raw: bytes) -> bytes:
    z = Zip(raw)
    e = z.entry("data/0")
    e.method = 8
    z.set_local(e, method=8)
    return z.build()


def _encrypted_flag(raw: bytes) -> bytes:
    z = Zip(raw)
    e = z.entry("data/0")
    e.flags = 1
    z.set_local(e, flags=1)
    return z.build()


def _sizes_disagree(raw: bytes) -> bytes:
    # compressed size != uncompressed size (method 0).
    z = Zip(raw)
    z.entry("data/0").csize += 1
    return z.build()


def _duplicate_names(raw: bytes) -> bytes:
    z = Zip(raw)
    z.rename(z.entry("data/1"), b"archive/data/0")
    return z.build()


def _dotdot_name(raw: bytes) -> bytes:
    z = Zip(raw)
    z.rename(z.entry("data/1"), b"../hive/data/1")
    return z.build()


def _local_name_mismatch(raw: bytes) -> bytes:
    z = Zip(raw)
    e = z.entry("data/1")
    z.body[e.offset + LFH.size + len(e.name) - 1:e.offset + LFH.size + len(e.name)] = b"7"
    return z.build()


def _crc_mismatch(raw: bytes) -> bytes:
    z = Zip(raw)
    e = z.entry("data/0")
    z.body[e.data_offset + 5] ^= 0x10
    return z.build()


def _record_size_2p62(raw: bytes) -> bytes:
    # data/0 claims 2^62 bytes through a ZIP64 extra field in its directory entry.
    z = Zip(raw)
    e = z.entry("data/0")
    e.csize = e.usize = 0xFFFFFFFF
    e.need = 45
    e.extra = struct.pack("<HHQQ", 1, 16, 1 << 62, 1 << 62)
    return z.build()


def _multi_disk(raw: bytes) -> bytes:
    out = bytearray(raw)
    struct.pack_into("<HH", out, len(out) - EOCD.size + 4, 1, 1)
    return bytes(out)


def _cd_size_just_past_eof(raw: bytes) -> bytes:
    # The directory's size (under every limit) runs past the end of the file.
    z = Zip(raw)
    return z.build(cdsize=len(z.cd()) + 100)


def _zip64_field_missing(raw: bytes) -> bytes:
    # 32-bit sizes set to 0xFFFFFFFF without the ZIP64 extra field that must hold them.
    z = Zip(raw)
    e = z.entry("data/0")
    e.csize = e.usize = 0xFFFFFFFF
    return z.build()


def _zip64_offset_overflow(raw: bytes) -> bytes:
    # A ZIP64 local header offset near 2^64: offset + header length overflows 64 bits.
    z = Zip(raw)
    e = z.entry("data/0")
    e.offset = 0xFFFFFFFF
    e.need = 45
    e.extra = struct.pack("<HHQ", 1, 8, (1 << 64) - 10)
    return z.build()


def _local_extra_past_cd(raw: bytes) -> bytes:
    # The local header's extra length moves the payload past the central directory.
    z = Zip(raw)
    e = z.entry(".data/serialization_id")
    z.set_local(e, xlen=0xFFFF)
    return z.build()


def _name_with_nul(raw: bytes) -> bytes:
    z = Zip(raw)
    z.rename(z.entry("data/1"), b"archive/dat\x00/1")
    return z.build()


def _eocd_comment_length_lies(raw: bytes) -> bytes:
    out = bytearray(raw)
    struct.pack_into("<H", out, len(out) - 2, 7)
    return bytes(out)


MALICIOUS_CASES = {
    "truncated_eocd": ("open", _truncated_eocd),
    "truncated_mid_payload": ("open", _truncated_mid_payload),
    "empty": ("open", _empty),
    "cd_offset_past_eof": ("open", _cd_offset_past_eof),
    "cd_size_past_eof": ("open", _cd_size_past_eof),
    "zip64_locator_outside": ("open", _zip64_locator_outside),
    "cd_claims_1e9_entries": ("open", _cd_claims_1e9_entries),
    "cd_count_unholdable": ("open", _cd_count_unholdable),
    "overlap_local_header": ("open", _overlap_local_header),
    "local_offset_past_cd": ("open", _local_offset_past_cd),
    "local_offset_into_payload": ("open", _local_offset_into_payload),
    "compression_deflate": ("open", _compression_deflate),
    "encrypted_flag": ("open", _encrypted_flag),
    "sizes_disagree": ("open", _sizes_disagree),
    "duplicate_names": ("open", _duplicate_names),
    "dotdot_name": ("open", _dotdot_name),
    "local_name_mismatch": ("open", _local_name_mismatch),
    "crc_mismatch": ("read", _crc_mismatch),
    "record_size_2p62": ("open", _record_size_2p62),
    "multi_disk": ("open", _multi_disk),
    "cd_size_just_past_eof": ("open", _cd_size_just_past_eof),
    "zip64_field_missing": ("open", _zip64_field_missing),
    "zip64_offset_overflow": ("open", _zip64_offset_overflow),
    "local_extra_past_cd": ("open", _local_extra_past_cd),
    "name_with_nul": ("open", _name_with_nul),
    "eocd_comment_length_lies": ("open", _eocd_comment_length_lies),
}


def base_object():
    """The object of the valid base file of the malicious cases: two storages."""
    import torch

    return {"a": torch.arange(64, dtype=torch.int32), "b": torch.tensor([1.0, 2.0, 3.0])}


# ---------------------------------------------------------------------------


def _expected_module():
    spec = importlib.util.spec_from_file_location("golden_v1_expected", GOLDEN / "v1" / "expected.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_v1(force: bool) -> None:
    import nebulite as nm
    from nebulite import _core

    store = GOLDEN / "v1" / "store"
    if store.exists():
        if not force:
            sys.exit(f"{store} exists: golden files are never regenerated (see tests/golden/README.md)")
        shutil.rmtree(store)
    exp = _expected_module()
    nm.init(persistent_storage_path=str(store), persistent_time_interval=0,
            num_of_version_in_retention=0, memory_buffer_size=64 << 20)
    for tag, names in exp.COMMITS:
        ck = nm.Checkpoint(tag, num_files=len(names))
        for name in names:
            ck.save(name, exp.expected(tag, name))
    nm.flush_persistence()
    nm.shutdown()
    (store / "checkpointHistories.csv").unlink(missing_ok=True)  # not part of the format

    entries, problems = _core.read_catalog(str(store))
    assert not problems, problems
    described = {"format_version": 1, "commits": []}
    for e in sorted(entries, key=lambda e: e["seq"]):
        m = _core.read_manifest(str(store), e["tag"], e["version"], 0)
        files = []
        for name, size, crc in m["files"]:
            rel = _core.data_file_path(e["tag"], e["version"], 0, name)
            records = [r[0] for r in _core.StoredArchive.open(str(store), rel).records()]
            files.append({"name": name, "size": size, "crc32": f"{crc:08x}", "records": records})
        described["commits"].append({"tag": e["tag"], "seq": e["seq"], "world_size": e["world_size"],
                                     "files": files})
    (GOLDEN / "v1" / "expected.json").write_text(json.dumps(described, indent=1) + "\n")
    total = sum(p.stat().st_size for p in (GOLDEN / "v1").rglob("*") if p.is_file())
    print(f"wrote {store} ({total} bytes in tests/golden/v1)")


def valid_base_file() -> bytes:
    """A small valid data file written by the current library."""
    import nebulite as nm

    with tempfile.TemporaryDirectory() as d:
        nm.init(persistent_storage_path=d, persistent_time_interval=0, num_of_version_in_retention=0,
                memory_buffer_size=64 << 20)
        nm.Checkpoint("base", num_files=1).save("obj", base_object())
        nm.flush_persistence()
        nm.shutdown()
        return Path(nm.get_latest_checkpoint_path("obj", persist_path=d)).read_bytes()


def make_malicious() -> None:
    out = GOLDEN / "malicious"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.nbz.gz"):
        old.unlink()
    raw = valid_base_file()
    with gzip.GzipFile(out / "valid.nbz.gz", "wb", mtime=0) as f:
        f.write(raw)
    for case, (_, fn) in MALICIOUS_CASES.items():
        data = fn(raw)
        with gzip.GzipFile(out / f"{case}.nbz.gz", "wb", mtime=0) as f:
            f.write(data)
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {len(MALICIOUS_CASES) + 1} files in {out} ({total} bytes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["v1", "malicious"])
    ap.add_argument("--force", action="store_true", help="overwrite the v1 store (never for a released format)")
    args = ap.parse_args()
    os.environ.pop("NEBULA_PERSISTENT_STORAGE_PATH", None)
    if args.what == "v1":
        make_v1(args.force)
    else:
        make_malicious()


if __name__ == "__main__":
    main()

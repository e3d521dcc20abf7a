// ArchiveIndex::Parse: reads and validates a zip archive's directory from untrusted
// bytes (docs/format.md, "Reader bounds"). Order of work:
//   1. find the end-of-central-directory record in the last 64 KiB + 22 bytes;
//   2. follow the zip64 locator to the zip64 end record when there is one;
//   3. bound the central directory (kMaxCentralDirectoryBytes, kMaxRecords) and read it;
//   4. parse each central entry (stored, unencrypted, sizes equal, zip64 fields);
//   5. read each local header: same name, payload inside the file before the directory;
//   6. check names (one prefix, unique) and that no two records overlap.
// Every offset and size is checked before use; nothing is allocated from an
// unchecked field. Alignment is not required: plain torch.save files parse too.
#include <algorithm>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "base/utf8.h"
#include "format/zip.h"
#include "nebulite/format.h"

namespace nebulite::format {
namespace {

using namespace zip;  // NOLINT(build/namespaces): the record constants read better bare.

bool CheckedAdd(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

std::string Hex(uint64_t v) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s;
  do {
    s.insert(s.begin(), kDigits[v & 0xF]);
    v >>= 4;
  } while (v != 0);
  return "0x" + s;
}

// Reads exactly n bytes at offset; the caller has checked offset + n <= file_size.
Status ReadExact(const ReadAtFn& read_at, uint64_t offset, size_t n, void* dst, const char* what) {
  if (n == 0) return Status::OK();
  Result<size_t> got = read_at(offset, n, dst);
  if (!got.ok()) return got.status().WithContext(std::string("reading ") + what);
  if (*got != n) {
    return Status::Corruption(std::string("short read of ") + what + " at offset " +
                              std::to_string(offset) + ": " + std::to_string(*got) + " of " +
                              std::to_string(n) + " bytes");
  }
  return Status::OK();
}

// Range [offset, offset + n) lies within [0, limit).
bool InRange(uint64_t offset, uint64_t n, uint64_t limit) {
  uint64_t end;
  return CheckedAdd(offset, n, &end) && end <= limit;
}

struct Directory {
  uint64_t entries = 0;
  uint64_t cd_offset = 0;
  uint64_t cd_size = 0;
  uint64_t cd_limit = 0;  // where the end records start; the directory ends at or before it
};

Result<Directory> ReadEndRecords(uint64_t file_size, const ReadAtFn& read_at) {
  if (file_size < kEndOfCentralDirSize) {
    return Status::Corruption("file of " + std::to_string(file_size) +
                              " bytes is too small to be a zip archive");
  }
  const uint64_t window = std::min<uint64_t>(file_size, kEndOfCentralDirSize + kMaxCommentSize);
  const uint64_t window_offset = file_size - window;
  std::vector<unsigned char> buf(window);
  NEBULITE_RETURN_IF_ERROR(ReadExact(read_at, window_offset, window, buf.data(), "archive end"));

  // The last EOCD signature whose comment ends exactly at the end of the file.
  uint64_t eocd = UINT64_MAX;
  for (uint64_t i = window - kEndOfCentralDirSize + 1; i-- > 0;) {
    if (Get32(&buf[i]) == kEndOfCentralDirSig &&
        i + kEndOfCentralDirSize + Get16(&buf[i + 20]) == window) {
      eocd = i;
      break;
    }
  }
  if (eocd == UINT64_MAX) {
    return Status::Corruption("end of central directory record not found (not a zip archive?)");
  }
  const unsigned char* e = &buf[eocd];
  const uint64_t eocd_offset = window_offset + eocd;
  Directory d;
  const uint16_t disk = Get16(e + 4), cd_disk = Get16(e + 6);
  const uint16_t disk_entries = Get16(e + 8);
  d.entries = Get16(e + 10);
  d.cd_size = Get32(e + 12);
  d.cd_offset = Get32(e + 16);
  d.cd_limit = eocd_offset;

  // A zip64 locator sits immediately before the EOCD record.
  bool zip64 = false;
  if (eocd_offset >= kZip64LocatorSize) {
    unsigned char loc[kZip64LocatorSize];
    const uint64_t loc_offset = eocd_offset - kZip64LocatorSize;
    if (loc_offset >= window_offset) {
      std::copy_n(&buf[loc_offset - window_offset], kZip64LocatorSize, loc);
    } else {
      NEBULITE_RETURN_IF_ERROR(
          ReadExact(read_at, loc_offset, kZip64LocatorSize, loc, "zip64 locator"));
    }
    if (Get32(loc) == kZip64LocatorSig) {
      zip64 = true;
      const uint32_t z_disk = Get32(loc + 4);
      const uint64_t z_offset = Get64(loc + 8);
      const uint32_t disks = Get32(loc + 16);
      if (z_disk != 0 || disks > 1) {
        return Status::Corruption("multi-disk zip archives are not supported (zip64 locator)");
      }
      if (!InRange(z_offset, kZip64EndOfCentralDirSize, loc_offset)) {
        return Status::Corruption("zip64 end record offset " + std::to_string(z_offset) +
                                  " out of range");
      }
      unsigned char z[kZip64EndOfCentralDirSize];
      NEBULITE_RETURN_IF_ERROR(
          ReadExact(read_at, z_offset, kZip64EndOfCentralDirSize, z, "zip64 end record"));
      if (Get32(z) != kZip64EndOfCentralDirSig) {
        return Status::Corruption("bad zip64 end of central directory signature at offset " +
                                  std::to_string(z_offset));
      }
      if (Get64(z + 4) < kZip64EndOfCentralDirSize - 12) {
        return Status::Corruption("zip64 end record too short");
      }
      if (Get32(z + 16) != 0 || Get32(z + 20) != 0 || Get64(z + 24) != Get64(z + 32)) {
        return Status::Corruption("multi-disk zip archives are not supported (zip64 end record)");
      }
      d.entries = Get64(z + 32);
      d.cd_size = Get64(z + 40);
      d.cd_offset = Get64(z + 48);
      d.cd_limit = z_offset;
    }
  }
  if (!zip64 && (disk != 0 || cd_disk != 0 || disk_entries != d.entries)) {
    return Status::Corruption("multi-disk zip archives are not supported");
  }
  if (d.entries == 0) return Status::Corruption("archive has no records");
  if (d.entries > kMaxRecords) {
    return Status::Corruption("archive claims " + std::to_string(d.entries) +
                              " records, more than the limit " + std::to_string(kMaxRecords));
  }
  if (d.cd_size > kMaxCentralDirectoryBytes) {
    return Status::Corruption("central directory of " + std::to_string(d.cd_size) +
                              " bytes exceeds the limit " +
                              std::to_string(kMaxCentralDirectoryBytes));
  }
  if (!InRange(d.cd_offset, d.cd_size, d.cd_limit)) {
    return Status::Corruption("central directory [" + std::to_string(d.cd_offset) + ", +" +
                              std::to_string(d.cd_size) + ") is outside the file");
  }
  if (d.cd_size / kCentralHeaderSize < d.entries) {
    return Status::Corruption("central directory of " + std::to_string(d.cd_size) +
                              " bytes cannot hold " + std::to_string(d.entries) + " entries");
  }
  return d;
}

struct CentralEntry {
  std::string full_name;
  uint64_t header_offset = 0;
  uint64_t size = 0;
  uint32_t crc32 = 0;
};

// Parses the central entry at cd[*pos], advancing *pos past it.
Result<CentralEntry> ParseCentralEntry(const std::vector<unsigned char>& cd, size_t* pos,
                                       uint64_t index) {
  const std::string where = "central directory entry " + std::to_string(index);
  size_t p = *pos;
  if (cd.size() - p < kCentralHeaderSize) return Status::Corruption(where + " is truncated");
  const unsigned char* h = &cd[p];
  if (Get32(h) != kCentralHeaderSig) return Status::Corruption(where + ": bad signature");
  const uint16_t flags = Get16(h + 8);
  const uint16_t method = Get16(h + 10);
  CentralEntry e;
  e.crc32 = Get32(h + 16);
  uint64_t compressed = Get32(h + 20);
  uint64_t uncompressed = Get32(h + 24);
  const uint16_t name_len = Get16(h + 28), extra_len = Get16(h + 30), comment_len = Get16(h + 32);
  uint32_t disk_start = Get16(h + 34);
  e.header_offset = Get32(h + 42);
  const uint64_t var_len = uint64_t{name_len} + extra_len + comment_len;
  if (cd.size() - p - kCentralHeaderSize < var_len) {
    return Status::Corruption(where + ": name, extra or comment runs past the directory");
  }
  const char* name = reinterpret_cast<const char*>(h + kCentralHeaderSize);
  e.full_name.assign(name, name_len);
  const unsigned char* extra = h + kCentralHeaderSize + name_len;
  *pos = p + kCentralHeaderSize + var_len;

  if (flags & (kFlagEncrypted | kFlagStrongEncryption)) {
    return Status::Corruption(where + " (" + e.full_name + ") is encrypted");
  }
  if (method != 0) {
    return Status::Corruption(where + " (" + e.full_name + ") uses compression method " +
                              std::to_string(method) + "; only 0 (stored) is allowed");
  }
  // Zip64 extra: the fields that are saturated in the fixed header, in APPNOTE order.
  const bool need_u = uncompressed == kMax32, need_c = compressed == kMax32;
  const bool need_o = e.header_offset == kMax32, need_d = disk_start == kMax16;
  if (need_u || need_c || need_o || need_d) {
    bool found = false;
    for (size_t x = 0; x + kExtraHeaderSize <= extra_len;) {
      const uint16_t id = Get16(extra + x), len = Get16(extra + x + 2);
      if (x + kExtraHeaderSize + len > extra_len) {
        return Status::Corruption(where + ": extra field runs past its length");
      }
      if (id == kZip64ExtraId) {
        const unsigned char* f = extra + x + kExtraHeaderSize;
        const size_t need = 8 * (need_u + need_c + need_o) + 4 * need_d;
        if (len < need) return Status::Corruption(where + ": zip64 extra field too short");
        if (need_u) uncompressed = Get64(f), f += 8;
        if (need_c) compressed = Get64(f), f += 8;
        if (need_o) e.header_offset = Get64(f), f += 8;
        if (need_d) disk_start = Get32(f);
        found = true;
        break;
      }
      x += kExtraHeaderSize + len;
    }
    if (!found) return Status::Corruption(where + ": zip64 extra field missing");
  }
  if (disk_start != 0) return Status::Corruption(where + ": multi-disk archive");
  if (compressed != uncompressed) {
    return Status::Corruption(where + " (" + e.full_name + "): compressed size " +
                              std::to_string(compressed) + " != uncompressed size " +
                              std::to_string(uncompressed));
  }
  e.size = uncompressed;
  return e;
}

}  // namespace

Result<ArchiveIndex> ArchiveIndex::Parse(uint64_t file_size, const ReadAtFn& read_at) {
  NEBULITE_ASSIGN_OR_RETURN(const Directory d, ReadEndRecords(file_size, read_at));
  std::vector<unsigned char> cd(d.cd_size);
  NEBULITE_RETURN_IF_ERROR(
      ReadExact(read_at, d.cd_offset, cd.size(), cd.data(), "central directory"));

  struct Span {
    uint64_t begin, end;  // [local header, end of payload)
    size_t index;
  };
  ArchiveIndex index;
  std::vector<RecordEntry> records;
  std::vector<Span> spans;
  records.reserve(d.entries);
  spans.reserve(d.entries);
  std::unordered_set<std::string_view> seen;
  size_t pos = 0;
  std::string local;  // reused buffer for local header + name
  for (uint64_t i = 0; i < d.entries; ++i) {
    NEBULITE_ASSIGN_OR_RETURN(CentralEntry e, ParseCentralEntry(cd, &pos, i));
    const std::string& full = e.full_name;
    const size_t slash = full.find('/');
    if (slash == std::string::npos || slash == 0 || slash + 1 == full.size()) {
      return Status::Corruption("record name '" + full + "' is not '<prefix>/<name>'");
    }
    if (full.find('\0') != std::string::npos) {
      return Status::Corruption("record name contains a NUL byte");
    }
    if (!IsValidUtf8(full)) return Status::Corruption("record name is not valid UTF-8");
    if (full.size() - slash - 1 > kMaxRecordNameLength) {
      return Status::Corruption("record name longer than " + std::to_string(kMaxRecordNameLength) +
                                " bytes");
    }
    const std::string_view prefix(full.data(), slash);
    if (i == 0) {
      index.prefix_ = std::string(prefix);
    } else if (prefix != index.prefix_) {
      return Status::Corruption("record '" + full + "' does not share the prefix '" +
                                index.prefix_ + "/'");
    }

    // The local header: same name, payload inside the file before the directory.
    if (!InRange(e.header_offset, kLocalHeaderSize, d.cd_offset)) {
      return Status::Corruption("record '" + full + "': local header offset " +
                                std::to_string(e.header_offset) +
                                " is not before the central directory");
    }
    unsigned char lh[kLocalHeaderSize];
    NEBULITE_RETURN_IF_ERROR(
        ReadExact(read_at, e.header_offset, kLocalHeaderSize, lh, "local header"));
    if (Get32(lh) != kLocalHeaderSig) {
      return Status::Corruption("record '" + full + "': bad local header signature " +
                                Hex(Get32(lh)) + " at offset " + std::to_string(e.header_offset));
    }
    if (Get16(lh + 6) & (kFlagEncrypted | kFlagStrongEncryption) || Get16(lh + 8) != 0) {
      return Status::Corruption("record '" + full +
                                "': local header is encrypted or not stored (method 0)");
    }
    const uint16_t lname = Get16(lh + 26), lextra = Get16(lh + 28);
    RecordEntry r;
    if (lname != full.size() ||
        !CheckedAdd(e.header_offset, kLocalHeaderSize + lname + lextra, &r.data_offset)) {
      return Status::Corruption("record '" + full + "': local header name differs");
    }
    local.resize(lname);
    if (!InRange(e.header_offset + kLocalHeaderSize, lname, d.cd_offset)) {
      return Status::Corruption("record '" + full + "': local header runs into the directory");
    }
    NEBULITE_RETURN_IF_ERROR(ReadExact(read_at, e.header_offset + kLocalHeaderSize, lname,
                                       local.data(), "local header name"));
    if (local != full) {
      return Status::Corruption("record '" + full + "': local header names '" + local + "'");
    }
    uint64_t end;
    if (!CheckedAdd(r.data_offset, e.size, &end) || end > d.cd_offset) {
      return Status::Corruption("record '" + full + "': payload [" + std::to_string(r.data_offset) +
                                ", +" + std::to_string(e.size) +
                                ") extends past the start of the central directory");
    }
    r.name = full.substr(slash + 1);
    r.size = e.size;
    r.crc32 = e.crc32;
    spans.push_back({e.header_offset, end, records.size()});
    records.push_back(std::move(r));
  }
  if (pos != cd.size()) {
    return Status::Corruption("central directory has " + std::to_string(cd.size() - pos) +
                              " trailing bytes after " + std::to_string(d.entries) + " entries");
  }
  for (const RecordEntry& r : records) {
    if (!seen.insert(r.name).second) {
      return Status::Corruption("duplicate record name '" + r.name + "'");
    }
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].begin < spans[i - 1].end) {
      return Status::Corruption("records '" + records[spans[i - 1].index].name + "' and '" +
                                records[spans[i].index].name + "' overlap");
    }
  }
  // Records in file order.
  index.records_.reserve(records.size());
  for (const Span& s : spans) index.records_.push_back(std::move(records[s.index]));
  return index;
}

const RecordEntry* ArchiveIndex::Find(std::string_view name) const {
  for (const RecordEntry& r : records_) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

}  // namespace nebulite::format

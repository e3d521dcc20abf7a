// The nebulite data file: a `torch.save`-compatible zip archive of stored
// (uncompressed) records whose payloads start on 4 KiB boundaries.
// docs/format.md is the normative specification; this header holds the constants
// and the two halves of the format:
//   ArchiveLayout  plans where every byte of a file goes, and writes the headers.
//   ArchiveIndex   parses and validates an archive's directory from untrusted bytes.
// Thread-safety: values; const methods may be called concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "nebulite/status.h"

namespace nebulite::format {

inline constexpr uint64_t kAlignment = 4096;                   // payload alignment (bytes)
inline constexpr uint32_t kFormatVersion = 1;                  // nebulite format version
inline constexpr std::string_view kArchivePrefix = "archive";  // record names are "archive/<name>"
inline constexpr std::string_view kIndexRecord = ".nebulite/index.json";  // nebulite's own record
inline constexpr uint64_t kMaxRecords = 1u << 20;                         // bound on the directory
inline constexpr uint64_t kMaxRecordNameLength = 4096;
inline constexpr uint64_t kMaxCentralDirectoryBytes = 256ull << 20;

struct RecordSpec {
  std::string name;  // without the archive prefix, e.g. "data.pkl", "data/0"
  uint64_t size = 0;
};

struct RecordPlacement {
  std::string name;            // without the prefix
  uint64_t header_offset = 0;  // local file header
  uint64_t data_offset = 0;    // payload; a multiple of kAlignment
  uint64_t size = 0;           // payload bytes
};

// Where every byte of an archive goes. Records are laid out in the given order:
// local header immediately after the previous payload, its extra field padding the
// payload to kAlignment; then the central directory and end records ("the tail").
// The file has no holes: every byte belongs to a header, a payload or the tail.
class ArchiveLayout {
 public:
  static Result<ArchiveLayout> Plan(const std::vector<RecordSpec>& records);

  uint64_t file_size() const { return file_size_; }
  uint64_t tail_offset() const { return tail_offset_; }
  const std::vector<RecordPlacement>& records() const { return records_; }

  // Bytes of record i's local header, [header_offset, data_offset), with `crc`.
  std::string LocalHeader(size_t i, uint32_t crc) const;
  // Bytes of the tail, [tail_offset, file_size), given every record's crc.
  Result<std::string> Tail(const std::vector<uint32_t>& crcs) const;

 private:
  std::vector<RecordPlacement> records_;
  uint64_t tail_offset_ = 0;
  uint64_t file_size_ = 0;
};

struct RecordEntry {
  std::string name;  // without the prefix
  uint64_t data_offset = 0;
  uint64_t size = 0;
  uint32_t crc32 = 0;
};

// Reads `n` bytes at `offset` into `dst`; returns how many were read.
using ReadAtFn = std::function<Result<size_t>(uint64_t offset, size_t n, void* dst)>;

// The validated directory of an archive. Parse() trusts nothing: every size and
// offset is checked against the file size before use, records may not overlap
// each other or the directory, names are unique and share one prefix, every
// record is stored (method 0) and unencrypted, and local headers agree with the
// central directory. Failures are Corruption naming what is wrong.
class ArchiveIndex {
 public:
  static Result<ArchiveIndex> Parse(uint64_t file_size, const ReadAtFn& read_at);

  const std::vector<RecordEntry>& records() const { return records_; }
  const std::string& prefix() const { return prefix_; }
  // nullptr if absent.
  const RecordEntry* Find(std::string_view name) const;

 private:
  std::string prefix_;
  std::vector<RecordEntry> records_;
};

}  // namespace nebulite::format

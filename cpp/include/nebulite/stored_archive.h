// StoredArchive: reading a data file from a store. Open() parses and validates its
// directory (format::ArchiveIndex) and keeps the file open, so that retention deleting
// the version meanwhile does not pull the file from under the reader; ReadInto() reads
// a record's payload with parallel reads and checks its CRC-32.
// Thread-safety: const methods may be called concurrently.
#pragma once

#include <memory>
#include <string>

#include "nebulite/format.h"
#include "nebulite/status.h"
#include "nebulite/storage.h"

namespace nebulite {

class StoredArchive {
 public:
  static Result<std::unique_ptr<StoredArchive>> Open(Storage* storage, const std::string& path);
  const format::ArchiveIndex& index() const { return index_; }
  const std::string& path() const { return path_; }
  // Reads a record's payload into dst (size bytes), with `threads` parallel reads,
  // and checks its CRC-32: Corruption naming the file otherwise.
  Status ReadInto(const format::RecordEntry& entry, void* dst, int threads) const;

 private:
  StoredArchive(std::unique_ptr<ReadableFile> file, std::string path, format::ArchiveIndex index)
      : file_(std::move(file)), path_(std::move(path)), index_(std::move(index)) {}
  std::unique_ptr<ReadableFile> file_;
  std::string path_;
  format::ArchiveIndex index_;
};

}  // namespace nebulite

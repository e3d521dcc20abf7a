// DataFileWriter: the one writer of data files (docs/format.md, sections 1-5).
//
// Protocol, whatever the source of the bytes:
//   1. the file is created (or truncated) under TempDataFilePath(): a name readers and
//      the catalog never look at;
//   2. its bytes are written in 16 MiB chunks, in parallel on the io pool, 4 KiB aligned
//      (O_DIRECT where the driver can), and checksummed as they are written: every
//      record's CRC-32 and the whole file's;
//   3. the file is Sync()ed and closed;
//   4. it is renamed to DataFilePath(). A data file at its final name is therefore always
//      complete and durable (its directory entry becomes durable with the manifest's
//      SyncDir of the rank directory). On failure the temporary file is removed; the
//      final name is never touched.
// Sources:
//  - WriteImage(): the file laid out in memory exactly as it will be on disk (headers and
//    tail carrying the CRCs computed while it was staged). It is written in one pass, and
//    the CRCs computed while writing must equal the staged ones: otherwise the memory
//    changed after the object was saved (a stray write into the arena, a source tensor
//    changed during an asynchronous copy) and the write fails with Corruption.
//  - WriteStreamed(): source records copied through a bounded window (an object larger
//    than the memory budget); the local headers are rewritten with their CRCs and the
//    central directory appended at the end.
// Thread-safety: a DataFileWriter may be used by several threads at once; `io` is a pool
// used as CopyEngine documents.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nebulite/commit.h"
#include "nebulite/copy_engine.h"
#include "nebulite/engine.h"
#include "nebulite/format.h"
#include "nebulite/storage.h"

namespace nebulite {

struct DataFileId {
  std::string tag, version;
  uint32_t rank = 0;
  std::string name;
};

class DataFileWriter {
 public:
  // `io`: the pool that writes chunks in parallel (nullptr: the calling thread).
  DataFileWriter(Storage* storage, CopyEngine* io) : storage_(storage), io_(io) {}

  Result<ManifestFile> WriteImage(const DataFileId& id, const format::ArchiveLayout& layout,
                                  const uint8_t* image, const std::vector<uint32_t>& crcs);
  // `window` must be 4 KiB aligned and `window_size` a positive multiple of 4 KiB.
  Result<ManifestFile> WriteStreamed(const DataFileId& id, const format::ArchiveLayout& layout,
                                     const std::vector<SourceRecord>& records, uint8_t* window,
                                     uint64_t window_size, CopyEngine& copy);

 private:
  Storage* storage_;
  CopyEngine* io_;
};

// Fills the headers and the tail of an image laid out by `layout` with the records'
// CRCs; the payloads must be in place already. Returns the whole file's CRC-32.
Result<uint32_t> FinishImage(const format::ArchiveLayout& layout, uint8_t* image,
                             const std::vector<uint32_t>& crcs);

// CRC-32 of a whole data file from its records' CRCs and its tail.
uint32_t DataFileCrc(const format::ArchiveLayout& layout, const std::vector<uint32_t>& crcs,
                     const std::string& tail);

}  // namespace nebulite

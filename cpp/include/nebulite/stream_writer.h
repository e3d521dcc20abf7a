// Writing a data file that does not fit in memory: the file image is materialised window
// by window (headers and payload slices), checksummed, and written; then the local headers
// are rewritten with their CRCs and the central directory appended.
// Thread-safety: a pure function of its arguments; `copy` is used as documented there.
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

// `window` must be 4 KiB aligned and `window_size` a positive multiple of 4 KiB.
// Returns the file's manifest entry (size and whole-file CRC-32), the file being durable.
Result<ManifestFile> StreamToFile(Storage* storage, const std::string& path,
                                  const std::string& name, const format::ArchiveLayout& layout,
                                  const std::vector<SourceRecord>& records, uint8_t* window,
                                  uint64_t window_size, CopyEngine& copy);

// CRC-32 of a whole data file from its records' CRCs and its tail.
uint32_t DataFileCrc(const format::ArchiveLayout& layout, const std::vector<uint32_t>& crcs,
                     const std::string& tail);

}  // namespace nebulite

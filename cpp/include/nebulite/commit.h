// The commit protocol, the catalog of committed checkpoints, and retention.
//
// Layout under a store's root (docs/format.md is normative):
//   <tag>/<version>/rank<R>/<name>      data file of (tag, name, rank)
//   <tag>/<version>/rank<R>.manifest    rank R's manifest: its files, sizes, CRCs
//   <tag>/<version>/COMMITTED           the commit marker, written last
// A version (one save of a tag) is committed iff its COMMITTED marker exists and is
// intact; readers never look at anything else. "Latest" is the highest commit
// sequence number, not the tag's name.
//
// Lifecycle of a version, on each rank:  data files written + Sync()ed ->
// WriteManifest() (temp, fsync, rename, fsync dir) -> on the coordinator, once
// AllManifestsPresent(): WriteCommitMarker() (same protocol, last).
// Retention: ApplyRetention() deletes the oldest committed versions beyond `keep`,
// commit marker first (and its directory synced), then the files.
// Thread-safety: free functions; safe to call concurrently on distinct versions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nebulite/status.h"
#include "nebulite/storage.h"

namespace nebulite {

inline constexpr uint32_t kManifestVersion = 1;
inline constexpr uint64_t kMaxManifestBytes = 64ull << 20;

struct ManifestFile {
  std::string name;    // the object name (a path component)
  uint64_t size = 0;   // bytes
  uint32_t crc32 = 0;  // CRC-32 of the whole file
};

struct Manifest {
  std::string tag;
  std::string version;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::vector<ManifestFile> files;
};

struct CommitRecord {
  std::string tag;
  std::string version;
  uint64_t seq = 0;          // commit order; unique and increasing per store
  int64_t time_unix_ns = 0;  // wall time of the commit
  uint32_t world_size = 1;
  std::vector<uint32_t> manifest_crc32;  // per rank, CRC-32 of rank<R>.manifest
};

// Text encodings (see docs/format.md), each ending in a CRC line; Decode rejects
// anything malformed, truncated or bit-flipped with Corruption.
std::string EncodeManifest(const Manifest& m);
Result<Manifest> DecodeManifest(const std::string& text);
std::string EncodeCommitRecord(const CommitRecord& c);
Result<CommitRecord> DecodeCommitRecord(const std::string& text);

// Paths.
std::string VersionDir(const std::string& tag, const std::string& version);
std::string DataFilePath(const std::string& tag, const std::string& version, uint32_t rank,
                         const std::string& name);
std::string ManifestPath(const std::string& tag, const std::string& version, uint32_t rank);
std::string CommitMarkerPath(const std::string& tag, const std::string& version);

Status WriteManifest(Storage* storage, const Manifest& m);
Result<Manifest> ReadManifest(Storage* storage, const std::string& tag, const std::string& version,
                              uint32_t rank);
Result<bool> AllManifestsPresent(Storage* storage, const std::string& tag,
                                 const std::string& version, uint32_t world_size);
// Reads every rank's manifest, checks them, and writes the marker atomically.
Status WriteCommitMarker(Storage* storage, const CommitRecord& c);

struct CatalogEntry {
  CommitRecord commit;
};

// Every intact committed version in the store, ordered by commit seq, oldest first.
// Versions whose marker is missing are invisible; a corrupt marker is skipped and
// reported in `warnings`.
struct Catalog {
  std::vector<CatalogEntry> entries;
  std::vector<std::string> warnings;
};
Result<Catalog> ReadCatalog(Storage* storage);

// Deletes committed versions beyond the newest `keep` (keep >= 1). Uncommitted
// version directories are never touched (one may be in progress).
// Returns the (tag, version) pairs deleted.
Result<std::vector<std::pair<std::string, std::string>>> ApplyRetention(Storage* storage,
                                                                        uint32_t keep);

// Verifies a data file against its manifest entry (size and whole-file CRC).
Status VerifyDataFile(Storage* storage, const std::string& path, const ManifestFile& f);

// A part of a data file for ReadDataFile: the `size` bytes at file offset `offset` go to
// `dst` (nullptr: they are read and checksummed, not kept).
struct FileSpan {
  uint64_t offset = 0;
  uint64_t size = 0;
  void* dst = nullptr;
};

// Reads a whole data file and verifies it as VerifyDataFile does (size, whole-file CRC),
// in one pass: `spans` tile the file in order (each starts where the previous ended, the
// last ends at f.size; else InvalidArgument), so that a loader can read each record
// straight into its own buffer. Pieces are read and checksummed by `threads` threads
// (<= 1: the calling thread). With `span_crcs`, it receives the CRC-32 of each span (so
// that a loader checks its records' own checksums without another pass). On error the
// content of the buffers is unspecified.
Status ReadDataFile(Storage* storage, const std::string& path, const ManifestFile& f,
                    const std::vector<FileSpan>& spans, int threads,
                    std::vector<uint32_t>* span_crcs = nullptr);

}  // namespace nebulite

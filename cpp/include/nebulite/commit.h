// The commit protocol, the catalog of committed checkpoints, and retention.
//
// Layout under a store's root (docs/format.md is normative):
//   <tag>/<version>/rank<R>/<name>      data file of (tag, name, rank)
//   <tag>/<version>/rank<R>.manifest    rank R's manifest: its files, sizes, CRCs
//   <tag>/<version>/COMMITTED           the commit marker, written last
//   .nebulite/seq/<seq>                 the newest commit sequence number claimed
// A version (one save of a tag) is committed iff its COMMITTED marker exists and is
// intact; readers never look at anything else. "Latest" is the highest commit
// sequence number, not the tag's name.
//
// Lifecycle of a version, on each rank:  data files written under a temporary name,
// Sync()ed and renamed into place -> WriteManifest() (temp, fsync, rename, fsync dir) ->
// on the coordinator, once AllManifestsPresent(): ClaimCommitSeq() and
// WriteCommitMarker(), which checks that every file every manifest names exists with
// its size before writing the marker (same protocol, last).
// Retention: ApplyRetention() keeps the newest `keep` versions that pass
// VersionChecker::Check() and deletes the committed versions older than those, commit
// marker first (and its directory synced), then the files.
// Thread-safety: free functions; safe to call concurrently on distinct versions.
// VersionChecker is thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
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

// Names. A tag or version is a path component (ValidatePathComponent) that does not
// start with '.': names starting with '.' are the store's own (temporary files,
// .nebulite/), which readers skip.
Status ValidateTag(const std::string& tag);
Status ValidateVersionName(const std::string& version);

// Paths.
std::string VersionDir(const std::string& tag, const std::string& version);
std::string RankDir(const std::string& tag, const std::string& version, uint32_t rank);
std::string DataFilePath(const std::string& tag, const std::string& version, uint32_t rank,
                         const std::string& name);
// Where a data file is written before it is complete and renamed to DataFilePath().
std::string TempDataFilePath(const std::string& tag, const std::string& version, uint32_t rank,
                             const std::string& name);
std::string ManifestPath(const std::string& tag, const std::string& version, uint32_t rank);
std::string CommitMarkerPath(const std::string& tag, const std::string& version);
// The history beside the tags (docs/format.md): a file, never a tag.
inline constexpr const char* kHistoryFile = "checkpointHistories.csv";

Status WriteManifest(Storage* storage, const Manifest& m);
Result<Manifest> ReadManifest(Storage* storage, const std::string& tag, const std::string& version,
                              uint32_t rank);
Result<bool> AllManifestsPresent(Storage* storage, const std::string& tag,
                                 const std::string& version, uint32_t world_size);
// Reads every rank's manifest, checks them and that every file they name exists with
// its size (Corruption naming the file otherwise), and writes the marker atomically.
// `written`: the manifests the caller wrote itself (rank -> their text), checked as they
// are instead of read back; the files they name are not looked up again (each was
// complete before its manifest was written, step 1 of the protocol).
Status WriteCommitMarker(Storage* storage, const CommitRecord& c,
                         const std::map<uint32_t, std::string>& written = {});

// Claims the next commit sequence number of the store, at least `at_least`: one more
// than any number claimed before (or, in a store without claims, than any committed
// version's), unique even when several writers claim at once (CreateFileExclusive).
// The claim is the commit order: it is taken right before the marker is written.
Result<uint64_t> ClaimCommitSeq(Storage* storage, uint64_t at_least);

struct CatalogEntry {
  CommitRecord commit;
  int64_t marker_mtime_ns = 0;  // when the marker was written, by the store's clock
};

// Every intact committed version in the store, ordered by commit seq, oldest first.
// Versions whose marker is missing are invisible. A corrupt marker, and any entry the
// catalog cannot read (an unreadable tag directory, a marker that is a directory or a
// FIFO), is skipped and reported in `warnings`; only an unreadable root is an error.
struct Catalog {
  std::vector<CatalogEntry> entries;
  std::vector<std::string> warnings;
};
Result<Catalog> ReadCatalog(Storage* storage);

// Checks committed versions: every rank's manifest decodes and matches the marker, and
// every file it names exists with its size. A file modified after the marker was written
// (nebulite never modifies a committed file), or in the same tick of the filesystem's
// clock (on an object store, whose clock ticks in seconds: only after it), is read whole
// and its CRC checked; the result is remembered by (path, size, mtime), so each such file
// is read once.
// Check() returns OK (intact), Corruption (damaged: missing, truncated, bit-flipped) or
// another error (the store could not be read: the version's state is unknown).
class VersionChecker {
 public:
  explicit VersionChecker(Storage* storage) : storage_(storage) {}
  Status Check(const CatalogEntry& entry);

 private:
  Storage* storage_;
  std::mutex mu_;
  std::map<std::tuple<std::string, uint64_t, int64_t>, bool> files_;  // GUARDED_BY(mu_)
};

// Keeps the newest `keep` (>= 1) committed versions that pass `checker` and deletes the
// committed versions older than the oldest of them; damaged or unreadable versions are
// never counted, and ones newer than that are kept. The version (protect_tag,
// protect_version), the one the caller has just committed, is never deleted and counts
// as intact unchecked (its commit checked it). Uncommitted version directories are never touched
// (one may be in progress). Returns the (tag, version) pairs deleted.
struct RetentionResult {
  std::vector<std::pair<std::string, std::string>> deleted;
  std::vector<std::string> warnings;  // versions found damaged or unreadable
};
Result<RetentionResult> ApplyRetention(Storage* storage, uint32_t keep, VersionChecker* checker,
                                       const std::string& protect_tag = "",
                                       const std::string& protect_version = "");

// Checks that the data file `path` exists as a regular file of `f.size` bytes: Corruption
// naming it otherwise (another error when the store cannot tell). Returns what it found.
Result<FileInfo> CheckDataFilePresent(Storage* storage, const std::string& path,
                                      const ManifestFile& f);

// Deletes one committed version as retention does: its marker first, durably, then its
// files, then its tag's directory if that is empty.
Status RetireVersion(Storage* storage, const std::string& tag, const std::string& version);

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
// content of the buffers is unspecified. The file is opened once: deleting or replacing
// it meanwhile does not disturb the read.
Status ReadDataFile(Storage* storage, const std::string& path, const ManifestFile& f,
                    const std::vector<FileSpan>& spans, int threads,
                    std::vector<uint32_t>* span_crcs = nullptr);

}  // namespace nebulite

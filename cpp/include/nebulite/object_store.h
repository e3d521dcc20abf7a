// Object stores (Azure Blob and ADLS Gen2, S3, GCS) as a Storage.
//
// An ObjectClient is the few operations every object store has: whole-object puts (with a
// conditional "create only" form), ranged gets pinned to a version, head, listing by prefix,
// copy and delete. OpenObjectStorage() builds the Storage the rest of nebulite uses on top of
// one, with the differences Storage documents for object stores (is_object_store()):
//  - a file is an object; a directory is the common prefix of the objects below it;
//  - WriteFileAtomic and WriteWholeFile are one put (an object appears whole or not at
//    all); CreateFileExclusive is a conditional put (If-None-Match: *, ifGenerationMatch=0);
//  - a WritableFile holds what is written in memory and puts it at Sync() (small files
//    only: data files are written with WriteWholeFile, straight from the memory tier);
//  - a ReadableFile reads the version it opened (by its etag), and fails if it is gone;
//    ReadFile reads a small file (up to 64 KiB) with one GET, a larger one pinned to the
//    etag of a HEAD; StatFile answers from a HEAD alone (a directory reads as NotFound);
//  - Rename copies then deletes; AppendToFile reads, appends and puts (not atomic between
//    processes: two appending at once may lose a line, never tear one);
//  - TryLock fails with FailedPrecondition: no lock is shared between processes.
// Keys are the Storage paths ('/'-separated, relative to the store's root prefix).
// Thread-safety: every method of an ObjectClient may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "nebulite/status.h"
#include "nebulite/storage.h"

namespace nebulite {

struct ObjectInfo {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  std::string etag;  // identifies the version; "" if the store gives none
};

struct ObjectListing {
  std::vector<std::pair<std::string, ObjectInfo>> objects;  // full keys
  std::vector<std::string> prefixes;  // full keys of the "directories", no trailing '/'
};

class ObjectClient {
 public:
  virtual ~ObjectClient() = default;
  // E.g. "s3://bucket/prefix".
  virtual std::string Describe() const = 0;
  // Puts the concatenation of `data` as `key`, atomically. `if_absent`: AlreadyExists if
  // `key` exists, decided by the store.
  virtual Status Put(const std::string& key, const std::vector<ByteSpan>& data,
                     bool if_absent) = 0;
  // Reads up to n bytes at `offset` into dst; returns the count (short only at the end).
  // `etag` ("" for any): the version to read; IOError if it is no longer there.
  virtual Result<size_t> Get(const std::string& key, uint64_t offset, size_t n, void* dst,
                             const std::string& etag) = 0;
  virtual Result<ObjectInfo> Head(const std::string& key) = 0;  // NotFound if missing
  // The objects whose keys start with `prefix` ("" or ending in '/'): all of them when
  // `recursive`, else those directly below it and the prefixes one level down.
  virtual Result<ObjectListing> List(const std::string& prefix, bool recursive) = 0;
  virtual Status Copy(const std::string& from, const std::string& to) = 0;
  virtual Status Delete(const std::string& key) = 0;  // a missing key is OK
};

// A Storage over `client`. `read_only`: every change is PermissionDenied.
std::unique_ptr<Storage> OpenObjectStorage(std::shared_ptr<ObjectClient> client,
                                           bool read_only = false);

// An object store in memory that behaves as the real ones do (no directories, no old
// versions kept, conditional puts decided atomically), for tests. `name` is its
// Describe() ("memory-objects://<name>").
std::shared_ptr<ObjectClient> NewMemoryObjectClient(const std::string& name = "test");

}  // namespace nebulite

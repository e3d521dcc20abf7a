// Storage: the one door between the engine and a persistent store.
//
// Paths are relative to the store's root, '/'-separated, and never contain "..",
// empty components or a leading '/'. Drivers: posix (local disk, NFS, Lustre,
// blobfuse mounts), memory (tests), fault (wraps any driver; drops unsynced data and
// fails chosen operations, for crash tests). Object stores are hosted in Python.
//
// Durability contract (what the commit protocol relies on):
//  - data written through a WritableFile is durable after its Sync() returns;
//  - a file created, renamed or deleted is durable after SyncDir() of its parent;
//  - WriteFileAtomic() is durable and atomic when it returns: a reader sees the old
//    content or the new, never a mix (temp file, fsync, rename, fsync directory).
// Thread-safety: every method of a Storage may be called concurrently; one
// WritableFile may receive concurrent WriteAt() calls for non-overlapping ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nebulite/status.h"

namespace nebulite {

class WritableFile {
 public:
  virtual ~WritableFile() = default;
  // Writes n bytes at `offset`. When `data` and `offset` are 4 KiB aligned and n is a
  // multiple of 4 KiB, drivers may bypass the page cache (O_DIRECT).
  virtual Status WriteAt(uint64_t offset, const void* data, size_t n) = 0;
  // Makes everything written so far durable (fdatasync).
  virtual Status Sync() = 0;
  // Releases the file. Does not imply Sync().
  virtual Status Close() = 0;
};

class Storage {
 public:
  virtual ~Storage() = default;

  // A human-readable description, e.g. "posix:/mnt/ckpt".
  virtual std::string Describe() const = 0;

  // Creates (or truncates) `path`, creating missing parent directories. `size` is the
  // final size when known (0 if not); drivers may preallocate it.
  virtual Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                uint64_t size) = 0;
  // Writes a small file atomically and durably (see the contract above).
  virtual Status WriteFileAtomic(const std::string& path, const std::string& data) = 0;

  virtual Result<uint64_t> FileSize(const std::string& path) = 0;
  // Reads up to n bytes at offset; returns the count (short only at end of file).
  virtual Result<size_t> ReadAt(const std::string& path, uint64_t offset, size_t n, void* dst) = 0;
  // Reads a whole small file (at most `max_bytes`, else Corruption).
  virtual Result<std::string> ReadFile(const std::string& path, uint64_t max_bytes) = 0;

  virtual Result<bool> Exists(const std::string& path) = 0;
  // Names (not paths) of the entries directly in `dir` ("" is the root), sorted.
  // A missing directory lists as empty.
  virtual Result<std::vector<std::string>> List(const std::string& dir) = 0;
  virtual Status CreateDirs(const std::string& dir) = 0;
  virtual Status Rename(const std::string& from, const std::string& to) = 0;
  // Makes the entries of `dir` durable (fsync of the directory).
  virtual Status SyncDir(const std::string& dir) = 0;
  // Deletes a file; a missing file is OK.
  virtual Status Delete(const std::string& path) = 0;
  // Deletes a directory and everything below it; a missing directory is OK.
  virtual Status DeleteRecursively(const std::string& dir) = 0;
};

// Returns InvalidArgument unless `component` is a single safe path component:
// non-empty, at most 255 bytes, not "." or "..", no '/', '\\', NUL or control bytes.
Status ValidatePathComponent(const std::string& component, const char* what);

// Joins components with '/', skipping empty ones.
std::string JoinPath(const std::string& a, const std::string& b);
std::string ParentDir(const std::string& path);  // "" for a top-level entry

// Drivers.
// Opens a posix store rooted at `root` (created if missing; an unwritable root is
// PermissionDenied). `use_direct_io` enables O_DIRECT for aligned writes.
Result<std::unique_ptr<Storage>> OpenPosixStorage(const std::string& root,
                                                  bool use_direct_io = true);
std::unique_ptr<Storage> NewMemoryStorage();

}  // namespace nebulite

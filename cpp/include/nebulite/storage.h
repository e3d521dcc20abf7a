// Storage: the one door between nebulite and a persistent store. Everything that reads
// or changes a store (data files, manifests, commit markers, retention, the run locks,
// dead-run clean-up, the history CSV) goes through it, so a wrapping driver sees every
// operation.
//
// Paths are relative to the store's root, '/'-separated, and never contain "..",
// empty components or a leading '/'. Drivers: posix (local disk, NFS, Lustre,
// blobfuse mounts; read-write or read-only), object (Azure Blob, ADLS, S3, GCS through an
// ObjectClient, nebulite/object_store.h), memory (tests), fault (wraps any driver; drops
// unsynced data and fails chosen operations, for crash tests).
//
// Durability contract (what the commit protocol relies on):
//  - data written through a WritableFile is durable after its Sync() returns;
//  - a file created, renamed or deleted is durable after SyncDir() of its parent;
//  - WriteFileAtomic() is durable and atomic when it returns: a reader sees the old
//    content or the new, never a mix (temp file, fsync, rename, fsync directory);
//  - CreateFileExclusive() is WriteFileAtomic() that fails if the target exists, decided
//    atomically by the store (two writers racing for one name: exactly one wins).
// Readers: a ReadableFile reads the file it opened, whole, even when the name is deleted
// or replaced meanwhile (posix keeps the inode; memory keeps the bytes). Object stores
// pin the version they opened: a read after it was replaced or deleted fails (IOError),
// it never returns another version's bytes.
// Object stores (is_object_store()) differ in four ways, which the callers that care
// check: a directory is only the common prefix of the files below it (an empty one does
// not exist; CreateDirs and SyncDir do nothing), Rename is a copy and a delete (not
// atomic), TryLock fails (no lock is shared between processes), and a data file is
// written whole by WriteWholeFile, never through a WritableFile and a rename.
// Only regular files are data: anything else at a file's path (a directory, a FIFO, a
// device) is refused without being opened for I/O, so it can never block a reader.
// Thread-safety: every method of a Storage may be called concurrently; one
// WritableFile may receive concurrent WriteAt() calls for non-overlapping ranges; one
// ReadableFile may receive concurrent ReadAt() calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nebulite/status.h"

namespace nebulite {

// Bytes to write, borrowed for the duration of a call.
struct ByteSpan {
  const void* data = nullptr;
  size_t size = 0;
};

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

class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // The size of the file when it was opened.
  virtual uint64_t size() const = 0;
  // Reads up to n bytes at offset; returns the count (short only at end of file).
  virtual Result<size_t> ReadAt(uint64_t offset, size_t n, void* dst) = 0;
};

// A lock held in a store (see TryLock); released when destroyed.
class StoreLock {
 public:
  virtual ~StoreLock() = default;
};

enum class FileType { kFile, kDirectory, kOther };

struct FileInfo {
  FileType type = FileType::kFile;
  uint64_t size = 0;
  int64_t mtime_ns = 0;  // last modification, by the store's clock
};

class Storage {
 public:
  virtual ~Storage() = default;

  // A human-readable description, e.g. "posix:/mnt/ckpt".
  virtual std::string Describe() const = 0;
  // True if the store was opened for reading only: every change is PermissionDenied.
  virtual bool read_only() const { return false; }
  // True for object stores (see the contract above).
  virtual bool is_object_store() const { return false; }

  // -- writing ------------------------------------------------------------------------
  // Creates (or truncates) `path`, creating missing parent directories. `size` is the
  // final size when known (0 if not); drivers may preallocate it.
  virtual Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                                uint64_t size) = 0;
  // Writes the concatenation of `pieces` as the file `path`, atomically and durably: it
  // appears whole or not at all. Object stores upload it straight from the pieces (parts
  // in parallel); other drivers write it through a WritableFile under a temporary name
  // and rename it. The pieces must stay unchanged until it returns.
  virtual Status WriteWholeFile(const std::string& path, const std::vector<ByteSpan>& pieces);
  // Writes a small file atomically and durably (see the contract above).
  virtual Status WriteFileAtomic(const std::string& path, const std::string& data) = 0;
  // As WriteFileAtomic, for a file only its owner may read and write (posix: mode 0600).
  // Drivers without permissions write it as WriteFileAtomic does.
  virtual Status WritePrivateFileAtomic(const std::string& path, const std::string& data) {
    return WriteFileAtomic(path, data);
  }
  // As WriteFileAtomic, but AlreadyExists if `path` exists (atomically decided).
  virtual Status CreateFileExclusive(const std::string& path, const std::string& data) = 0;
  // Appends `data` to `path` (created if missing, with its parents) in one write, so that
  // lines appended concurrently by several processes stay whole. Not synced.
  virtual Status AppendToFile(const std::string& path, const std::string& data) = 0;

  // -- reading ------------------------------------------------------------------------
  // Opens a regular file for reading (NotFound if missing; InvalidArgument if it is a
  // directory or anything but a regular file).
  virtual Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) = 0;
  // Reads a whole small regular file (at most `max_bytes`, else Corruption).
  virtual Result<std::string> ReadFile(const std::string& path, uint64_t max_bytes) = 0;
  // What is at `path` (NotFound if nothing). Symbolic links are followed.
  virtual Result<FileInfo> Stat(const std::string& path) = 0;
  // As Stat, for a path where a file is expected (a marker, a manifest, a data file): an
  // object store answers NotFound from the object alone, without looking for a directory
  // of that name (one request, not two). Callers treat anything but a file as not one.
  virtual Result<FileInfo> StatFile(const std::string& path) { return Stat(path); }
  // Whether StatFile finds something at `path`.
  Result<bool> FileExists(const std::string& path);
  // The size of the regular file at `path`.
  Result<uint64_t> FileSize(const std::string& path);
  virtual Result<bool> Exists(const std::string& path) = 0;
  // Names (not paths) of the entries directly in `dir` ("" is the root), sorted.
  // A missing directory lists as empty.
  virtual Result<std::vector<std::string>> List(const std::string& dir) = 0;

  // -- directories, names -------------------------------------------------------------
  virtual Status CreateDirs(const std::string& dir) = 0;
  virtual Status Rename(const std::string& from, const std::string& to) = 0;
  // Makes the entries of `dir` durable (fsync of the directory).
  virtual Status SyncDir(const std::string& dir) = 0;
  // Deletes a file; a missing file is OK.
  virtual Status Delete(const std::string& path) = 0;
  // Deletes a directory and everything below it; a missing directory is OK.
  virtual Status DeleteRecursively(const std::string& dir) = 0;
  // Deletes `dir` if it is empty, atomically with respect to writers creating entries in
  // it: returns true if it was removed (or was missing), false if it holds something.
  virtual Result<bool> RemoveDirIfEmpty(const std::string& dir) = 0;

  // -- locks --------------------------------------------------------------------------
  // Takes a lock named `path` (the file is created if missing) without waiting: shared
  // locks coexist, an exclusive one excludes all others. Returns nullptr when another
  // holder conflicts. A lock held by a process is released when the process dies.
  // Where a store's locks are not shared by every node (node-local flock on Lustre,
  // FUSE mounts), a free lock proves nothing: callers never act on it alone.
  virtual Result<std::unique_ptr<StoreLock>> TryLock(const std::string& path, bool exclusive) = 0;
};

// Returns InvalidArgument unless `component` is a single safe path component:
// non-empty, at most 255 bytes, not "." or "..", no '/', '\\', NUL or control bytes.
Status ValidatePathComponent(const std::string& component, const char* what);

// Joins components with '/', skipping empty ones.
std::string JoinPath(const std::string& a, const std::string& b);
std::string ParentDir(const std::string& path);  // "" for a top-level entry
std::string BaseName(const std::string& path);   // the last component

// Drivers.
struct PosixOptions {
  bool direct_io = true;   // O_DIRECT for aligned writes
  bool read_only = false;  // never create, write or probe anything
  // Permissions of the files this store creates. 0: 0666 and directories 0777, less the
  // process umask (what torch.save gets). Otherwise exactly this mode, whatever the umask,
  // and directories this mode plus search (x) wherever it grants read; it must grant its
  // owner read and write (ValidateFileMode). Lock files are always 0600.
  uint32_t file_mode = 0;
};
// OK for 0 and for a mode of at most 0777 with owner read and write.
Status ValidateFileMode(uint32_t mode);
// Opens a posix store rooted at `root`. Read-write: the root is created if missing and
// must be writable (PermissionDenied otherwise). Read-only: the root must exist
// (NotFound otherwise) and nothing is ever created or written.
Result<std::unique_ptr<Storage>> OpenPosixStorage(const std::string& root,
                                                  const PosixOptions& options);
inline Result<std::unique_ptr<Storage>> OpenPosixStorage(const std::string& root,
                                                         bool use_direct_io = true) {
  return OpenPosixStorage(root, PosixOptions{use_direct_io, false});
}
std::unique_ptr<Storage> NewMemoryStorage();

}  // namespace nebulite

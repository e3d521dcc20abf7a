// FaultStorage wraps a Storage for crash and failure tests.
//
// Writes are held back until Sync(): a WritableFile's bytes reach the base store only
// when Sync() is called, and creations, renames and deletions count as durable only
// after SyncDir() of their parent. Crash() drops everything that is not durable,
// as a power loss would: unsynced writes vanish, undurable creations and renames are
// undone. FailAfter() makes a chosen kind of operation fail with a chosen status.
// Thread-safety: all methods may be called concurrently.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "nebulite/storage.h"

namespace nebulite {

enum class StorageOp {
  kCreate,       // NewWritableFile, CreateDirs
  kWrite,        // WritableFile::WriteAt
  kSync,         // WritableFile::Sync
  kWriteAtomic,  // WriteFileAtomic, CreateFileExclusive (then their own primitives)
  kRename,
  kSyncDir,
  kDelete,  // Delete, DeleteRecursively, RemoveDirIfEmpty
  kRead,    // every read: ReadFile, NewReadableFile and its ReadAt, Stat, Exists, List
  kAppend,  // AppendToFile
  kLock,    // TryLock
  kAny
};

class FaultStorage : public Storage {
 public:
  static std::unique_ptr<FaultStorage> Wrap(Storage* base);  // base must outlive it
  // The next `skip` operations of kind `op` succeed, every later one returns `status`.
  virtual void FailAfter(StorageOp op, int skip, Status status) = 0;
  virtual void ClearFailures() = 0;
  // Drops all non-durable state (see above). Open files become unusable.
  virtual void Crash() = 0;
  // Number of operations of kind `op` performed so far (failed ones included).
  virtual int Count(StorageOp op) const = 0;
  // Called at the start of every operation with its kind and path (a file's path for the
  // operations of an open file); a non-OK status fails the operation. It runs under the
  // wrapper's lock: it may block (a hung mount) or act on the base store, never on this
  // wrapper. An empty function removes it.
  using Hook = std::function<Status(StorageOp op, const std::string& path)>;
  virtual void SetHook(Hook hook) = 0;
};

}  // namespace nebulite

// FaultStorage: a Storage wrapper that loses what a power cut would lose, and fails
// chosen operations (after LevelDB's FaultInjectionTestEnv).
//
// Model (the worst case the durability contract in storage.h allows):
//  - WriteAt() bytes are buffered here and reach the base store only at Sync() (then
//    base Sync()). Reads through the wrapper see synced bytes only, and bytes not
//    synced before Close() are lost, so a missing Sync() shows up even without a crash.
//  - Every change to a directory's entries is logged as an undo record until SyncDir()
//    of that directory: a file or directory created (NewWritableFile, CreateDirs,
//    WriteFileAtomic's temporary file), a rename (both directories must be synced), a
//    Delete() (the old bytes are kept to restore them).
//  - Crash() drops buffered writes, marks open files dead and applies the undo records
//    newest first: creations are deleted, renames reversed (restoring an overwritten
//    target), deletions restored.
//  - Truncation of an existing file by NewWritableFile and DeleteRecursively() are
//    durable at once (a journaling filesystem may well persist them first); callers
//    must therefore make any marker that refers to deleted data disappear durably first.
//  - WriteFileAtomic() runs the posix protocol (temp file, Sync, Rename, SyncDir) through
//    this wrapper's own primitives, so failures and crashes can land between the steps.
//    CreateFileExclusive() creates the file atomically in the base store (undone by a
//    crash until its directory is synced), then syncs the directory through SyncDir().
//  - AppendToFile() (the history, best effort) reaches the base store at once.
//  - Reads through a ReadableFile are operations too: they can fail like any other.
// Failure injection: FailAfter(op, skip, status) lets `skip` more operations of kind op
// (kAny: every kind) succeed, then fails each later one without touching the base.
// Thread-safety: one mutex guards all state and serialises calls to the base store.
#include "nebulite/fault_storage.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "storage/path_internal.h"

namespace nebulite {
namespace {

constexpr int kNumOps = static_cast<int>(StorageOp::kAny) + 1;
constexpr uint64_t kMaxUndoBytes = 1ull << 30;  // what Delete/Rename will snapshot

// A file opened through the wrapper. Shared between the wrapper (which kills it at
// Crash()) and the FaultWritableFile handed to the caller. Guarded by the wrapper's mutex.
struct OpenFile {
  std::string path;
  std::unique_ptr<WritableFile> base;
  // (offset, bytes) not yet synced, in write order: later writes win where they overlap.
  std::vector<std::pair<uint64_t, std::string>> pending;
  bool dead = false;  // crashed or closed
};

struct UndoRecord {
  enum class Kind { kCreatedFile, kCreatedDir, kRenamed, kDeleted } kind;
  std::string path;                        // created / deleted path, or rename target
  std::string from;                        // rename source
  std::optional<std::string> old_content;  // deleted bytes, or overwritten rename target
  bool path_dir_synced = false;
  bool from_dir_synced = false;
};

class FaultStorageImpl;

class FaultWritableFile final : public WritableFile {
 public:
  FaultWritableFile(FaultStorageImpl* owner, std::shared_ptr<OpenFile> file)
      : owner_(owner), file_(std::move(file)) {}
  ~FaultWritableFile() override { (void)Close(); }
  Status WriteAt(uint64_t offset, const void* data, size_t n) override;
  Status Sync() override;
  Status Close() override;

 private:
  FaultStorageImpl* owner_;
  std::shared_ptr<OpenFile> file_;
};

class FaultReadableFile final : public ReadableFile {
 public:
  FaultReadableFile(FaultStorageImpl* owner, std::unique_ptr<ReadableFile> base, std::string path)
      : owner_(owner), base_(std::move(base)), path_(std::move(path)) {}
  uint64_t size() const override { return base_->size(); }
  Result<size_t> ReadAt(uint64_t offset, size_t n, void* dst) override;

 private:
  FaultStorageImpl* owner_;
  std::unique_ptr<ReadableFile> base_;
  std::string path_;
};

class FaultStorageImpl final : public FaultStorage {
 public:
  explicit FaultStorageImpl(Storage* base) : base_(base) {}

  std::string Describe() const override { return "fault:" + base_->Describe(); }
  bool is_object_store() const override { return base_->is_object_store(); }

  void FailAfter(StorageOp op, int skip, Status status) override {
    std::lock_guard<std::mutex> lock(mu_);
    fail_op_ = op;
    fail_skip_ = std::max(skip, 0);
    fail_status_ = status.ok() ? Status::IOError("injected failure") : std::move(status);
  }

  void ClearFailures() override {
    std::lock_guard<std::mutex> lock(mu_);
    fail_op_.reset();
  }

  void Crash() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& weak : open_files_) {
      if (auto f = weak.lock()) {
        f->dead = true;
        f->pending.clear();
        if (f->base) (void)f->base->Close();
      }
    }
    open_files_.clear();
    // Undo, newest first. Errors are ignored: an earlier undo (a directory removed) may
    // already have taken the entry away.
    for (auto it = undo_.rbegin(); it != undo_.rend(); ++it) {
      const UndoRecord& u = *it;
      switch (u.kind) {
        case UndoRecord::Kind::kCreatedFile:
          (void)base_->Delete(u.path);
          break;
        case UndoRecord::Kind::kCreatedDir:
          (void)base_->DeleteRecursively(u.path);
          break;
        case UndoRecord::Kind::kRenamed:
          (void)base_->CreateDirs(ParentDir(u.from));
          (void)base_->Rename(u.path, u.from);
          if (u.old_content) (void)base_->WriteFileAtomic(u.path, *u.old_content);
          break;
        case UndoRecord::Kind::kDeleted:
          if (u.old_content) (void)base_->WriteFileAtomic(u.path, *u.old_content);
          break;
      }
    }
    undo_.clear();
  }

  void SetHook(Hook hook) override {
    std::lock_guard<std::mutex> lock(mu_);
    hook_ = std::move(hook);
  }

  int Count(StorageOp op) const override {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_[static_cast<int>(op)];
  }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        uint64_t size) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kCreate, path));
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    NEBULITE_ASSIGN_OR_RETURN(std::vector<std::string> new_dirs,
                              MissingDirsLocked(ParentDir(path)));
    NEBULITE_ASSIGN_OR_RETURN(bool existed, base_->Exists(path));
    NEBULITE_ASSIGN_OR_RETURN(auto base_file, base_->NewWritableFile(path, size));
    for (const std::string& d : new_dirs) LogLocked(UndoRecord::Kind::kCreatedDir, d);
    if (!existed) LogLocked(UndoRecord::Kind::kCreatedFile, path);
    auto file = std::make_shared<OpenFile>();
    file->path = path;
    file->base = std::move(base_file);
    std::erase_if(open_files_, [](const auto& w) { return w.expired(); });
    open_files_.push_back(file);
    return std::unique_ptr<WritableFile>(new FaultWritableFile(this, std::move(file)));
  }

  Status WriteFileAtomic(const std::string& path, const std::string& data) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kWriteAtomic, path));
    }
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    const std::string dir = ParentDir(path);
    std::string name = path.substr(dir.empty() ? 0 : dir.size() + 1);
    if (name.size() > 200) name.resize(200);
    const std::string temp =
        JoinPath(dir, "." + name + ".tmp.fault." + std::to_string(++temp_counter_));
    // The posix protocol, one primitive at a time.
    NEBULITE_ASSIGN_OR_RETURN(auto file, NewWritableFile(temp, data.size()));
    Status st = file->WriteAt(0, data.data(), data.size());
    if (st.ok()) st = file->Sync();
    Status closed = file->Close();
    if (st.ok()) st = closed;
    if (st.ok()) st = Rename(temp, path);
    if (!st.ok()) {
      (void)Delete(temp);
      return st;
    }
    return SyncDir(dir);
  }

  Status CreateFileExclusive(const std::string& path, const std::string& data) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kWriteAtomic, path));
      NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
      NEBULITE_ASSIGN_OR_RETURN(std::vector<std::string> new_dirs,
                                MissingDirsLocked(ParentDir(path)));
      NEBULITE_RETURN_IF_ERROR(base_->CreateFileExclusive(path, data));
      for (const std::string& d : new_dirs) LogLocked(UndoRecord::Kind::kCreatedDir, d);
      LogLocked(UndoRecord::Kind::kCreatedFile, path);
    }
    return SyncDir(ParentDir(path));
  }

  Status AppendToFile(const std::string& path, const std::string& data) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kAppend, path));
    return base_->AppendToFile(path, data);
  }

  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kRead, path));
    NEBULITE_ASSIGN_OR_RETURN(auto file, base_->NewReadableFile(path));
    return std::unique_ptr<ReadableFile>(new FaultReadableFile(this, std::move(file), path));
  }

  Result<FileInfo> Stat(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kRead, path));
    return base_->Stat(path);
  }

  Result<std::string> ReadFile(const std::string& path, uint64_t max_bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kRead, path));
    return base_->ReadFile(path, max_bytes);
  }

  Result<bool> Exists(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kRead, path));
    return base_->Exists(path);
  }

  Result<std::vector<std::string>> List(const std::string& dir) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kRead, dir));
    return base_->List(dir);
  }

  Status CreateDirs(const std::string& dir) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kCreate, dir));
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", true));
    NEBULITE_ASSIGN_OR_RETURN(std::vector<std::string> new_dirs, MissingDirsLocked(dir));
    NEBULITE_RETURN_IF_ERROR(base_->CreateDirs(dir));
    for (const std::string& d : new_dirs) LogLocked(UndoRecord::Kind::kCreatedDir, d);
    return Status::OK();
  }

  Status Rename(const std::string& from, const std::string& to) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kRename, to));
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(from, "rename source", false));
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(to, "rename target", false));
    // Snapshot an overwritten target file so that Crash() can bring it back.
    std::optional<std::string> old_target;
    NEBULITE_ASSIGN_OR_RETURN(bool target_exists, base_->Exists(to));
    if (target_exists) {
      auto old = base_->ReadFile(to, kMaxUndoBytes);
      if (old.ok()) old_target = std::move(old).value();
    }
    NEBULITE_RETURN_IF_ERROR(base_->Rename(from, to));
    UndoRecord& u = LogLocked(UndoRecord::Kind::kRenamed, to);
    u.from = from;
    u.old_content = std::move(old_target);
    return Status::OK();
  }

  Status SyncDir(const std::string& dir) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kSyncDir, dir));
    NEBULITE_RETURN_IF_ERROR(base_->SyncDir(dir));
    for (UndoRecord& u : undo_) {
      if (ParentDir(u.path) == dir) u.path_dir_synced = true;
      if (u.kind == UndoRecord::Kind::kRenamed && ParentDir(u.from) == dir) {
        u.from_dir_synced = true;
      }
    }
    std::erase_if(undo_, [](const UndoRecord& u) {
      return u.path_dir_synced && (u.kind != UndoRecord::Kind::kRenamed || u.from_dir_synced);
    });
    return Status::OK();
  }

  Status Delete(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kDelete, path));
    std::optional<std::string> old;
    auto content = base_->ReadFile(path, kMaxUndoBytes);
    if (content.ok()) old = std::move(content).value();
    NEBULITE_RETURN_IF_ERROR(base_->Delete(path));
    if (old) LogLocked(UndoRecord::Kind::kDeleted, path).old_content = std::move(old);
    return Status::OK();
  }

  Status DeleteRecursively(const std::string& dir) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kDelete, dir));
    return base_->DeleteRecursively(dir);
  }

  Result<bool> RemoveDirIfEmpty(const std::string& dir) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kDelete, dir));
    return base_->RemoveDirIfEmpty(dir);
  }

  Result<std::unique_ptr<StoreLock>> TryLock(const std::string& path, bool exclusive) override {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kLock, path));
    return base_->TryLock(path, exclusive);
  }

  // Called by FaultReadableFile.
  Result<size_t> FileRead(ReadableFile& base, const std::string& path, uint64_t offset, size_t n,
                          void* dst) {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kRead, path));
    return base.ReadAt(offset, n, dst);
  }

  // Called by FaultWritableFile.
  Status FileWrite(OpenFile& f, uint64_t offset, const void* data, size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kWrite, f.path));
    if (f.dead) return Status::FailedPrecondition("'" + f.path + "' is closed or crashed");
    if (n > 0) f.pending.emplace_back(offset, std::string(static_cast<const char*>(data), n));
    return Status::OK();
  }

  Status FileSync(OpenFile& f) {
    std::lock_guard<std::mutex> lock(mu_);
    NEBULITE_RETURN_IF_ERROR(BeginOpLocked(StorageOp::kSync, f.path));
    if (f.dead) return Status::FailedPrecondition("'" + f.path + "' is closed or crashed");
    // Callers write disjoint ranges; later writes to the same offset replace earlier ones.
    for (const auto& [offset, bytes] : f.pending) {
      NEBULITE_RETURN_IF_ERROR(f.base->WriteAt(offset, bytes.data(), bytes.size()));
    }
    f.pending.clear();
    return f.base->Sync();
  }

  Status FileClose(OpenFile& f) {
    std::lock_guard<std::mutex> lock(mu_);
    if (f.dead) return Status::OK();
    f.dead = true;
    f.pending.clear();  // never synced: lost, as after a crash
    return f.base->Close();
  }

 private:
  // Counts the operation and decides whether it fails.
  Status BeginOpLocked(StorageOp op, const std::string& path) {
    ++counts_[static_cast<int>(op)];
    ++counts_[static_cast<int>(StorageOp::kAny)];
    if (hook_) NEBULITE_RETURN_IF_ERROR(hook_(op, path));
    if (fail_op_ && (*fail_op_ == StorageOp::kAny || *fail_op_ == op)) {
      if (fail_skip_ > 0) {
        --fail_skip_;
      } else {
        return fail_status_;
      }
    }
    return Status::OK();
  }

  // The directories of `dir` and its ancestors that the base store lacks, top down.
  Result<std::vector<std::string>> MissingDirsLocked(const std::string& dir) {
    std::vector<std::string> missing;
    for (std::string d = dir; !d.empty(); d = ParentDir(d)) {
      NEBULITE_ASSIGN_OR_RETURN(bool exists, base_->Exists(d));
      if (exists) break;
      missing.push_back(d);
    }
    std::reverse(missing.begin(), missing.end());
    return missing;
  }

  UndoRecord& LogLocked(UndoRecord::Kind kind, const std::string& path) {
    UndoRecord u;
    u.kind = kind;
    u.path = path;
    undo_.push_back(std::move(u));
    return undo_.back();
  }

  Storage* const base_;
  mutable std::mutex mu_;
  int counts_[kNumOps] = {};                         // GUARDED_BY(mu_)
  std::optional<StorageOp> fail_op_;                 // GUARDED_BY(mu_)
  int fail_skip_ = 0;                                // GUARDED_BY(mu_)
  Status fail_status_;                               // GUARDED_BY(mu_)
  std::vector<UndoRecord> undo_;                     // GUARDED_BY(mu_), oldest first
  std::vector<std::weak_ptr<OpenFile>> open_files_;  // GUARDED_BY(mu_)
  std::atomic<uint64_t> temp_counter_{0};
  Hook hook_;  // GUARDED_BY(mu_)
};

Status FaultWritableFile::WriteAt(uint64_t offset, const void* data, size_t n) {
  return owner_->FileWrite(*file_, offset, data, n);
}
Status FaultWritableFile::Sync() { return owner_->FileSync(*file_); }
Status FaultWritableFile::Close() { return owner_->FileClose(*file_); }
Result<size_t> FaultReadableFile::ReadAt(uint64_t offset, size_t n, void* dst) {
  return owner_->FileRead(*base_, path_, offset, n, dst);
}

}  // namespace

std::unique_ptr<FaultStorage> FaultStorage::Wrap(Storage* base) {
  return std::make_unique<FaultStorageImpl>(base);
}

}  // namespace nebulite

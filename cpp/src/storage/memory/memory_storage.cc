// The memory storage driver, for tests: files and directories in maps.
//
// Everything is durable as soon as it is written (there is no power to lose; wrap it in
// FaultStorage to model crashes). Directories are explicit entries, created with their
// files as a posix filesystem would. A file's bytes live in a shared buffer, like an
// inode: an open WritableFile keeps writing to it across a Rename(), and a ReadableFile
// keeps reading the bytes it opened after the name is deleted or replaced. Times come
// from a clock that never goes backwards, so that a file written after another always
// has the later mtime. Locks are kept in the driver (they are shared by every user of
// this instance, as a posix lock is by every process of a node).
// Thread-safety: one mutex guards all state; every method may be called concurrently.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "nebulite/storage.h"
#include "storage/path_internal.h"

namespace nebulite {
namespace {

struct MemoryFile {
  std::string data;
  int64_t mtime_ns = 0;
};

struct LockState {
  int shared = 0;
  bool exclusive = false;
};

struct MemoryState {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<MemoryFile>> files;  // GUARDED_BY(mu)
  std::map<std::string, int64_t> dirs;                       // GUARDED_BY(mu); "" implicit
  std::map<std::string, LockState> locks;                    // GUARDED_BY(mu)
  int64_t last_time_ns = 0;                                  // GUARDED_BY(mu)

  int64_t NowLocked() {
    int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
    last_time_ns = std::max(now, last_time_ns + 1);
    return last_time_ns;
  }
};

bool StartsWithDir(const std::string& path, const std::string& dir) {
  return path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 &&
         path[dir.size()] == '/';
}

class MemoryWritableFile final : public WritableFile {
 public:
  MemoryWritableFile(std::shared_ptr<MemoryState> state, std::shared_ptr<MemoryFile> file,
                     std::string path)
      : state_(std::move(state)), file_(std::move(file)), path_(std::move(path)) {}

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (closed_) return Status::FailedPrecondition("write to closed file '" + path_ + "'");
    if (n == 0) return Status::OK();
    if (file_->data.size() < offset + n) file_->data.resize(offset + n);
    std::memcpy(file_->data.data() + offset, data, n);
    file_->mtime_ns = state_->NowLocked();
    return Status::OK();
  }

  Status Sync() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (closed_) return Status::FailedPrecondition("sync of closed file '" + path_ + "'");
    return Status::OK();
  }

  Status Close() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    closed_ = true;
    return Status::OK();
  }

 private:
  std::shared_ptr<MemoryState> state_;
  std::shared_ptr<MemoryFile> file_;
  const std::string path_;
  bool closed_ = false;  // GUARDED_BY(state_->mu)
};

class MemoryReadableFile final : public ReadableFile {
 public:
  MemoryReadableFile(std::shared_ptr<MemoryState> state, std::shared_ptr<MemoryFile> file)
      : state_(std::move(state)), file_(std::move(file)) {
    std::lock_guard<std::mutex> lock(state_->mu);
    size_ = file_->data.size();
  }

  uint64_t size() const override { return size_; }

  Result<size_t> ReadAt(uint64_t offset, size_t n, void* dst) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    const std::string& data = file_->data;
    if (offset >= data.size()) return size_t{0};
    size_t count = std::min<uint64_t>(n, data.size() - offset);
    std::memcpy(dst, data.data() + offset, count);
    return count;
  }

 private:
  std::shared_ptr<MemoryState> state_;
  std::shared_ptr<MemoryFile> file_;
  uint64_t size_ = 0;
};

class MemoryLock final : public StoreLock {
 public:
  MemoryLock(std::shared_ptr<MemoryState> state, std::string path, bool exclusive)
      : state_(std::move(state)), path_(std::move(path)), exclusive_(exclusive) {}
  ~MemoryLock() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    LockState& l = state_->locks[path_];
    if (exclusive_) {
      l.exclusive = false;
    } else {
      --l.shared;
    }
  }

 private:
  std::shared_ptr<MemoryState> state_;
  const std::string path_;
  const bool exclusive_;
};

class MemoryStorage final : public Storage {
 public:
  MemoryStorage() : s_(std::make_shared<MemoryState>()) {}

  std::string Describe() const override { return "memory:"; }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        uint64_t size) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    NEBULITE_RETURN_IF_ERROR(PrepareFileLocked(path));
    auto& slot = s_->files[path];
    if (slot) {
      slot->data.clear();  // O_TRUNC: same inode, no bytes
    } else {
      slot = std::make_shared<MemoryFile>();
    }
    slot->mtime_ns = s_->NowLocked();
    return std::unique_ptr<WritableFile>(new MemoryWritableFile(s_, slot, path));
  }

  Status WriteFileAtomic(const std::string& path, const std::string& data) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    NEBULITE_RETURN_IF_ERROR(PrepareFileLocked(path));
    s_->files[path] = NewFileLocked(data);  // a new inode replaces the old
    return Status::OK();
  }

  Status CreateFileExclusive(const std::string& path, const std::string& data) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->files.count(path) || IsDirLocked(path)) {
      return Status::AlreadyExists("'" + path + "' already exists");
    }
    NEBULITE_RETURN_IF_ERROR(PrepareFileLocked(path));
    s_->files[path] = NewFileLocked(data);
    return Status::OK();
  }

  Status AppendToFile(const std::string& path, const std::string& data) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    NEBULITE_RETURN_IF_ERROR(PrepareFileLocked(path));
    auto& slot = s_->files[path];
    if (!slot) slot = std::make_shared<MemoryFile>();
    slot->data += data;
    slot->mtime_ns = s_->NowLocked();
    return Status::OK();
  }

  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    std::shared_ptr<MemoryFile> file;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      NEBULITE_ASSIGN_OR_RETURN(file, FindFileLocked(path));
    }
    return std::unique_ptr<ReadableFile>(new MemoryReadableFile(s_, std::move(file)));
  }

  Result<std::string> ReadFile(const std::string& path, uint64_t max_bytes) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    NEBULITE_ASSIGN_OR_RETURN(auto file, FindFileLocked(path));
    if (file->data.size() > max_bytes) {
      return Status::Corruption("'" + path + "' is larger than the limit of " +
                                std::to_string(max_bytes) + " bytes");
    }
    return file->data;
  }

  Result<FileInfo> Stat(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "path", true));
    std::lock_guard<std::mutex> lock(s_->mu);
    FileInfo info;
    auto it = s_->files.find(path);
    if (it != s_->files.end()) {
      info.type = FileType::kFile;
      info.size = it->second->data.size();
      info.mtime_ns = it->second->mtime_ns;
      return info;
    }
    if (!IsDirLocked(path)) return Status::NotFound("'" + path + "' does not exist");
    info.type = FileType::kDirectory;
    info.mtime_ns = path.empty() ? 0 : s_->dirs[path];
    return info;
  }

  Result<bool> Exists(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "path", true));
    std::lock_guard<std::mutex> lock(s_->mu);
    return IsDirLocked(path) || s_->files.count(path) > 0;
  }

  Result<std::vector<std::string>> List(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", true));
    std::lock_guard<std::mutex> lock(s_->mu);
    return ListLocked(dir);
  }

  Status CreateDirs(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", true));
    std::lock_guard<std::mutex> lock(s_->mu);
    if (IsDirLocked(dir)) return Status::OK();
    if (s_->files.count(dir)) return Status::AlreadyExists("'" + dir + "' is a file");
    NEBULITE_RETURN_IF_ERROR(PrepareFileLocked(dir));
    s_->dirs[dir] = s_->NowLocked();
    return Status::OK();
  }

  Status Rename(const std::string& from, const std::string& to) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(from, "rename source", false));
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(to, "rename target", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    if (!IsDirLocked(ParentDir(to))) {
      return Status::NotFound("rename target directory of '" + to + "' does not exist");
    }
    if (from == to) return Status::OK();
    auto it = s_->files.find(from);
    if (it != s_->files.end()) {
      if (IsDirLocked(to))
        return Status::InvalidArgument("rename target '" + to + "' is a directory");
      auto data = it->second;
      s_->files.erase(it);
      s_->files[to] = std::move(data);
      return Status::OK();
    }
    if (!IsDirLocked(from)) return Status::NotFound("rename source '" + from + "' does not exist");
    if (StartsWithDir(to, from)) {
      return Status::InvalidArgument("cannot move '" + from + "' into itself");
    }
    if (s_->files.count(to)) return Status::InvalidArgument("rename target '" + to + "' is a file");
    if (IsDirLocked(to)) {
      if (!ListLocked(to).empty())
        return Status::AlreadyExists("rename target '" + to + "' is not empty");
    }
    MoveTreeLocked(s_->files, from, to);
    MoveTreeLocked(s_->dirs, from, to);
    return Status::OK();
  }

  Status SyncDir(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", true));
    std::lock_guard<std::mutex> lock(s_->mu);
    if (!IsDirLocked(dir)) return Status::NotFound("directory '" + dir + "' does not exist");
    return Status::OK();
  }

  Status Delete(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    if (IsDirLocked(path)) return Status::InvalidArgument("'" + path + "' is a directory");
    s_->files.erase(path);
    return Status::OK();
  }

  Status DeleteRecursively(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    EraseTreeLocked(s_->files, dir);
    EraseTreeLocked(s_->dirs, dir);
    return Status::OK();
  }

  Result<bool> RemoveDirIfEmpty(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->files.count(dir)) return Status::InvalidArgument("'" + dir + "' is not a directory");
    if (!IsDirLocked(dir)) return true;
    if (!ListLocked(dir).empty()) return false;
    s_->dirs.erase(dir);
    return true;
  }

  Result<std::unique_ptr<StoreLock>> TryLock(const std::string& path, bool exclusive) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "lock path", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    if (IsDirLocked(path)) return Status::InvalidArgument("lock '" + path + "' is a directory");
    if (!s_->files.count(path)) {
      NEBULITE_RETURN_IF_ERROR(PrepareFileLocked(path));
      s_->files[path] = NewFileLocked("");
    }
    LockState& l = s_->locks[path];
    if (l.exclusive || (exclusive && l.shared > 0)) return std::unique_ptr<StoreLock>();
    if (exclusive) {
      l.exclusive = true;
    } else {
      ++l.shared;
    }
    return std::unique_ptr<StoreLock>(new MemoryLock(s_, path, exclusive));
  }

 private:
  static const std::string& KeyOf(const std::string& key) { return key; }
  template <typename V>
  static const std::string& KeyOf(const std::pair<const std::string, V>& kv) {
    return kv.first;
  }

  std::shared_ptr<MemoryFile> NewFileLocked(const std::string& data) {
    auto f = std::make_shared<MemoryFile>();
    f->data = data;
    f->mtime_ns = s_->NowLocked();
    return f;
  }

  bool IsDirLocked(const std::string& dir) const { return dir.empty() || s_->dirs.count(dir) > 0; }

  Result<std::shared_ptr<MemoryFile>> FindFileLocked(const std::string& path) const {
    auto it = s_->files.find(path);
    if (it != s_->files.end()) return it->second;
    if (IsDirLocked(path)) return Status::InvalidArgument("'" + path + "' is a directory");
    return Status::NotFound("'" + path + "' does not exist");
  }

  // Checks that `path` can become a file and creates its missing parent directories.
  Status PrepareFileLocked(const std::string& path) {
    if (IsDirLocked(path)) return Status::InvalidArgument("'" + path + "' is a directory");
    std::vector<std::string> missing;
    for (std::string d = ParentDir(path); !d.empty(); d = ParentDir(d)) {
      if (s_->files.count(d)) return Status::IOError("'" + d + "' is not a directory");
      if (!s_->dirs.count(d)) missing.push_back(d);
    }
    for (const std::string& d : missing) s_->dirs[d] = s_->NowLocked();
    return Status::OK();
  }

  // The names directly in `dir`, sorted.
  std::vector<std::string> ListLocked(const std::string& dir) const {
    std::set<std::string> names;
    const std::string prefix = dir.empty() ? "" : dir + "/";
    auto collect = [&](const auto& container) {
      for (auto it = container.lower_bound(prefix); it != container.end(); ++it) {
        const std::string& p = KeyOf(*it);
        if (p.compare(0, prefix.size(), prefix) != 0) break;
        if (p.size() == prefix.size()) continue;
        std::string rest = p.substr(prefix.size());
        names.insert(rest.substr(0, rest.find('/')));
      }
    };
    collect(s_->files);
    collect(s_->dirs);
    return std::vector<std::string>(names.begin(), names.end());
  }

  template <typename Container>
  static void EraseTreeLocked(Container& c, const std::string& dir) {
    for (auto it = c.lower_bound(dir); it != c.end();) {
      const std::string& p = KeyOf(*it);
      if (p.compare(0, dir.size(), dir) != 0) break;
      if (p == dir || StartsWithDir(p, dir)) {
        it = c.erase(it);
      } else {
        ++it;
      }
    }
  }

  template <typename V>
  static void MoveTreeLocked(std::map<std::string, V>& c, const std::string& from,
                             const std::string& to) {
    std::map<std::string, V> moved;
    for (auto it = c.lower_bound(from); it != c.end();) {
      if (it->first.compare(0, from.size(), from) != 0) break;
      if (it->first == from || StartsWithDir(it->first, from)) {
        moved[to + it->first.substr(from.size())] = it->second;
        it = c.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& [p, v] : moved) c[p] = v;
  }

  std::shared_ptr<MemoryState> s_;
};

}  // namespace

std::unique_ptr<Storage> NewMemoryStorage() { return std::make_unique<MemoryStorage>(); }

}  // namespace nebulite

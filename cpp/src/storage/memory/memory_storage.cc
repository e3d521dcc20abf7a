// The memory storage driver, for tests: files and directories in maps.
//
// Everything is durable as soon as it is written (there is no power to lose; wrap it in
// FaultStorage to model crashes). Directories are explicit entries, created with their
// files as a posix filesystem would. A file's bytes live in a shared buffer, like an
// inode: an open WritableFile keeps writing to it across a Rename().
// Thread-safety: one mutex guards all state; every method may be called concurrently.
#include <algorithm>
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

struct MemoryState {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<std::string>> files;  // GUARDED_BY(mu)
  std::set<std::string> dirs;                                 // GUARDED_BY(mu); "" implicit
};

bool StartsWithDir(const std::string& path, const std::string& dir) {
  return path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 &&
         path[dir.size()] == '/';
}

class MemoryWritableFile final : public WritableFile {
 public:
  MemoryWritableFile(std::shared_ptr<MemoryState> state, std::shared_ptr<std::string> data,
                     std::string path)
      : state_(std::move(state)), data_(std::move(data)), path_(std::move(path)) {}

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (closed_) return Status::FailedPrecondition("write to closed file '" + path_ + "'");
    if (n == 0) return Status::OK();
    if (data_->size() < offset + n) data_->resize(offset + n);
    std::memcpy(data_->data() + offset, data, n);
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
  std::shared_ptr<std::string> data_;
  const std::string path_;
  bool closed_ = false;  // GUARDED_BY(state_->mu)
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
      slot->clear();  // O_TRUNC: same inode, no bytes
    } else {
      slot = std::make_shared<std::string>();
    }
    return std::unique_ptr<WritableFile>(new MemoryWritableFile(s_, slot, path));
  }

  Status WriteFileAtomic(const std::string& path, const std::string& data) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    NEBULITE_RETURN_IF_ERROR(PrepareFileLocked(path));
    s_->files[path] = std::make_shared<std::string>(data);  // a new inode replaces the old
    return Status::OK();
  }

  Result<uint64_t> FileSize(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    NEBULITE_ASSIGN_OR_RETURN(auto data, FindFileLocked(path));
    return static_cast<uint64_t>(data->size());
  }

  Result<size_t> ReadAt(const std::string& path, uint64_t offset, size_t n, void* dst) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    NEBULITE_ASSIGN_OR_RETURN(auto data, FindFileLocked(path));
    if (offset >= data->size()) return size_t{0};
    size_t count = std::min<uint64_t>(n, data->size() - offset);
    std::memcpy(dst, data->data() + offset, count);
    return count;
  }

  Result<std::string> ReadFile(const std::string& path, uint64_t max_bytes) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "file path", false));
    std::lock_guard<std::mutex> lock(s_->mu);
    NEBULITE_ASSIGN_OR_RETURN(auto data, FindFileLocked(path));
    if (data->size() > max_bytes) {
      return Status::Corruption("'" + path + "' is larger than the limit of " +
                                std::to_string(max_bytes) + " bytes");
    }
    return *data;
  }

  Result<bool> Exists(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "path", true));
    std::lock_guard<std::mutex> lock(s_->mu);
    return IsDirLocked(path) || s_->files.count(path) > 0;
  }

  Result<std::vector<std::string>> List(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", true));
    std::lock_guard<std::mutex> lock(s_->mu);
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

  Status CreateDirs(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(dir, "directory", true));
    std::lock_guard<std::mutex> lock(s_->mu);
    if (IsDirLocked(dir)) return Status::OK();
    if (s_->files.count(dir)) return Status::AlreadyExists("'" + dir + "' is a file");
    NEBULITE_RETURN_IF_ERROR(PrepareFileLocked(dir));
    s_->dirs.insert(dir);
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
      auto entries = ListLocked(to);
      if (!entries.empty()) return Status::AlreadyExists("rename target '" + to + "' is not empty");
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

 private:
  static const std::string& KeyOf(const std::string& key) { return key; }
  template <typename V>
  static const std::string& KeyOf(const std::pair<const std::string, V>& kv) {
    return kv.first;
  }

  bool IsDirLocked(const std::string& dir) const { return dir.empty() || s_->dirs.count(dir) > 0; }

  Result<std::shared_ptr<std::string>> FindFileLocked(const std::string& path) const {
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
    s_->dirs.insert(missing.begin(), missing.end());
    return Status::OK();
  }

  std::vector<std::string> ListLocked(const std::string& dir) const {
    std::vector<std::string> out;
    for (const auto& [p, _] : s_->files) {
      if (StartsWithDir(p, dir)) out.push_back(p);
    }
    for (const auto& p : s_->dirs) {
      if (StartsWithDir(p, dir)) out.push_back(p);
    }
    return out;
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

  static std::string Moved(const std::string& p, const std::string& from, const std::string& to) {
    return to + p.substr(from.size());
  }

  static void MoveTreeLocked(std::map<std::string, std::shared_ptr<std::string>>& c,
                             const std::string& from, const std::string& to) {
    std::map<std::string, std::shared_ptr<std::string>> moved;
    for (auto it = c.lower_bound(from); it != c.end();) {
      if (it->first.compare(0, from.size(), from) != 0) break;
      if (it->first == from || StartsWithDir(it->first, from)) {
        moved[Moved(it->first, from, to)] = it->second;
        it = c.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& [p, data] : moved) c[p] = data;
  }

  static void MoveTreeLocked(std::set<std::string>& c, const std::string& from,
                             const std::string& to) {
    std::set<std::string> moved;
    for (auto it = c.lower_bound(from); it != c.end();) {
      if (it->compare(0, from.size(), from) != 0) break;
      if (*it == from || StartsWithDir(*it, from)) {
        moved.insert(Moved(*it, from, to));
        it = c.erase(it);
      } else {
        ++it;
      }
    }
    c.insert(moved.begin(), moved.end());
  }

  std::shared_ptr<MemoryState> s_;
};

}  // namespace

std::unique_ptr<Storage> NewMemoryStorage() { return std::make_unique<MemoryStorage>(); }

}  // namespace nebulite

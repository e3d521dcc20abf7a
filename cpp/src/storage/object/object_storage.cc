// Storage over an ObjectClient; the rules are at the top of nebulite/object_store.h.
#include <algorithm>
#include <cstring>
#include <functional>
#include <tuple>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "nebulite/object_store.h"
#include "storage/path_internal.h"

namespace nebulite {
namespace {

using internal::ValidateRelativePath;

std::string DirPrefix(const std::string& dir) { return dir.empty() ? "" : dir + "/"; }

// The blocks small reads are served from, shared by every file of a store: a load opens
// a file twice (its index, then its records), and each request to a store costs a round
// trip whatever its size. Blocks are 1 MiB, counted from the end of the file (its index
// is at the end: the last block holds it whole), keyed by the version read; the last few
// are kept.
class BlockCache {
 public:
  static constexpr uint64_t kBlockBytes = 1ull << 20;
  static constexpr size_t kBlocksKept = 8;

  using Fetch = std::function<Result<size_t>(uint64_t offset, size_t n, void* dst)>;

  // Block `index` (0: the last) of the file `key` at `etag` of `size` bytes, fetched on
  // first use (under the lock: readers of one block wait for one request).
  Result<std::shared_ptr<const std::string>> Get(const std::string& key, const std::string& etag,
                                                 uint64_t size, uint64_t index,
                                                 const Fetch& fetch) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto id = std::make_tuple(key, etag, index);
    for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
      if (it->first == id) {
        auto hit = *it;
        blocks_.erase(it);
        blocks_.insert(blocks_.begin(), hit);  // most recent first
        return hit.second;
      }
    }
    const uint64_t end = size - index * kBlockBytes;
    const uint64_t start = end > kBlockBytes ? end - kBlockBytes : 0;
    auto block = std::make_shared<std::string>(static_cast<size_t>(end - start), '\0');
    NEBULITE_ASSIGN_OR_RETURN(size_t got, fetch(start, block->size(), block->data()));
    if (got != block->size()) return Status::IOError("'" + key + "' shrank while being read");
    if (!etag.empty()) {  // without an etag, a block could outlive its version
      blocks_.insert(blocks_.begin(), {id, block});
      if (blocks_.size() > kBlocksKept) blocks_.pop_back();
    }
    return std::shared_ptr<const std::string>(block);
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<std::tuple<std::string, std::string, uint64_t>,
                        std::shared_ptr<const std::string>>>
      blocks_;  // GUARDED_BY(mu_)
};

// Reads of the version opened; small ones through the store's BlockCache.
class ObjectReadableFile final : public ReadableFile {
 public:
  static constexpr size_t kSmallRead = 256 << 10;  // reads below this go through blocks

  ObjectReadableFile(std::shared_ptr<ObjectClient> client, std::shared_ptr<BlockCache> cache,
                     std::string key, ObjectInfo info)
      : client_(std::move(client)),
        cache_(std::move(cache)),
        key_(std::move(key)),
        info_(std::move(info)) {}
  uint64_t size() const override { return info_.size; }

  Result<size_t> ReadAt(uint64_t offset, size_t n, void* dst) override {
    const uint64_t size = info_.size;
    if (offset >= size || n == 0) return size_t{0};
    n = static_cast<size_t>(std::min<uint64_t>(n, size - offset));
    if (n >= kSmallRead) return Fetch(offset, n, dst);
    uint8_t* out = static_cast<uint8_t*>(dst);
    const auto fetch = [this](uint64_t at, size_t len, void* to) { return Fetch(at, len, to); };
    for (size_t done = 0; done < n;) {  // at most two blocks
      const uint64_t at = offset + done;
      const uint64_t index = (size - 1 - at) / BlockCache::kBlockBytes;
      NEBULITE_ASSIGN_OR_RETURN(std::shared_ptr<const std::string> block,
                                cache_->Get(key_, info_.etag, size, index, fetch));
      const uint64_t block_end = size - index * BlockCache::kBlockBytes;
      const uint64_t block_start = block_end - block->size();
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n - done, block_end - at));
      std::memcpy(out + done, block->data() + (at - block_start), take);
      done += take;
    }
    return n;
  }

 private:
  Result<size_t> Fetch(uint64_t offset, size_t n, void* dst) {
    Result<size_t> got = client_->Get(key_, offset, n, dst, info_.etag);
    if (!got.ok() && got.status().code() == StatusCode::kNotFound) {
      return Status::IOError("'" + key_ + "' was deleted after it was opened for reading");
    }
    return got;
  }

  std::shared_ptr<ObjectClient> client_;
  std::shared_ptr<BlockCache> cache_;
  const std::string key_;
  const ObjectInfo info_;
};

// Holds what is written in memory; Sync() puts it whole.
class ObjectWritableFile final : public WritableFile {
 public:
  ObjectWritableFile(std::shared_ptr<ObjectClient> client, std::string key, uint64_t size)
      : client_(std::move(client)), key_(std::move(key)) {
    data_.reserve(static_cast<size_t>(std::min<uint64_t>(size, 64ull << 20)));
  }
  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return Status::FailedPrecondition("'" + key_ + "' is closed");
    if (n == 0) return Status::OK();
    if (data_.size() < offset + n) data_.resize(static_cast<size_t>(offset + n), '\0');
    std::memcpy(data_.data() + offset, data, n);
    return Status::OK();
  }
  Status Sync() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return Status::FailedPrecondition("'" + key_ + "' is closed");
    return client_->Put(key_, {ByteSpan{data_.data(), data_.size()}}, false);
  }
  Status Close() override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    std::string().swap(data_);
    return Status::OK();
  }

 private:
  std::shared_ptr<ObjectClient> client_;
  const std::string key_;
  std::mutex mu_;
  std::string data_;     // GUARDED_BY(mu_)
  bool closed_ = false;  // GUARDED_BY(mu_)
};

class ObjectStorage final : public Storage {
 public:
  static constexpr size_t kOneGetRead = 64 << 10;  // ReadFile's first (often only) request

  ObjectStorage(std::shared_ptr<ObjectClient> client, bool read_only)
      : client_(std::move(client)), read_only_(read_only) {}

  std::string Describe() const override { return client_->Describe(); }
  bool read_only() const override { return read_only_; }
  bool is_object_store() const override { return true; }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path,
                                                        uint64_t size) override {
    NEBULITE_RETURN_IF_ERROR(CheckWrite(path));
    return std::unique_ptr<WritableFile>(new ObjectWritableFile(client_, path, size));
  }

  Status WriteWholeFile(const std::string& path, const std::vector<ByteSpan>& pieces) override {
    NEBULITE_RETURN_IF_ERROR(CheckWrite(path));
    return client_->Put(path, pieces, false);
  }

  Status WriteFileAtomic(const std::string& path, const std::string& data) override {
    NEBULITE_RETURN_IF_ERROR(CheckWrite(path));
    return client_->Put(path, {ByteSpan{data.data(), data.size()}}, false);
  }

  Status CreateFileExclusive(const std::string& path, const std::string& data) override {
    NEBULITE_RETURN_IF_ERROR(CheckWrite(path));
    return client_->Put(path, {ByteSpan{data.data(), data.size()}}, true);
  }

  Status AppendToFile(const std::string& path, const std::string& data) override {
    NEBULITE_RETURN_IF_ERROR(CheckWrite(path));
    std::lock_guard<std::mutex> lock(append_mu_);
    std::string content;
    Result<ObjectInfo> info = client_->Head(path);
    if (info.ok()) {
      content.resize(static_cast<size_t>(info->size));
      NEBULITE_ASSIGN_OR_RETURN(size_t got,
                                client_->Get(path, 0, content.size(), content.data(), info->etag));
      content.resize(got);
    } else if (info.status().code() != StatusCode::kNotFound) {
      return info.status();
    }
    content += data;
    return client_->Put(path, {ByteSpan{content.data(), content.size()}}, false);
  }

  Result<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    NEBULITE_ASSIGN_OR_RETURN(ObjectInfo info, HeadFile(path));
    return std::unique_ptr<ReadableFile>(
        new ObjectReadableFile(client_, blocks_, path, std::move(info)));
  }

  // One GET for a small file (markers, manifests, leases: what is read most): a request
  // returns one version whole, so a read shorter than asked is the file. A longer file is
  // read again, all of it, pinned to the version a HEAD names.
  Result<std::string> ReadFile(const std::string& path, uint64_t max_bytes) override {
    NEBULITE_RETURN_IF_ERROR(ValidateRelativePath(path, "path", false));
    std::string first(max_bytes < kOneGetRead ? static_cast<size_t>(max_bytes) + 1 : kOneGetRead,
                      '\0');
    Result<size_t> got = client_->Get(path, 0, first.size(), first.data(), "");
    if (!got.ok()) {
      if (got.status().code() != StatusCode::kNotFound) return got.status();
      NEBULITE_ASSIGN_OR_RETURN(bool dir, IsDir(path));
      if (dir) return Status::InvalidArgument("'" + path + "' is a directory, not a file");
      return got.status();
    }
    if (*got < first.size()) {
      first.resize(*got);
      return first;
    }
    if (*got > max_bytes) return TooLarge(path, *got, max_bytes);
    NEBULITE_ASSIGN_OR_RETURN(ObjectInfo info, HeadFile(path));
    if (info.size > max_bytes) return TooLarge(path, info.size, max_bytes);
    std::string out(static_cast<size_t>(info.size), '\0');
    if (!out.empty()) {
      NEBULITE_ASSIGN_OR_RETURN(size_t n, client_->Get(path, 0, out.size(), out.data(), info.etag));
      if (n != out.size()) return Status::IOError("'" + path + "' shrank while being read");
    }
    return out;
  }

  Result<FileInfo> Stat(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(ValidateRelativePath(path, "path", true));
    if (path.empty()) return FileInfo{FileType::kDirectory, 0, 0};
    Result<ObjectInfo> info = client_->Head(path);
    if (info.ok()) return FileInfo{FileType::kFile, info->size, info->mtime_ns};
    if (info.status().code() != StatusCode::kNotFound) return info.status();
    NEBULITE_ASSIGN_OR_RETURN(bool dir, IsDir(path));
    if (dir) return FileInfo{FileType::kDirectory, 0, 0};
    return Status::NotFound("'" + path + "' does not exist in " + Describe());
  }

  Result<FileInfo> StatFile(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(ValidateRelativePath(path, "path", false));
    Result<ObjectInfo> info = client_->Head(path);
    if (!info.ok()) return info.status();
    return FileInfo{FileType::kFile, info->size, info->mtime_ns};
  }

  Result<bool> Exists(const std::string& path) override {
    Result<FileInfo> info = Stat(path);
    if (info.ok()) return true;
    if (info.status().code() == StatusCode::kNotFound) return false;
    return info.status();
  }

  Result<std::vector<std::string>> List(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(ValidateRelativePath(dir, "directory", true));
    const std::string prefix = DirPrefix(dir);
    NEBULITE_ASSIGN_OR_RETURN(ObjectListing listing, client_->List(prefix, false));
    std::set<std::string> names;
    auto add = [&](const std::string& key) {
      if (key.size() <= prefix.size() || key.compare(0, prefix.size(), prefix) != 0) return;
      std::string name = key.substr(prefix.size());
      // Keys no Storage path can name (empty components, "..") are not ours: skipped.
      if (ValidatePathComponent(name, "name").ok()) names.insert(std::move(name));
    };
    for (const auto& [key, info] : listing.objects) add(key);
    for (const std::string& p : listing.prefixes) add(p);
    return std::vector<std::string>(names.begin(), names.end());
  }

  Status CreateDirs(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(ValidateRelativePath(dir, "directory", true));
    if (read_only_ && !dir.empty()) return ReadOnlyError(dir);
    return Status::OK();  // a directory exists once a file is below it
  }

  Status Rename(const std::string& from, const std::string& to) override {
    NEBULITE_RETURN_IF_ERROR(CheckWrite(from));
    NEBULITE_RETURN_IF_ERROR(CheckWrite(to));
    Result<ObjectInfo> info = client_->Head(from);
    if (info.ok()) {
      NEBULITE_RETURN_IF_ERROR(client_->Copy(from, to));
      return client_->Delete(from);
    }
    if (info.status().code() != StatusCode::kNotFound) return info.status();
    // A directory: every object below it, copied first, then deleted.
    NEBULITE_ASSIGN_OR_RETURN(ObjectListing listing, client_->List(from + "/", true));
    if (listing.objects.empty()) {
      return Status::NotFound("cannot rename '" + from + "': it does not exist in " + Describe());
    }
    for (const auto& [key, meta] : listing.objects) {
      NEBULITE_RETURN_IF_ERROR(client_->Copy(key, to + key.substr(from.size())));
    }
    for (const auto& [key, meta] : listing.objects) NEBULITE_RETURN_IF_ERROR(client_->Delete(key));
    return Status::OK();
  }

  Status SyncDir(const std::string& dir) override {
    return ValidateRelativePath(dir, "directory", true);  // every put is durable
  }

  Status Delete(const std::string& path) override {
    NEBULITE_RETURN_IF_ERROR(CheckWrite(path));
    return client_->Delete(path);
  }

  Status DeleteRecursively(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(CheckWrite(dir));
    NEBULITE_ASSIGN_OR_RETURN(ObjectListing listing, client_->List(dir + "/", true));
    for (const auto& [key, meta] : listing.objects) NEBULITE_RETURN_IF_ERROR(client_->Delete(key));
    return Status::OK();
  }

  Result<bool> RemoveDirIfEmpty(const std::string& dir) override {
    NEBULITE_RETURN_IF_ERROR(CheckWrite(dir));
    NEBULITE_ASSIGN_OR_RETURN(ObjectListing listing, client_->List(dir + "/", true));
    return listing.objects.empty();  // an empty directory does not exist
  }

  Result<std::unique_ptr<StoreLock>> TryLock(const std::string& path, bool exclusive) override {
    (void)exclusive;
    NEBULITE_RETURN_IF_ERROR(ValidateRelativePath(path, "lock path", false));
    return Status::FailedPrecondition(Describe() +
                                      " is an object store: it has no locks shared between "
                                      "processes");
  }

 private:
  Status ReadOnlyError(const std::string& path) const {
    return Status::PermissionDenied(Describe() + " is open for reading only: cannot change '" +
                                    path + "'");
  }

  // `size`: what is known of it (at least max_bytes + 1).
  static Status TooLarge(const std::string& path, uint64_t size, uint64_t max_bytes) {
    const std::string has = size == max_bytes + 1 ? "more than the "
                                                  : std::to_string(size) + " bytes, more than the ";
    return Status::Corruption("'" + path + "' has " + has + std::to_string(max_bytes) +
                              " bytes expected");
  }

  Status CheckWrite(const std::string& path) const {
    NEBULITE_RETURN_IF_ERROR(ValidateRelativePath(path, "path", false));
    return read_only_ ? ReadOnlyError(path) : Status::OK();
  }

  Result<bool> IsDir(const std::string& path) {
    NEBULITE_ASSIGN_OR_RETURN(ObjectListing listing, client_->List(path + "/", false));
    return !listing.objects.empty() || !listing.prefixes.empty();
  }

  // The object at `path`, which must be a file: NotFound if nothing is there,
  // InvalidArgument if it is a directory.
  Result<ObjectInfo> HeadFile(const std::string& path) {
    NEBULITE_RETURN_IF_ERROR(ValidateRelativePath(path, "path", false));
    Result<ObjectInfo> info = client_->Head(path);
    if (info.ok() || info.status().code() != StatusCode::kNotFound) return info;
    NEBULITE_ASSIGN_OR_RETURN(bool dir, IsDir(path));
    if (dir) return Status::InvalidArgument("'" + path + "' is a directory, not a file");
    return info.status();
  }

  std::shared_ptr<ObjectClient> client_;
  const bool read_only_;
  const std::shared_ptr<BlockCache> blocks_ = std::make_shared<BlockCache>();
  std::mutex append_mu_;  // serialises this process's appends
};

}  // namespace

std::unique_ptr<Storage> OpenObjectStorage(std::shared_ptr<ObjectClient> client, bool read_only) {
  return std::unique_ptr<Storage>(new ObjectStorage(std::move(client), read_only));
}

}  // namespace nebulite

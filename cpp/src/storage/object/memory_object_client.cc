// An object store in memory, for tests: keys in a map, each with its bytes, mtime and an
// etag that changes with every put. As in the real stores, nothing but objects exists,
// only the newest version of a key is kept, and a conditional put is decided atomically.
// Thread-safety: one mutex guards all state.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "nebulite/object_store.h"

namespace nebulite {
namespace {

struct MemoryObject {
  std::string data;
  ObjectInfo info;
};

class MemoryObjectClient final : public ObjectClient {
 public:
  explicit MemoryObjectClient(std::string name) : name_(std::move(name)) {}

  std::string Describe() const override { return "memory-objects://" + name_; }

  Status Put(const std::string& key, const std::vector<ByteSpan>& data, bool if_absent) override {
    std::string bytes;
    for (const ByteSpan& p : data) bytes.append(static_cast<const char*>(p.data), p.size);
    std::lock_guard<std::mutex> lock(mu_);
    if (if_absent && objects_.count(key)) {
      return Status::AlreadyExists("'" + key + "' exists in " + Describe());
    }
    MemoryObject& o = objects_[key];
    o.data = std::move(bytes);
    o.info.size = o.data.size();
    o.info.mtime_ns = NowLocked();
    o.info.etag = std::to_string(++puts_);
    return Status::OK();
  }

  Result<size_t> Get(const std::string& key, uint64_t offset, size_t n, void* dst,
                     const std::string& etag) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(key);
    if (it == objects_.end()) return Status::NotFound("'" + key + "' is not in " + Describe());
    if (!etag.empty() && it->second.info.etag != etag) {
      return Status::IOError("'" + key + "' changed after it was opened for reading");
    }
    const std::string& d = it->second.data;
    if (offset >= d.size()) return size_t{0};
    const size_t got = std::min<size_t>(n, d.size() - static_cast<size_t>(offset));
    std::memcpy(dst, d.data() + offset, got);
    return got;
  }

  Result<ObjectInfo> Head(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(key);
    if (it == objects_.end()) return Status::NotFound("'" + key + "' is not in " + Describe());
    return it->second.info;
  }

  Result<ObjectListing> List(const std::string& prefix, bool recursive) override {
    std::lock_guard<std::mutex> lock(mu_);
    ObjectListing out;
    for (auto it = objects_.lower_bound(prefix);
         it != objects_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
      const size_t slash = it->first.find('/', prefix.size());
      if (recursive || slash == std::string::npos) {
        out.objects.emplace_back(it->first, it->second.info);
      } else {
        std::string p = it->first.substr(0, slash);
        if (out.prefixes.empty() || out.prefixes.back() != p) out.prefixes.push_back(std::move(p));
      }
    }
    return out;
  }

  Status Copy(const std::string& from, const std::string& to) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(from);
    if (it == objects_.end()) return Status::NotFound("'" + from + "' is not in " + Describe());
    MemoryObject copy = it->second;
    copy.info.mtime_ns = NowLocked();
    copy.info.etag = std::to_string(++puts_);
    objects_[to] = std::move(copy);
    return Status::OK();
  }

  Status Delete(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    objects_.erase(key);
    return Status::OK();
  }

 private:
  int64_t NowLocked() {
    int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
    last_ns_ = std::max(now, last_ns_ + 1);
    return last_ns_;
  }

  const std::string name_;
  std::mutex mu_;
  std::map<std::string, MemoryObject> objects_;  // GUARDED_BY(mu_)
  uint64_t puts_ = 0;                            // GUARDED_BY(mu_)
  int64_t last_ns_ = 0;                          // GUARDED_BY(mu_)
};

}  // namespace

std::shared_ptr<ObjectClient> NewMemoryObjectClient(const std::string& name) {
  return std::make_shared<MemoryObjectClient>(name);
}

}  // namespace nebulite

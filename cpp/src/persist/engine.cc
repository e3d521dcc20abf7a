// The embedded engine: arena + copy engine + persister + commit coordinator.
// See nebulite/engine.h for the lifecycle and the thread-safety contract.
//
// Persisting one object (a file image laid out in the arena exactly as on disk):
//  1. the image is cut into 4 KiB-aligned chunks; io threads compute each chunk's
//     payload CRCs and write it (O_DIRECT where aligned) in parallel;
//  2. the per-record CRCs are combined, the local headers patched in the arena and
//     the 4 KiB blocks holding them written again;
//  3. the central directory (the tail) is written and the file fdatasync'd.
// Then the rank's manifest is written (temp, fsync, rename, fsync dir) and, once all
// ranks' manifests exist, rank 0 writes the commit marker and applies retention.
#include "nebulite/engine.h"

#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include "nebulite/arena.h"
#include "nebulite/commit.h"
#include "nebulite/copy_engine.h"
#include "nebulite/crc32.h"
#include "nebulite/stream_writer.h"
#include "persist/history.h"

namespace nebulite {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kChunk = 16ull << 20;
constexpr uint64_t kBlock = 4096;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
uint64_t AlignDown(uint64_t v) { return v / kBlock * kBlock; }

struct ObjectState {
  std::string name;
  format::ArchiveLayout layout;
  std::vector<RecordRef> refs;
  ArenaBlock block;
  bool in_memory = false;
  bool streamed = false;         // already durable in the store
  bool sealed = true;            // every byte is in the arena (false while a deferred copy runs)
  bool awaiting_writer = false;  // reserved by Reserve(), not yet sealed by its writer
  bool queued = false;           // a persist job for it is queued or running
  bool written = false;          // its data file is durable (file is valid)
  uint64_t bytes = 0;
  double blocking_seconds = 0;
  ManifestFile file;  // filled once the data file is durable
};

struct VersionState {
  std::string tag, version;
  std::vector<std::unique_ptr<ObjectState>> objects;
  bool committed = false;
  uint64_t seq = 0;
  bool must_persist = false;
  bool persist_requested = false;
  bool persisted = false;        // this rank's manifest is durable
  bool store_committed = false;  // the commit marker is known to exist
  bool failed = false;
  bool failure_flushed = false;  // a Flush() has returned this failure
  Status error;
  bool evicted = false;
  bool abandoned = false;
  int64_t commit_unix_ns = 0;
  int pins = 0;

  ObjectState* Find(const std::string& name) {
    for (auto& o : objects)
      if (o->name == name) return o.get();
    return nullptr;
  }
};

class EngineImpl;

class LeaseImpl : public ObjectLease {
 public:
  LeaseImpl(EngineImpl* e, std::shared_ptr<VersionState> v, const uint8_t* data,
            const std::vector<RecordRef>* refs)
      : engine_(e), version_(std::move(v)), data_(data), refs_(refs) {}
  ~LeaseImpl() override;
  const uint8_t* data() const override { return data_; }
  const std::vector<RecordRef>& records() const override { return *refs_; }

 private:
  EngineImpl* engine_;
  std::shared_ptr<VersionState> version_;
  const uint8_t* data_;
  const std::vector<RecordRef>* refs_;
};

class EngineImpl : public Engine {
 public:
  EngineImpl(EngineOptions o, std::shared_ptr<Arena> arena, std::shared_ptr<Storage> storage)
      : opts_(std::move(o)),
        arena_(std::move(arena)),
        storage_(std::move(storage)),
        copy_(opts_.copy_threads),
        io_(opts_.io_threads > 0 ? opts_.io_threads : 4),
        history_(storage_ && opts_.write_history && !opts_.storage_override ? opts_.persist_root
                                                                            : std::string()) {
    stager_ = std::thread([this] { StagerLoop(); });
    if (storage_) persister_ = std::thread([this] { PersisterLoop(); });
    if (storage_ && opts_.rank == 0 && opts_.world_size > 1)
      coordinator_ = std::thread([this] { CoordinatorLoop(); });
  }

  ~EngineImpl() override { (void)Close(60); }

  // Checks the names, plans the data file and finds the (uncommitted) version.
  Result<std::unique_ptr<ObjectState>> PlanObject(const std::string& tag,
                                                  const std::string& version,
                                                  const std::string& name,
                                                  const std::vector<format::RecordSpec>& specs,
                                                  std::shared_ptr<VersionState>* v) {
    NEBULITE_RETURN_IF_ERROR(ValidatePathComponent(tag, "tag"));
    NEBULITE_RETURN_IF_ERROR(ValidatePathComponent(version, "version"));
    NEBULITE_RETURN_IF_ERROR(ValidatePathComponent(name, "name"));
    NEBULITE_ASSIGN_OR_RETURN(auto layout, format::ArchiveLayout::Plan(specs));
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return Status::FailedPrecondition("the engine is closed");
      *v = GetOrCreateLocked(tag, version);
      if ((*v)->committed) {
        return Status::FailedPrecondition("version " + version + " of tag '" + tag +
                                          "' is already committed");
      }
      if ((*v)->Find(name) != nullptr) {
        return Status::AlreadyExists("'" + name + "' was already saved in checkpoint '" + tag +
                                     "'");
      }
    }
    auto obj = std::make_unique<ObjectState>();
    obj->name = name;
    obj->bytes = layout.file_size();
    for (const auto& p : layout.records()) obj->refs.push_back({p.name, p.data_offset, p.size});
    obj->layout = std::move(layout);
    return obj;
  }

  Result<StageInfo> Stage(const std::string& tag, const std::string& version,
                          const std::string& name, const std::vector<SourceRecord>& records,
                          bool persist_now) override {
    auto t0 = Clock::now();
    std::vector<format::RecordSpec> specs;
    specs.reserve(records.size());
    for (const auto& r : records) {
      if (r.size > 0 && r.data == nullptr)
        return Status::InvalidArgument("record " + r.name + " has no data");
      specs.push_back({r.name, r.size});
    }
    std::shared_ptr<VersionState> v;
    NEBULITE_ASSIGN_OR_RETURN(auto obj, PlanObject(tag, version, name, specs, &v));

    std::vector<CopySpan> deferred;
    auto block = ReserveForImage(obj->layout.file_size());
    if (block.ok()) {
      obj->block = *block;
      obj->in_memory = true;
      deferred = FillImage(obj.get(), records);
    } else if (block.status().code() == StatusCode::kResourceExhausted && storage_) {
      NEBULITE_RETURN_IF_ERROR(StreamObject(tag, version, obj.get(), records));
    } else {
      return block.status().WithContext(
          storage_ ? "staging '" + name + "'"
                   : "staging '" + name +
                         "' (no persistent path is set, so a state must fit "
                         "in the memory budget NEBULA_MEMORY_BUFFER_SIZE)");
    }
    obj->blocking_seconds = Seconds(t0, Clock::now());
    StageInfo info{obj->bytes, obj->blocking_seconds, obj->streamed, !deferred.empty()};
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (obj->streamed) {
        obj->written = true;
        v->must_persist = true;
      }
      ObjectState* o = obj.get();
      v->objects.push_back(std::move(obj));
      if (!deferred.empty()) {
        o->sealed = false;
        ++v->pins;  // released by the stager once the copy has landed
        stage_queue_.push_back({v, o, std::move(deferred)});
        stage_cv_.notify_all();
      }
      // Start writing at once when the version is known to be persisted.
      if (persist_now && storage_ && !o->written) EnqueueObjectLocked(v, o);
    }
    return info;
  }

  Result<Reservation> Reserve(const std::string& tag, const std::string& version,
                              const std::string& name,
                              const std::vector<format::RecordSpec>& specs) override {
    auto t0 = Clock::now();
    std::shared_ptr<VersionState> v;
    NEBULITE_ASSIGN_OR_RETURN(auto obj, PlanObject(tag, version, name, specs, &v));
    NEBULITE_ASSIGN_OR_RETURN(obj->block, ReserveForImage(obj->layout.file_size()));
    obj->in_memory = true;
    uint8_t* image = arena_->base() + obj->block.offset;
    const auto& place = obj->layout.records();
    for (size_t i = 0; i < place.size(); ++i) {
      std::string h = obj->layout.LocalHeader(i, 0);
      std::memcpy(image + place[i].header_offset, h.data(), h.size());
    }
    Reservation r{obj->block.offset, obj->bytes, obj->refs};
    obj->blocking_seconds = Seconds(t0, Clock::now());
    obj->sealed = false;
    obj->awaiting_writer = true;
    std::lock_guard<std::mutex> lock(mu_);
    ++v->pins;  // held until Seal() or Discard()
    v->objects.push_back(std::move(obj));
    return r;
  }

  Status Seal(const std::string& tag, const std::string& version, const std::string& name,
              bool persist_now) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto v = FindLocked(tag, version);
    ObjectState* o = v ? v->Find(name) : nullptr;
    if (!o || !o->awaiting_writer)
      return Status::NotFound("no reservation of '" + name + "' in '" + tag + "'");
    o->awaiting_writer = false;
    o->sealed = true;
    --v->pins;
    stage_cv_.notify_all();
    if (persist_now && storage_) EnqueueObjectLocked(v, o);
    return Status::OK();
  }

  Status Discard(const std::string& tag, const std::string& version,
                 const std::string& name) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto v = FindLocked(tag, version);
    ObjectState* o = v ? v->Find(name) : nullptr;
    if (!o || !o->awaiting_writer)
      return Status::NotFound("no reservation of '" + name + "' in '" + tag + "'");
    ReleaseObjectLocked(o);
    --v->pins;
    v->objects.erase(std::find_if(v->objects.begin(), v->objects.end(),
                                  [&](const auto& p) { return p.get() == o; }));
    return Status::OK();
  }

  Status Adopt(const std::string& tag, const std::string& version,
               const ManifestFile& file) override {
    NEBULITE_RETURN_IF_ERROR(ValidatePathComponent(tag, "tag"));
    NEBULITE_RETURN_IF_ERROR(ValidatePathComponent(version, "version"));
    NEBULITE_RETURN_IF_ERROR(ValidatePathComponent(file.name, "name"));
    if (!storage_) return Status::FailedPrecondition("no persistent path is set");
    NEBULITE_RETURN_IF_ERROR(
        VerifyDataFile(storage_.get(), DataFilePath(tag, version, opts_.rank, file.name), file));
    std::lock_guard<std::mutex> lock(mu_);
    auto v = GetOrCreateLocked(tag, version);
    if (v->committed)
      return Status::FailedPrecondition("version " + version + " of '" + tag + "' is committed");
    if (v->Find(file.name) != nullptr)
      return Status::AlreadyExists("'" + file.name + "' was already saved in checkpoint '" + tag +
                                   "'");
    auto obj = std::make_unique<ObjectState>();
    obj->name = file.name;
    obj->bytes = file.size;
    obj->streamed = true;
    obj->written = true;
    obj->file = file;
    v->objects.push_back(std::move(obj));
    v->must_persist = true;
    return Status::OK();
  }

  const Arena& arena() const override { return *arena_; }

  bool MustPersist(const std::string& tag, const std::string& version) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto v = FindLocked(tag, version);
    return v && v->must_persist;
  }

  Status Commit(const std::string& tag, const std::string& version, uint64_t seq,
                bool persist) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto v = FindLocked(tag, version);
    if (!v) v = GetOrCreateLocked(tag, version);  // a rank that saved nothing still commits
    if (v->committed) return Status::OK();
    for (auto& o : v->objects)
      if (o->awaiting_writer)
        return Status::FailedPrecondition("'" + o->name + "' of checkpoint '" + tag +
                                          "' is reserved but not sealed");
    if (v->must_persist && !persist) {
      return Status::FailedPrecondition("checkpoint '" + tag +
                                        "' streamed to storage and must be persisted");
    }
    if (persist && !storage_) return Status::FailedPrecondition("no persistent path is set");
    v->committed = true;
    v->seq = seq;
    v->commit_unix_ns = NowUnixNs();
    if (persist) EnqueueVersionLocked(v);
    if (!persist) {
      for (auto& o : v->objects)
        history_.Append({tag, version, o->name, opts_.rank, o->bytes, o->blocking_seconds, 0,
                         "memory", "in_memory"});
    }
    ApplyMemoryRetentionLocked();
    return Status::OK();
  }

  Status Persist(const std::string& tag, const std::string& version) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto v = FindLocked(tag, version);
    if (!v || !v->committed)
      return Status::NotFound("no committed version " + version + " of '" + tag + "' in memory");
    if (!storage_) return Status::FailedPrecondition("no persistent path is set");
    if (v->persist_requested && !v->failed) return Status::OK();
    for (auto& o : v->objects)
      if (!o->in_memory && !o->written)
        return Status::NotFound("checkpoint '" + tag +
                                "' was evicted from memory before it was persisted");
    v->failed = false;
    EnqueueVersionLocked(v);
    return Status::OK();
  }

  Status Flush(double timeout_seconds) override {
    auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(timeout_seconds));
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      bool pending = !queue_.empty() || busy_;
      std::vector<std::shared_ptr<VersionState>> awaiting;
      for (auto& v : versions_) {
        if (!v->persist_requested || v->failed || v->store_committed) continue;
        if (!v->persisted)
          pending = true;
        else
          awaiting.push_back(v);
      }
      if (!pending && opts_.rank != 0) {
        // Other ranks learn of commits by seeing the marker.
        lock.unlock();
        for (auto& v : awaiting) {
          if (CommittedOrRetired(*v)) {
            std::lock_guard<std::mutex> l2(mu_);
            v->store_committed = true;
          }
        }
        lock.lock();
        awaiting.erase(std::remove_if(awaiting.begin(), awaiting.end(),
                                      [](auto& v) { return v->store_committed || v->failed; }),
                       awaiting.end());
      }
      if (!pending && awaiting.empty()) break;
      if (Clock::now() >= deadline)
        return Status::Cancelled("flush timed out with checkpoints still being persisted");
      cv_.wait_for(lock, std::chrono::milliseconds(10));
    }
    Status result;
    for (auto& v : versions_) {
      if (v->failed && !v->failure_flushed) {
        v->failure_flushed = true;
        if (result.ok())
          result = Status::IOError("persisting checkpoint '" + v->tag +
                                   "' failed: " + v->error.ToString());
      }
    }
    return result;
  }

  void Abandon(const std::string& tag, const std::string& version) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto v = FindLocked(tag, version);
    if (!v || v->committed) return;
    v->abandoned = true;  // queued jobs skip it and release what they hold
    for (auto& o : v->objects) {
      if (o->awaiting_writer) {  // its writer will never seal it now
        o->awaiting_writer = false;
        --v->pins;
        ReleaseObjectLocked(o.get());
      } else if (!o->queued && o->sealed) {
        ReleaseObjectLocked(o.get());
      }
    }
    versions_.remove(v);
  }

  std::vector<VersionInfo> Versions() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<VersionInfo> out;
    for (auto& v : versions_) {
      if (!v->committed) continue;
      VersionInfo i;
      i.tag = v->tag;
      i.version = v->version;
      i.seq = v->seq;
      i.commit_unix_ns = v->commit_unix_ns;
      i.in_memory = !v->evicted;
      for (auto& o : v->objects) {
        if (!o->in_memory) i.in_memory = false;
        i.names.push_back(o->name);
      }
      i.persist_requested = v->persist_requested;
      i.persisted = v->persisted;
      i.failed = v->failed;
      out.push_back(std::move(i));
    }
    std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.seq < b.seq; });
    return out;
  }

  Result<std::shared_ptr<ObjectLease>> Pin(const std::string& tag, const std::string& version,
                                           const std::string& name) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto v = FindLocked(tag, version);
    if (!v) return Status::NotFound("version " + version + " of '" + tag + "' is not in memory");
    ObjectState* o = v->Find(name);
    if (!o) return Status::NotFound("'" + name + "' is not in checkpoint '" + tag + "'");
    if (!o->in_memory) return Status::NotFound("'" + name + "' of '" + tag + "' is not in memory");
    ++v->pins;
    WaitSealedLocked(lock, o);
    return std::shared_ptr<ObjectLease>(
        new LeaseImpl(this, v, arena_->base() + o->block.offset, &o->refs));
  }

  void Unpin(VersionState* v) {
    std::lock_guard<std::mutex> lock(mu_);
    --v->pins;
    ApplyMemoryRetentionLocked();
  }

  std::vector<Status> TakeErrors() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Status> out;
    out.swap(errors_);
    return out;
  }
  std::vector<HistoryRow> History() override { return history_.Rows(); }
  Storage* storage() override { return storage_.get(); }
  uint64_t memory_capacity() const override { return arena_->capacity(); }
  uint64_t memory_used() const override { return arena_->used(); }
  uint64_t memory_resident() const override { return arena_->resident(); }
  void WaitPrefaulted() override { arena_->WaitPrefaulted(); }

  Status Close(double timeout_seconds) override {
    Status st;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return Status::OK();
    }
    if (storage_) st = Flush(timeout_seconds);
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    WaitStaged();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stager_stop_ = true;
    }
    stage_cv_.notify_all();
    if (stager_.joinable()) stager_.join();
    cv_.notify_all();
    if (persister_.joinable()) persister_.join();
    if (coordinator_.joinable()) coordinator_.join();
    return st;
  }

 private:
  std::shared_ptr<VersionState> FindLocked(const std::string& tag, const std::string& version) {
    for (auto& v : versions_)
      if (v->tag == tag && v->version == version) return v;
    return nullptr;
  }
  std::shared_ptr<VersionState> GetOrCreateLocked(const std::string& tag,
                                                  const std::string& version) {
    auto v = FindLocked(tag, version);
    if (v) return v;
    v = std::make_shared<VersionState>();
    v->tag = tag;
    v->version = version;
    versions_.push_back(v);
    return v;
  }

  static int64_t NowUnixNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  void EnqueueObjectLocked(const std::shared_ptr<VersionState>& v, ObjectState* o) {
    o->queued = true;
    queue_.push_back({v, o});
    cv_.notify_all();
  }
  // Queues the objects not yet written, then the job that finishes the version
  // (manifest, commit). The single persister runs jobs in order.
  void EnqueueVersionLocked(const std::shared_ptr<VersionState>& v) {
    v->persist_requested = true;
    for (auto& o : v->objects)
      if (!o->written && !o->queued) EnqueueObjectLocked(v, o.get());
    queue_.push_back({v, nullptr});
    cv_.notify_all();
  }

  void ReleaseObjectLocked(ObjectState* o) {
    if (o->in_memory) {
      arena_->Release(o->block);
      o->in_memory = false;
      o->block = {};
    }
  }

  // A version may leave memory when nobody reads it and it is either durable or
  // never going to be persisted; the newest committed version stays unless durable.
  bool EvictableLocked(const VersionState& v, const VersionState* newest) {
    if (!v.committed || v.evicted || v.pins > 0) return false;
    if (v.persist_requested && !v.persisted && !v.failed) return false;
    if (&v == newest && !v.persisted) return false;
    return true;
  }
  const VersionState* NewestCommittedLocked() {
    const VersionState* n = nullptr;
    for (auto& v : versions_)
      if (v->committed && (!n || v->seq > n->seq)) n = v.get();
    return n;
  }
  // With `durable_only`, only versions whose files are persisted qualify: they stay
  // loadable from the store, while a memory-only one would be gone.
  bool EvictOldestLocked(bool durable_only = false) {
    const VersionState* newest = NewestCommittedLocked();
    std::shared_ptr<VersionState> victim;
    for (auto& v : versions_)
      if (EvictableLocked(*v, newest) && (!durable_only || v->persisted) &&
          (!victim || v->seq < victim->seq))
        victim = v;
    if (!victim) return false;
    EvictLocked(victim);
    return true;
  }
  void EvictLocked(const std::shared_ptr<VersionState>& v) {
    for (auto& o : v->objects) ReleaseObjectLocked(o.get());
    v->evicted = true;
    CollectLocked();
  }
  // Forgets versions that left memory and need nothing more from this engine.
  void CollectLocked() {
    versions_.remove_if([](const std::shared_ptr<VersionState>& v) {
      return v->evicted && v->pins == 0 &&
             (!v->persist_requested || v->store_committed || v->failed);
    });
  }
  void ApplyMemoryRetentionLocked() {
    CollectLocked();
    if (opts_.retention == 0) return;
    while (true) {
      size_t held = 0;
      for (auto& v : versions_)
        if (v->committed && !v->evicted) ++held;
      if (held <= opts_.retention || !EvictOldestLocked()) return;
    }
  }

  Result<ArenaBlock> ReserveForImage(uint64_t size) {
    if (size > arena_->capacity()) {
      return Status::ResourceExhausted("a data file of " + std::to_string(size) +
                                       " bytes exceeds the memory budget of " +
                                       std::to_string(arena_->capacity()) + " bytes");
    }
    auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(opts_.reserve_timeout_seconds));
    while (true) {
      // Memory already resident first, then memory of versions already persisted, and
      // only then new memory: the arena grows only when the state needs it. Versions
      // kept in memory only leave when the budget is full.
      auto b = arena_->TryReserve(size, /*grow=*/false);
      if (b.ok()) return b;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (EvictOldestLocked(/*durable_only=*/true)) continue;
      }
      b = arena_->TryReserve(size);
      if (b.ok()) return b;
      bool wait;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (EvictOldestLocked()) continue;
        // Space will come back when the persister finishes or a reader unpins.
        wait = !queue_.empty() || busy_;
        for (auto& v : versions_)
          if (v->pins > 0 || (v->persist_requested && !v->persisted && !v->failed)) wait = true;
      }
      if (!wait || Clock::now() >= deadline) {
        return Status::ResourceExhausted(
            "the memory budget of " + std::to_string(arena_->capacity()) + " bytes cannot hold " +
            std::to_string(size) + " more bytes (" + std::to_string(arena_->used()) + " in use)");
      }
      auto w = arena_->Reserve(size, std::chrono::milliseconds(20));
      if (w.ok()) return w;
    }
  }

  // Lays the image out in the arena: local headers (CRC 0 until persisted) and payloads.
  // Copies the records now, except deferred ones, whose spans it returns.
  std::vector<CopySpan> FillImage(ObjectState* o, const std::vector<SourceRecord>& records) {
    uint8_t* image = arena_->base() + o->block.offset;
    const auto& place = o->layout.records();
    std::vector<CopySpan> now, later;
    now.reserve(records.size());
    for (size_t i = 0; i < place.size(); ++i) {
      std::string h = o->layout.LocalHeader(i, 0);
      std::memcpy(image + place[i].header_offset, h.data(), h.size());
      if (place[i].size == 0) continue;
      CopySpan span{image + place[i].data_offset, records[i].data, place[i].size};
      (records[i].deferred ? later : now).push_back(span);
    }
    copy_.Copy(now);
    return later;
  }

  // Copies deferred records in the background, in the order they were staged.
  void StagerLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      stage_cv_.wait(lock, [&] { return stager_stop_ || !stage_queue_.empty(); });
      if (stage_queue_.empty()) return;
      StageJob job = std::move(stage_queue_.front());
      stage_queue_.pop_front();
      stage_busy_ = true;
      lock.unlock();
      copy_.Copy(job.spans);
      lock.lock();
      stage_busy_ = false;
      job.object->sealed = true;
      --job.version->pins;
      if (job.version->abandoned && !job.object->queued) ReleaseObjectLocked(job.object);
      stage_cv_.notify_all();
      cv_.notify_all();
    }
  }

  void WaitStaged() override {
    std::unique_lock<std::mutex> lock(mu_);
    stage_cv_.wait(lock, [&] { return stage_queue_.empty() && !stage_busy_; });
  }

  void WaitSealedLocked(std::unique_lock<std::mutex>& lock, const ObjectState* o) {
    stage_cv_.wait(lock, [&] { return o->sealed; });
  }

  // Writes an image that does not fit in memory through a bounded window of the arena.
  Status StreamObject(const std::string& tag, const std::string& version, ObjectState* o,
                      const std::vector<SourceRecord>& records) {
    uint64_t window = std::min<uint64_t>(64ull << 20, AlignDown(arena_->capacity() / 2));
    window = std::max<uint64_t>(window, kBlock);
    NEBULITE_ASSIGN_OR_RETURN(ArenaBlock block, ReserveForImage(window));
    struct Releaser {
      Arena* a;
      ArenaBlock b;
      ~Releaser() { a->Release(b); }
    } releaser{arena_.get(), block};
    NEBULITE_ASSIGN_OR_RETURN(
        o->file,
        StreamToFile(storage_.get(), DataFilePath(tag, version, opts_.rank, o->name), o->name,
                     o->layout, records, arena_->base() + block.offset, window, copy_));
    o->streamed = true;
    return Status::OK();
  }

  Status PersistObject(const VersionState& v, ObjectState* o, double* seconds) {
    auto t0 = Clock::now();
    uint8_t* image = arena_->base() + o->block.offset;
    const auto& place = o->layout.records();
    std::string path = DataFilePath(v.tag, v.version, opts_.rank, o->name);
    NEBULITE_ASSIGN_OR_RETURN(auto file, storage_->NewWritableFile(path, o->layout.file_size()));
    uint64_t end = o->layout.tail_offset();
    size_t nchunks = (end + kChunk - 1) / kChunk;
    // Per chunk, the CRC of each record's bytes inside it.
    struct Piece {
      size_t record;
      uint64_t len;
      uint32_t crc;
    };
    std::vector<std::vector<Piece>> pieces(nchunks);
    std::vector<Status> chunk_status(nchunks);
    io_.ParallelFor(nchunks, [&](size_t c) {
      uint64_t c0 = c * kChunk, c1 = std::min(end, c0 + kChunk);
      auto it = std::upper_bound(place.begin(), place.end(), c0,
                                 [](uint64_t off, const format::RecordPlacement& p) {
                                   return off < p.data_offset + p.size;
                                 });
      for (size_t i = it - place.begin(); i < place.size() && place[i].data_offset < c1; ++i) {
        uint64_t p0 = std::max(c0, place[i].data_offset),
                 p1 = std::min(c1, place[i].data_offset + place[i].size);
        if (p0 < p1) pieces[c].push_back({i, p1 - p0, Crc32(0, image + p0, p1 - p0)});
      }
      chunk_status[c] = file->WriteAt(c0, image + c0, c1 - c0);
    });
    for (auto& s : chunk_status) NEBULITE_RETURN_IF_ERROR(s);
    std::vector<uint32_t> crcs(place.size(), 0);
    for (auto& chunk : pieces)
      for (auto& p : chunk) crcs[p.record] = Crc32Combine(crcs[p.record], p.crc, p.len);
    // Patch the headers and rewrite the blocks that hold them.
    uint64_t last_written_end = 0;
    for (size_t i = 0; i < place.size(); ++i) {
      std::string h = o->layout.LocalHeader(i, crcs[i]);
      std::memcpy(image + place[i].header_offset, h.data(), h.size());
      uint64_t b0 = std::max(AlignDown(place[i].header_offset), last_written_end);
      uint64_t b1 = place[i].data_offset;
      if (b0 < b1) NEBULITE_RETURN_IF_ERROR(file->WriteAt(b0, image + b0, b1 - b0));
      last_written_end = std::max(last_written_end, b1);
    }
    NEBULITE_ASSIGN_OR_RETURN(std::string tail, o->layout.Tail(crcs));
    std::memcpy(image + o->layout.tail_offset(), tail.data(), tail.size());
    NEBULITE_RETURN_IF_ERROR(file->WriteAt(o->layout.tail_offset(), tail.data(), tail.size()));
    NEBULITE_RETURN_IF_ERROR(file->Sync());
    NEBULITE_RETURN_IF_ERROR(file->Close());
    o->file = {o->name, o->layout.file_size(), DataFileCrc(o->layout, crcs, tail)};
    *seconds = Seconds(t0, Clock::now());
    return Status::OK();
  }

  void ReportLocked(Status st) { errors_.push_back(std::move(st)); }

  void PersisterLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return closed_ || !queue_.empty(); });
      if (queue_.empty()) return;  // closed and drained
      Job job = queue_.front();
      queue_.pop_front();
      auto& v = job.version;
      if (v->failed || v->abandoned) {
        if (job.object) {
          job.object->queued = false;
          if (v->abandoned) ReleaseObjectLocked(job.object);
        }
        continue;
      }
      busy_ = true;
      ++v->pins;  // keep the memory while writing it
      if (job.object) WaitSealedLocked(lock, job.object);
      lock.unlock();
      Status st = job.object ? PersistOneObject(*v, job.object) : FinishVersion(v.get());
      lock.lock();
      --v->pins;
      busy_ = false;
      if (job.object) {
        job.object->queued = false;
        if (st.ok()) job.object->written = true;
        if (v->abandoned) ReleaseObjectLocked(job.object);
      }
      if (!st.ok()) {
        v->failed = true;
        v->failure_flushed = false;
        v->error = st;
        ReportLocked(st.WithContext("persisting checkpoint '" + v->tag + "'"));
        history_.Append({v->tag, v->version, job.object ? job.object->name : "", opts_.rank, 0, 0,
                         0, "persistent", "failed: " + st.ToString()});
        // Free the space the partial files hold; they were never visible.
        (void)storage_->DeleteRecursively(VersionDir(v->tag, v->version) + "/rank" +
                                          std::to_string(opts_.rank));
        for (auto& o : v->objects)
          if (!o->streamed) o->written = false;
      } else if (!job.object) {
        v->persisted = true;
        if (opts_.world_size == 1) {
          // Retention runs after the commit is visible; its failure is reported
          // but does not undo the commit. Flush() returns after both.
          lock.unlock();
          Status rs = ApplyStoreRetention();
          lock.lock();
          v->store_committed = true;
          if (!rs.ok()) ReportLocked(rs);
        } else if (opts_.rank == 0) {
          coord_pending_.push_back({v, Clock::now()});
        }
      }
      ApplyMemoryRetentionLocked();
      cv_.notify_all();
    }
  }

  Status PersistOneObject(const VersionState& v, ObjectState* o) {
    if (!o->in_memory)
      return Status::NotFound("'" + o->name + "' left memory before it was persisted");
    double secs = 0;
    Status st = PersistObject(v, o, &secs);
    history_.Append({v.tag, v.version, o->name, opts_.rank, o->bytes, o->blocking_seconds, secs,
                     "persistent", st.ok() ? "persisted" : "failed: " + st.ToString()});
    return st;
  }

  Status FinishVersion(VersionState* v) {
    Manifest m;
    m.tag = v->tag;
    m.version = v->version;
    m.rank = opts_.rank;
    m.world_size = opts_.world_size;
    for (auto& o : v->objects) {
      if (!o->written)
        return Status::Internal("'" + o->name + "' was not written before its manifest");
      if (o->streamed)
        history_.Append({v->tag, v->version, o->name, opts_.rank, o->bytes, o->blocking_seconds, 0,
                         "persistent", "streamed"});
      m.files.push_back(o->file);
    }
    NEBULITE_RETURN_IF_ERROR(WriteManifest(storage_.get(), m));
    if (opts_.rank == 0 && opts_.world_size == 1) return CommitInStore(v);
    return Status::OK();
  }

  // On a rank other than 0, for a version this rank persisted: true once it is committed in
  // the store. Rank 0's retention may retire it before this rank looks (it deletes the
  // marker first, then the files), so this rank's manifest being gone means it was
  // committed too; between the two deletions the next look decides.
  bool CommittedOrRetired(const VersionState& v) {
    auto marker = storage_->Exists(CommitMarkerPath(v.tag, v.version));
    if (marker.ok() && *marker) return true;
    auto manifest = storage_->Exists(ManifestPath(v.tag, v.version, opts_.rank));
    return manifest.ok() && !*manifest;
  }

  Status ApplyStoreRetention() {
    if (opts_.retention == 0 || opts_.rank != 0) return Status::OK();
    auto removed = ApplyRetention(storage_.get(), opts_.retention);
    if (!removed.ok()) return removed.status().WithContext("retention");
    for (auto& [tag, version] : *removed)
      history_.Append(
          {tag, version, "", opts_.rank, 0, 0, 0, "persistent", "deleted_by_retention"});
    return Status::OK();
  }

  Status CommitInStore(VersionState* v) {
    auto t0 = Clock::now();
    CommitRecord c;
    c.tag = v->tag;
    c.version = v->version;
    c.seq = v->seq;
    c.time_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
    c.world_size = opts_.world_size;
    NEBULITE_RETURN_IF_ERROR(WriteCommitMarker(storage_.get(), c));
    uint64_t total = 0;
    for (auto& o : v->objects) total += o->bytes;
    history_.Append({v->tag, v->version, "", opts_.rank, total, 0, Seconds(t0, Clock::now()),
                     "persistent", "committed"});
    return Status::OK();
  }

  void CoordinatorLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait_for(lock, std::chrono::milliseconds(10));
      if (closed_ && coord_pending_.empty()) return;
      auto pending = coord_pending_;
      lock.unlock();
      for (auto& [v, since] : pending) {
        Status st;
        bool done = false;
        auto all = AllManifestsPresent(storage_.get(), v->tag, v->version, opts_.world_size);
        if (!all.ok()) {
          st = all.status();
        } else if (*all) {
          st = CommitInStore(v.get());
          done = st.ok();
          if (done) {
            Status rs = ApplyStoreRetention();
            if (!rs.ok()) {
              std::lock_guard<std::mutex> l3(mu_);
              ReportLocked(rs);
            }
          }
        } else if (Seconds(since, Clock::now()) > opts_.commit_timeout_seconds) {
          st = Status::Cancelled("not every rank persisted checkpoint '" + v->tag + "' within " +
                                 std::to_string(opts_.commit_timeout_seconds) + " s");
        }
        std::lock_guard<std::mutex> l2(mu_);
        if (done || !st.ok()) {
          coord_pending_.erase(std::remove_if(coord_pending_.begin(), coord_pending_.end(),
                                              [&](auto& p) { return p.first == v; }),
                               coord_pending_.end());
        }
        if (done) v->store_committed = true;
        if (!st.ok()) {
          v->failed = true;
          v->failure_flushed = false;
          v->error = st;
          ReportLocked(st.WithContext("committing checkpoint '" + v->tag + "'"));
        }
        ApplyMemoryRetentionLocked();
      }
      lock.lock();
      cv_.notify_all();
      if (closed_ && coord_pending_.empty()) return;
    }
  }

  friend class LeaseImpl;
  EngineOptions opts_;
  std::shared_ptr<Arena> arena_;
  std::shared_ptr<Storage> storage_;
  CopyEngine copy_;
  CopyEngine io_;  // used as the io thread pool
  HistoryLog history_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::list<std::shared_ptr<VersionState>> versions_;  // GUARDED_BY(mu_)
  struct Job {
    std::shared_ptr<VersionState> version;
    ObjectState* object;  // nullptr: finish the version (manifest, commit)
  };
  std::deque<Job> queue_;  // GUARDED_BY(mu_)
  std::vector<std::pair<std::shared_ptr<VersionState>, Clock::time_point>> coord_pending_;
  std::vector<Status> errors_;  // GUARDED_BY(mu_)
  bool busy_ = false;
  bool closed_ = false;
  struct StageJob {
    std::shared_ptr<VersionState> version;
    ObjectState* object;
    std::vector<CopySpan> spans;
  };
  std::condition_variable stage_cv_;
  std::deque<StageJob> stage_queue_;  // GUARDED_BY(mu_)
  bool stage_busy_ = false, stager_stop_ = false;
  std::thread stager_, persister_, coordinator_;
};

LeaseImpl::~LeaseImpl() { engine_->Unpin(version_.get()); }

}  // namespace

uint64_t DefaultMemoryBytes() {
  struct sysinfo si {};
  uint64_t total = 8ull << 30;
  if (sysinfo(&si) == 0) total = static_cast<uint64_t>(si.totalram) * si.mem_unit;
  uint64_t b = total / 4;
  return std::max<uint64_t>(64ull << 20, b / (2ull << 20) * (2ull << 20));
}

Result<std::unique_ptr<Engine>> Engine::Open(const EngineOptions& options) {
  EngineOptions o = options;
  if (o.world_size == 0 || o.rank >= o.world_size)
    return Status::InvalidArgument("rank " + std::to_string(o.rank) + " is outside world size " +
                                   std::to_string(o.world_size));
  if (o.memory_bytes == 0) o.memory_bytes = DefaultMemoryBytes();
  std::shared_ptr<Storage> storage = o.storage_override;
  if (!storage && !o.persist_root.empty()) {
    NEBULITE_ASSIGN_OR_RETURN(storage, OpenPosixStorage(o.persist_root, o.direct_io));
  }
  std::shared_ptr<Arena> arena = o.arena;
  if (!arena) {
    NEBULITE_ASSIGN_OR_RETURN(arena, Arena::Create(o.memory_bytes, o.prefault));
  }
  return std::unique_ptr<Engine>(
      new EngineImpl(std::move(o), std::move(arena), std::move(storage)));
}

}  // namespace nebulite

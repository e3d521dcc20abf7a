// The engine of one rank: staging into the arena, and the API over the version table,
// the stager, the persister and the commit coordinator (persist/*.h). See
// nebulite/engine.h for the lifecycle and the thread-safety contract.
#include "nebulite/engine.h"

#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "nebulite/data_file_writer.h"
#include "persist/background_thread.h"
#include "persist/commit_coordinator.h"
#include "persist/engine_core.h"
#include "persist/persister.h"
#include "persist/stager.h"

namespace nebulite {

EngineCore::EngineCore(EngineOptions o, std::shared_ptr<Arena> a, std::shared_ptr<Storage> s)
    : opts(std::move(o)),
      arena(std::move(a)),
      storage(std::move(s)),
      history(storage && opts.write_history ? storage : nullptr),
      copy(opts.copy_threads),
      io(opts.io_threads > 0 ? opts.io_threads : 4),
      checker(storage.get()),
      versions(arena.get(), opts.retention) {}

EngineCore::~EngineCore() = default;

namespace {

constexpr uint64_t kBlock = 4096;
constexpr uint64_t kStreamWindow = 64ull << 20;  // see ReserveWindow()

int64_t NowUnixNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

class EngineImpl;

class LeaseImpl : public ObjectLease {
 public:
  LeaseImpl(std::shared_ptr<EngineCore> core, std::shared_ptr<VersionState> v, const uint8_t* data,
            const std::vector<RecordRef>* refs)
      : core_(std::move(core)), version_(std::move(v)), data_(data), refs_(refs) {}
  ~LeaseImpl() override {
    std::lock_guard<std::mutex> lock(core_->mu);
    --version_->pins;
    core_->versions.ApplyRetention();
    core_->changed.notify_all();
  }
  const uint8_t* data() const override { return data_; }
  const std::vector<RecordRef>& records() const override { return *refs_; }

 private:
  std::shared_ptr<EngineCore> core_;
  std::shared_ptr<VersionState> version_;
  const uint8_t* data_;
  const std::vector<RecordRef>* refs_;
};

class EngineImpl : public Engine {
 public:
  explicit EngineImpl(std::shared_ptr<EngineCore> core)
      : core_(std::move(core)), owner_(getpid()) {
    EngineCore& c = *core_;
    c.stager = std::make_unique<Stager>(&c);
    c.stager->Start(core_);
    if (c.storage) {
      c.persister = std::make_unique<Persister>(&c);
      c.persister->Start(core_);
      if (c.opts.rank == 0) {
        c.coordinator = std::make_unique<CommitCoordinator>(&c);
        if (c.opts.world_size > 1) c.coordinator->Start(core_);
      }
    }
    // Another engine of the node, short of memory, may take that of this engine's
    // versions already persisted (as this engine's own reservations would).
    room_maker_ = c.arena->AddRoomMaker([weak = std::weak_ptr<EngineCore>(core_)] {
      auto core = weak.lock();
      if (!core) return false;
      std::lock_guard<std::mutex> lock(core->mu);
      return core->versions.EvictOldest(/*durable_only=*/true);
    });
  }

  ~EngineImpl() override {
    if (getpid() != owner_) {
      // A forked child holds a copy of the engine without its threads, and with the
      // state they left in its mutexes and condition variables at the fork: closing it
      // would wait for them forever. It is never closed or destroyed there.
      new std::shared_ptr<EngineCore>(std::move(core_));
      return;
    }
    (void)Close(60);
    core_->arena->RemoveRoomMaker(room_maker_);
  }

  // -- staging ------------------------------------------------------------------------

  // Checks the names, plans the data file and finds the (uncommitted) version.
  Result<std::unique_ptr<ObjectState>> PlanObject(const std::string& tag,
                                                  const std::string& version,
                                                  const std::string& name,
                                                  const std::vector<format::RecordSpec>& specs,
                                                  std::shared_ptr<VersionState>* v) {
    NEBULITE_RETURN_IF_ERROR(ValidateTag(tag));
    NEBULITE_RETURN_IF_ERROR(ValidateVersionName(version));
    NEBULITE_RETURN_IF_ERROR(ValidatePathComponent(name, "name"));
    NEBULITE_ASSIGN_OR_RETURN(auto layout, format::ArchiveLayout::Plan(specs));
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      if (core_->closing) return Status::FailedPrecondition("the engine is closed");
      *v = core_->versions.GetOrCreate(tag, version);
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
    obj->crcs.assign(layout.records().size(), 0);
    obj->layout = std::move(layout);
    return obj;
  }

  // Admits a staged or reserved object into its version, unless the version was abandoned
  // or committed, or an object of that name was added, while it was being copied (the lock
  // is not held meanwhile); then its memory goes back.
  Status AdmitLocked(VersionState& v, ObjectState* obj) {
    Status st;
    if (v.abandoned || v.committed) {
      st = Status::FailedPrecondition("checkpoint '" + v.tag +
                                      "' was abandoned or committed while '" + obj->name +
                                      "' was being saved");
    } else if (v.Find(obj->name) != nullptr) {
      st = Status::AlreadyExists("'" + obj->name + "' was already saved in checkpoint '" + v.tag +
                                 "'");
    }
    if (!st.ok()) core_->versions.Release(obj);
    return st;
  }

  // Forgets a version that a failed Stage() created and left empty.
  void DropIfEmpty(const std::shared_ptr<VersionState>& v) {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (!v->committed && v->objects.empty() && !v->store_touched) core_->versions.Remove(v);
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
    Result<StageInfo> info = StageObject(v, std::move(obj), records, persist_now, t0);
    if (!info.ok()) DropIfEmpty(v);
    return info;
  }

  Result<StageInfo> StageObject(const std::shared_ptr<VersionState>& v,
                                std::unique_ptr<ObjectState> obj,
                                const std::vector<SourceRecord>& records, bool persist_now,
                                Clock::time_point t0) {
    std::vector<CopySpan> later;
    std::vector<size_t> later_records;
    auto block = ReserveForImage(obj->layout.file_size());
    if (block.ok()) {
      obj->block = *block;
      obj->in_memory = true;
      // Headers go in with CRC 0; FinishImage() rewrites them once every CRC is known.
      uint8_t* image = core_->arena->base() + obj->block.offset;
      const auto& place = obj->layout.records();
      std::vector<CopySpan> now;
      std::vector<size_t> now_records;
      for (size_t i = 0; i < place.size(); ++i) {
        std::string h = obj->layout.LocalHeader(i, 0);
        std::memcpy(image + place[i].header_offset, h.data(), h.size());
        if (place[i].size == 0) continue;
        CopySpan span{image + place[i].data_offset, records[i].data, place[i].size};
        if (records[i].deferred) {
          later.push_back(span);
          later_records.push_back(i);
        } else {
          now.push_back(span);
          now_records.push_back(i);
        }
      }
      std::vector<uint32_t> crcs;
      core_->copy.CopyWithCrc(now, &crcs);
      for (size_t k = 0; k < now_records.size(); ++k) obj->crcs[now_records[k]] = crcs[k];
      if (later.empty()) {
        NEBULITE_ASSIGN_OR_RETURN(uint32_t file_crc, FinishImage(obj->layout, image, obj->crcs));
        obj->file = {obj->name, obj->bytes, file_crc};
      }
    } else if (block.status().code() == StatusCode::kResourceExhausted && core_->storage) {
      NEBULITE_RETURN_IF_ERROR(StreamObject(v, obj.get(), records));
    } else {
      return block.status().WithContext(
          core_->storage ? "staging '" + obj->name + "'"
                         : "staging '" + obj->name +
                               "' (no persistent path is set, so a state must fit "
                               "in the memory budget NEBULA_MEMORY_BUFFER_SIZE)");
    }
    obj->blocking_seconds = SecondsBetween(t0, Clock::now());
    StageInfo info{obj->bytes, obj->blocking_seconds, obj->streamed, !later.empty()};
    std::lock_guard<std::mutex> lock(core_->mu);
    NEBULITE_RETURN_IF_ERROR(AdmitLocked(*v, obj.get()));
    if (obj->streamed) v->must_persist = true;
    ObjectState* o = obj.get();
    v->objects.push_back(std::move(obj));
    if (!later.empty())
      core_->stager->EnqueueLocked(v, o, std::move(later), std::move(later_records));
    // Start writing at once when the version is known to be persisted.
    if (persist_now && core_->persister && !o->written) core_->persister->EnqueueObjectLocked(v, o);
    return info;
  }

  // Writes an image that does not fit in memory through a bounded window of the arena.
  Status StreamObject(const std::shared_ptr<VersionState>& v, ObjectState* o,
                      const std::vector<SourceRecord>& records) {
    NEBULITE_RETURN_IF_ERROR(core_->persister->CheckNotCommittedInStore(v));
    NEBULITE_ASSIGN_OR_RETURN(ArenaBlock block, ReserveWindow());
    const uint64_t window = block.size;
    struct Releaser {
      Arena* a;
      ArenaBlock b;
      ~Releaser() { a->Release(b); }
    } releaser{core_->arena.get(), block};
    std::string tag, version;
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      tag = v->tag;
      version = v->version;
    }
    DataFileWriter writer(core_->storage.get(), &core_->io);
    NEBULITE_ASSIGN_OR_RETURN(
        o->file, writer.WriteStreamed({tag, version, core_->opts.rank, o->name}, o->layout, records,
                                      core_->arena->base() + block.offset, window, core_->copy));
    o->streamed = true;
    o->written = true;
    return Status::OK();
  }

  Result<Reservation> Reserve(const std::string& tag, const std::string& version,
                              const std::string& name,
                              const std::vector<format::RecordSpec>& specs,
                              bool wait_for_memory) override {
    auto t0 = Clock::now();
    std::shared_ptr<VersionState> v;
    NEBULITE_ASSIGN_OR_RETURN(auto obj, PlanObject(tag, version, name, specs, &v));
    auto block = ReserveForImage(obj->layout.file_size(), wait_for_memory);
    if (!block.ok()) {
      DropIfEmpty(v);
      return block.status();
    }
    obj->block = *block;
    obj->in_memory = true;
    uint8_t* image = core_->arena->base() + obj->block.offset;
    const auto& place = obj->layout.records();
    for (size_t i = 0; i < place.size(); ++i) {
      std::string h = obj->layout.LocalHeader(i, 0);
      std::memcpy(image + place[i].header_offset, h.data(), h.size());
    }
    Reservation r{obj->block.offset, obj->bytes, obj->refs};
    obj->blocking_seconds = SecondsBetween(t0, Clock::now());
    obj->sealed = false;
    obj->awaiting_writer = true;
    std::lock_guard<std::mutex> lock(core_->mu);
    NEBULITE_RETURN_IF_ERROR(AdmitLocked(*v, obj.get()));
    ++v->pins;  // held until Seal() or Discard()
    v->objects.push_back(std::move(obj));
    return r;
  }

  Status Seal(const std::string& tag, const std::string& version, const std::string& name,
              bool persist_now, const std::vector<uint32_t>& crcs) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    auto v = core_->versions.Find(tag, version);
    ObjectState* o = v ? v->Find(name) : nullptr;
    if (!o || !o->awaiting_writer)
      return Status::NotFound("no reservation of '" + name + "' in '" + tag + "'");
    if (crcs.size() != o->refs.size()) {
      return Status::InvalidArgument("sealing '" + name + "' needs " +
                                     std::to_string(o->refs.size()) + " CRCs, got " +
                                     std::to_string(crcs.size()));
    }
    o->crcs = crcs;
    NEBULITE_ASSIGN_OR_RETURN(
        uint32_t file_crc, FinishImage(o->layout, core_->arena->base() + o->block.offset, o->crcs));
    o->file = {o->name, o->bytes, file_crc};
    o->awaiting_writer = false;
    o->sealed = true;
    --v->pins;
    core_->changed.notify_all();
    if (persist_now && core_->persister) core_->persister->EnqueueObjectLocked(v, o);
    return Status::OK();
  }

  Status Discard(const std::string& tag, const std::string& version,
                 const std::string& name) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    auto v = core_->versions.Find(tag, version);
    ObjectState* o = v ? v->Find(name) : nullptr;
    if (!o || !o->awaiting_writer)
      return Status::NotFound("no reservation of '" + name + "' in '" + tag + "'");
    core_->versions.Release(o);
    --v->pins;
    v->objects.erase(std::find_if(v->objects.begin(), v->objects.end(),
                                  [&](const auto& p) { return p.get() == o; }));
    core_->changed.notify_all();
    return Status::OK();
  }

  Status Adopt(const std::string& tag, const std::string& version,
               const ManifestFile& file) override {
    NEBULITE_RETURN_IF_ERROR(ValidateTag(tag));
    NEBULITE_RETURN_IF_ERROR(ValidateVersionName(version));
    NEBULITE_RETURN_IF_ERROR(ValidatePathComponent(file.name, "name"));
    if (!core_->storage) return Status::FailedPrecondition("no persistent path is set");
    NEBULITE_RETURN_IF_ERROR(VerifyDataFile(
        core_->storage.get(), DataFilePath(tag, version, core_->opts.rank, file.name), file));
    std::lock_guard<std::mutex> lock(core_->mu);
    auto v = core_->versions.GetOrCreate(tag, version);
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
    v->store_touched = true;
    return Status::OK();
  }

  const Arena& arena() const override { return *core_->arena; }

  void WaitStaged() override { core_->stager->WaitIdle(); }

  // -- committing and persisting --------------------------------------------------------

  bool MustPersist(const std::string& tag, const std::string& version) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    auto v = core_->versions.Find(tag, version);
    return v && v->must_persist;
  }

  // Completes the version on this rank. A version kept in memory only has its history rows
  // written by the persister; a persisted version's, with its commit in the store, in one
  // write: committing makes no request to the store.
  Status Commit(const std::string& tag, const std::string& version, uint64_t seq,
                bool persist) override {
    NEBULITE_RETURN_IF_ERROR(ValidateTag(tag));
    NEBULITE_RETURN_IF_ERROR(ValidateVersionName(version));
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->closing) return Status::FailedPrecondition("the engine is closed");
    // A rank that saved nothing still commits.
    auto v = core_->versions.GetOrCreate(tag, version);
    if (v->committed) return Status::OK();
    for (auto& o : v->objects)
      if (o->awaiting_writer)
        return Status::FailedPrecondition("'" + o->name + "' of checkpoint '" + tag +
                                          "' is reserved but not sealed");
    if (v->must_persist && !persist) {
      return Status::FailedPrecondition("checkpoint '" + tag +
                                        "' streamed to storage and must be persisted");
    }
    if (persist && !core_->storage) return Status::FailedPrecondition("no persistent path is set");
    v->committed = true;
    v->seq = seq;
    core_->newest_seq = std::max(core_->newest_seq, seq);
    v->commit_unix_ns = NowUnixNs();
    if (persist) {
      core_->persister->EnqueueVersionLocked(v);
    } else {
      for (auto& o : v->objects)
        core_->history.Append({tag, version, o->name, core_->opts.rank, o->bytes,
                               o->blocking_seconds, 0, "memory", "in_memory"});
      if (core_->persister) core_->persister->WriteHistoryLocked();
    }
    core_->versions.ApplyRetention();
    return Status::OK();
  }

  Status Persist(const std::string& tag, const std::string& version) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    auto v = core_->versions.Find(tag, version);
    if (!v || !v->committed)
      return Status::NotFound("no committed version " + version + " of '" + tag + "' in memory");
    if (!core_->storage) return Status::FailedPrecondition("no persistent path is set");
    if (core_->closing) return Status::FailedPrecondition("the engine is closed");
    if (v->store_committed || (v->persist_requested && !v->failed)) return Status::OK();
    for (auto& o : v->objects)
      if (!o->in_memory && !o->written)
        return Status::NotFound("checkpoint '" + tag +
                                "' was evicted from memory before it was persisted");
    v->failed = false;
    core_->persister->EnqueueVersionLocked(v);
    return Status::OK();
  }

  // On a rank other than 0, for a version this rank persisted: true once it is committed in
  // the store. Rank 0's retention may retire it before this rank looks (it deletes the
  // marker first, then the files), so this rank's manifest being gone means it was
  // committed too; between the two deletions the next look decides.
  bool CommittedOrRetired(const std::string& tag, const std::string& version) {
    Storage* s = core_->storage.get();
    auto marker = s->FileExists(CommitMarkerPath(tag, version));
    if (marker.ok() && *marker) return true;
    auto manifest = s->FileExists(ManifestPath(tag, version, core_->opts.rank));
    return manifest.ok() && !*manifest;
  }

  // Versions that this rank (not rank 0) persisted and then saw committed in the store
  // (CommittedOrRetired): done here, and retention may drop them from memory now.
  void SeenCommittedLocked(const std::vector<std::shared_ptr<VersionState>>& seen) {
    if (seen.empty()) return;
    for (auto& v : seen) v->store_committed = true;
    core_->versions.ApplyRetention();
    core_->changed.notify_all();
  }

  Status Flush(double timeout_seconds) override { return WaitInStore(timeout_seconds, nullptr); }

  Status FlushVersion(const std::string& tag, const std::string& version,
                      double timeout_seconds) override {
    std::shared_ptr<VersionState> v;
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      v = core_->versions.Find(tag, version);
    }
    return v ? WaitInStore(timeout_seconds, v.get()) : Status::OK();
  }

  // Flush(), or with `only` FlushVersion(): waits for every version queued for the store
  // (and for the persister's other work), or for `only`, and reports their failures once.
  Status WaitInStore(double timeout_seconds, const VersionState* only) {
    const auto deadline = DeadlineAfter(timeout_seconds);
    std::unique_lock<std::mutex> lock(core_->mu);
    while (true) {
      bool pending = !only && core_->persister && !core_->persister->IdleLocked();
      std::vector<std::pair<std::shared_ptr<VersionState>, std::pair<std::string, std::string>>>
          awaiting;
      for (auto& v : core_->versions.all()) {
        if ((only && v.get() != only) || !v->PendingInStore()) continue;
        if (!v->persisted)
          pending = true;
        else
          awaiting.push_back({v, {v->tag, v->version}});
      }
      if (!pending && core_->opts.rank != 0 && !awaiting.empty()) {
        // Other ranks learn of commits by seeing the marker. (Rank 0 may give up on a
        // version after the commit timeout: this rank then waits until its own deadline,
        // since nothing in the store says so, and rank 0 may be slower than this one.)
        lock.unlock();
        std::vector<std::shared_ptr<VersionState>> seen;
        for (auto& [v, name] : awaiting)
          if (CommittedOrRetired(name.first, name.second)) seen.push_back(v);
        lock.lock();
        SeenCommittedLocked(seen);
        awaiting.erase(std::remove_if(awaiting.begin(), awaiting.end(),
                                      [](auto& a) { return !a.first->PendingInStore(); }),
                       awaiting.end());
      }
      if (!pending && awaiting.empty()) break;
      const auto now = Clock::now();
      if (now >= deadline)
        return Status::Cancelled("flush timed out with checkpoints still being persisted");
      core_->changed.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(10)));
    }
    Status result;
    for (auto& v : core_->versions.all()) {
      if (only && v.get() != only) continue;
      if (v->failed && !v->failure_flushed) {
        v->failure_flushed = true;
        if (result.ok())
          result = Status::IOError("persisting checkpoint '" + v->tag +
                                   "' failed: " + v->error.ToString());
      }
    }
    return result;
  }

  Result<bool> GiveUpCommit(const std::string& tag, const std::string& version) override {
    std::shared_ptr<VersionState> v;
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      v = core_->versions.Find(tag, version);
      if (core_->opts.rank == 0 || !v || !v->persisted || !v->PendingInStore()) return false;
    }
    if (CommittedOrRetired(tag, version)) {
      std::lock_guard<std::mutex> lock(core_->mu);
      SeenCommittedLocked({v});
      return false;
    }
    core_->persister->Fail(v, Status::Cancelled("rank 0 did not commit it; this rank stopped "
                                                "waiting"),
                           "waiting for the commit of", "", /*caller_reports=*/true);
    return true;
  }

  void Abandon(const std::string& tag, const std::string& version) override {
    std::lock_guard<std::mutex> lock(core_->mu);
    auto v = core_->versions.Find(tag, version);
    if (!v || v->committed) return;
    v->abandoned = true;  // queued jobs skip it and release what they hold
    for (auto& o : v->objects) {
      if (o->awaiting_writer) {  // its writer will never seal it now
        o->awaiting_writer = false;
        --v->pins;
        core_->versions.Release(o.get());
      } else if (!o->queued && o->sealed) {
        core_->versions.Release(o.get());
      }
    }
    // What it wrote to the store goes too, after the jobs of it still queued.
    if (core_->persister && (v->store_touched || core_->persister->HasJobsLocked(v.get())))
      core_->persister->EnqueueCleanupLocked(v);
    core_->versions.Remove(v);
    core_->changed.notify_all();
  }

  Status RenameVersion(const std::string& tag, const std::string& from,
                       const std::string& to) override {
    NEBULITE_RETURN_IF_ERROR(ValidateTag(tag));
    NEBULITE_RETURN_IF_ERROR(ValidateVersionName(from));
    NEBULITE_RETURN_IF_ERROR(ValidateVersionName(to));
    if (from == to) return Status::OK();
    std::unique_lock<std::mutex> lock(core_->mu);
    auto v = core_->versions.Find(tag, from);
    if (!v) return Status::OK();  // nothing of it here
    if (v->committed)
      return Status::FailedPrecondition("version " + from + " of '" + tag + "' is committed");
    if (core_->versions.Find(tag, to))
      return Status::AlreadyExists("version " + to + " of '" + tag + "' exists already");
    // Nothing of it may be on its way to the store under the old name, and the clean-up
    // of an abandoned version of the new name must be done.
    core_->changed.wait(lock, [&] {
      return !core_->persister || (!core_->persister->HasJobsLocked(v.get()) &&
                                   !core_->persister->HasJobsLocked(tag, to));
    });
    if (v->store_touched) {
      lock.unlock();
      Storage* s = core_->storage.get();
      Status st = s->CreateDirs(VersionDir(tag, to));
      if (st.ok()) {
        auto exists = s->Exists(RankDir(tag, from, core_->opts.rank));
        st = exists.status();
        if (st.ok() && *exists)
          st = s->Rename(RankDir(tag, from, core_->opts.rank), RankDir(tag, to, core_->opts.rank));
      }
      if (st.ok()) (void)s->RemoveDirIfEmpty(VersionDir(tag, from));
      lock.lock();
      NEBULITE_RETURN_IF_ERROR(st.WithContext("renaming version " + from + " of '" + tag + "'"));
    }
    v->version = to;
    return Status::OK();
  }

  // -- reading --------------------------------------------------------------------------

  uint64_t NewestSeq() override {
    std::lock_guard<std::mutex> lock(core_->mu);
    return core_->newest_seq;
  }

  std::vector<VersionInfo> Versions() override {
    std::lock_guard<std::mutex> lock(core_->mu);
    std::vector<VersionInfo> out;
    for (auto& v : core_->versions.all()) {
      if (!v->committed) continue;
      VersionInfo i;
      i.tag = v->tag;
      i.version = v->version;
      i.seq = v->seq;
      i.commit_unix_ns = v->commit_unix_ns;
      i.in_memory = !v->evicted;
      i.loadable = !v->evicted;
      for (auto& o : v->objects) {
        if (!o->in_memory) i.in_memory = false;
        if (o->streamed)
          i.streamed.push_back(o->file);
        else if (!o->in_memory)
          i.loadable = false;
        i.names.push_back(o->name);
      }
      i.persist_requested = v->persist_requested;
      i.persisted = v->persisted;
      i.failed = v->failed;
      i.store_committed = v->store_committed;
      out.push_back(std::move(i));
    }
    std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.seq < b.seq; });
    return out;
  }

  Result<std::shared_ptr<ObjectLease>> Pin(const std::string& tag, const std::string& version,
                                           const std::string& name) override {
    std::unique_lock<std::mutex> lock(core_->mu);
    auto v = core_->versions.Find(tag, version);
    if (!v || !v->committed)
      return Status::NotFound("version " + version + " of '" + tag + "' is not in memory");
    ObjectState* o = v->Find(name);
    if (!o) return Status::NotFound("'" + name + "' is not in checkpoint '" + tag + "'");
    if (!o->in_memory) return Status::NotFound("'" + name + "' of '" + tag + "' is not in memory");
    ++v->pins;
    // A committed version's objects are never discarded: waiting for a deferred copy is safe.
    core_->changed.wait(lock, [&] { return o->sealed; });
    return std::shared_ptr<ObjectLease>(
        new LeaseImpl(core_, v, core_->arena->base() + o->block.offset, &o->refs));
  }

  std::vector<Status> TakeErrors() override {
    std::lock_guard<std::mutex> lock(core_->mu);
    std::vector<Status> out;
    out.swap(core_->errors);
    return out;
  }
  std::vector<HistoryRow> History() override { return core_->history.Rows(); }
  Storage* storage() override { return core_->storage.get(); }
  uint64_t memory_capacity() const override { return core_->arena->capacity(); }
  uint64_t memory_used() const override { return core_->arena->used(); }
  uint64_t memory_resident() const override { return core_->arena->resident(); }
  uint64_t memory_reclaimable() const override {
    std::lock_guard<std::mutex> lock(core_->mu);
    return core_->versions.Reclaimable();
  }
  void WaitPrefaulted() override { core_->arena->WaitPrefaulted(); }

  Status Close(double timeout_seconds) override {
    const auto deadline = DeadlineAfter(timeout_seconds);
    if (closed_.exchange(true)) return Status::OK();
    Status st;
    if (core_->storage) st = Flush(std::max(0.0, SecondsBetween(Clock::now(), deadline)));
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      core_->closing = true;
    }
    core_->stager->Stop(deadline);
    if (core_->persister) core_->persister->Stop(deadline);
    if (core_->coordinator) core_->coordinator->Stop(deadline);
    core_->history.Flush();
    return st;
  }

 private:
  // The window a streamed object goes through: kStreamWindow, or half the budget when
  // that is less, or, when other objects hold the memory (earlier objects of the same
  // checkpoint, say), the largest power-of-two fraction of it that is free now, down to
  // one block. Only that last block waits for memory (as any reservation does).
  Result<ArenaBlock> ReserveWindow() {
    uint64_t size = std::min<uint64_t>(kStreamWindow, core_->arena->capacity() / 2);
    size = std::max<uint64_t>(size / kBlock * kBlock, kBlock);
    for (; size > kBlock; size = size / 2 / kBlock * kBlock) {
      auto b = ReserveForImage(size, /*wait=*/false);
      if (b.ok() || b.status().code() != StatusCode::kResourceExhausted) return b;
    }
    return ReserveForImage(kBlock);
  }

  // Reserves `size` bytes for an image, evicting what may leave memory. With `wait`, and
  // while memory is on its way back (persisting, unpinning, copying), waits for it up to
  // the reserve timeout; else fails with ResourceExhausted at once.
  Result<ArenaBlock> ReserveForImage(uint64_t size, bool wait_for_memory = true) {
    Arena* arena = core_->arena.get();
    if (size > arena->capacity()) {
      return Status::ResourceExhausted("a data file of " + std::to_string(size) +
                                       " bytes exceeds the memory budget of " +
                                       std::to_string(arena->capacity()) + " bytes");
    }
    const auto deadline = DeadlineAfter(core_->opts.reserve_timeout_seconds);
    while (true) {
      // Memory already resident first, then memory of versions already persisted, and
      // only then new memory: the arena grows only when the state needs it. Versions
      // kept in memory only leave when the budget is full.
      auto b = arena->TryReserve(size, /*grow=*/false);
      if (b.ok()) return b;
      {
        std::lock_guard<std::mutex> lock(core_->mu);
        if (core_->versions.EvictOldest(/*durable_only=*/true)) continue;
      }
      b = arena->TryReserve(size);
      if (b.ok()) return b;
      // The node's other engines give back their persisted versions' memory before this
      // one lets go of versions held in memory only.
      if (arena->MakeRoom(room_maker_)) continue;
      bool wait;
      {
        std::lock_guard<std::mutex> lock(core_->mu);
        if (core_->versions.EvictOldest(false)) continue;
        // Space will come back when the persister finishes or a reader unpins.
        wait =
            (core_->persister && !core_->persister->IdleLocked()) || !core_->stager->IdleLocked();
        for (auto& v : core_->versions.all())
          if (v->pins > 0 || (v->persist_requested && !v->persisted && !v->failed)) wait = true;
      }
      if (!wait_for_memory || !wait || Clock::now() >= deadline) {
        return Status::ResourceExhausted(
            "the memory budget of " + std::to_string(arena->capacity()) + " bytes cannot hold " +
            std::to_string(size) + " more bytes (" + std::to_string(arena->used()) + " in use)");
      }
      auto w = arena->Reserve(size, std::chrono::milliseconds(20));
      if (w.ok()) return w;
    }
  }

  std::shared_ptr<EngineCore> core_;
  const pid_t owner_;  // the process that opened it
  uint64_t room_maker_ = 0;  // its id in the arena (see Arena::AddRoomMaker)
  std::atomic<bool> closed_{false};
};

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
  if (o.copy_threads < 0 || o.copy_threads > kMaxThreads || o.io_threads < 0 ||
      o.io_threads > kMaxThreads) {
    return Status::InvalidArgument("copy_threads and io_threads must be between 0 and " +
                                   std::to_string(kMaxThreads));
  }
  if (!(o.commit_timeout_seconds >= 0) || !(o.reserve_timeout_seconds >= 0)) {
    return Status::InvalidArgument("timeouts must be non-negative numbers");
  }
  if (reinterpret_cast<uintptr_t>(o.error_count) %
          std::atomic_ref<uint64_t>::required_alignment !=
      0) {
    return Status::InvalidArgument("error_count must be 8-byte aligned");
  }
  if (o.memory_bytes == 0) o.memory_bytes = DefaultMemoryBytes();
  std::shared_ptr<Storage> storage = o.storage_override;
  if (!storage && !o.persist_root.empty()) {
    NEBULITE_ASSIGN_OR_RETURN(
        storage, OpenPosixStorage(o.persist_root,
                                  PosixOptions{o.direct_io, /*read_only=*/false, o.file_mode}));
  }
  std::shared_ptr<Arena> arena = o.arena;
  if (!arena) {
    NEBULITE_ASSIGN_OR_RETURN(arena, Arena::Create(o.memory_bytes, o.prefault));
  }
  auto core = std::make_shared<EngineCore>(std::move(o), std::move(arena), std::move(storage));
  return std::unique_ptr<Engine>(new EngineImpl(std::move(core)));
}

}  // namespace nebulite

#include "persist/persister.h"

#include "nebulite/data_file_writer.h"
#include "nebulite/runs.h"
#include "persist/commit_coordinator.h"

namespace nebulite {

void Persister::EnqueueObjectLocked(const std::shared_ptr<VersionState>& v, ObjectState* o) {
  o->queued = true;
  queue_.push_back({Kind::kObject, v, o});
  core_->changed.notify_all();
}

void Persister::EnqueueVersionLocked(const std::shared_ptr<VersionState>& v) {
  v->persist_requested = true;
  for (auto& o : v->objects)
    if (!o->written && !o->queued) EnqueueObjectLocked(v, o.get());
  queue_.push_back({Kind::kFinish, v, nullptr});
  core_->changed.notify_all();
}

void Persister::EnqueueCleanupLocked(const std::shared_ptr<VersionState>& v) {
  queue_.push_back({Kind::kCleanup, v, nullptr});
  core_->changed.notify_all();
}

void Persister::WriteHistoryLocked() {
  history_due_ = true;
  core_->changed.notify_all();
}

bool Persister::HasJobsLocked(const VersionState* v) const {
  if (running_ == v) return true;
  for (const Job& j : queue_)
    if (j.version.get() == v) return true;
  return false;
}

bool Persister::HasJobsLocked(const std::string& tag, const std::string& version) const {
  if (running_ && running_->tag == tag && running_->version == version) return true;
  for (const Job& j : queue_)
    if (j.version->tag == tag && j.version->version == version) return true;
  return false;
}

Status Persister::CheckNotCommittedInStore(const std::shared_ptr<VersionState>& v) {
  std::string tag, version;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (v->store_touched) return Status::OK();
    tag = v->tag;
    version = v->version;
  }
  NEBULITE_ASSIGN_OR_RETURN(bool committed, core_->storage->FileExists(CommitMarkerPath(tag, version)));
  if (committed) {
    return Status::FailedPrecondition(
        "version " + version + " of checkpoint '" + tag +
        "' is already committed in the store (two runs with the same run id?); it is never "
        "overwritten");
  }
  std::lock_guard<std::mutex> lock(core_->mu);
  v->store_touched = true;
  return Status::OK();
}

void Persister::Fail(const std::shared_ptr<VersionState>& v, const Status& st,
                     const std::string& doing, const std::string& object,
                     bool caller_reports) {
  std::vector<std::string> doomed;
  HistoryRow row;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    v->failed = true;
    v->failure_flushed = caller_reports;
    v->error = st;
    if (!caller_reports)
      core_->ReportLocked(st.WithContext(doing + " checkpoint '" + v->tag + "'"));
    row = {v->tag, v->version, object,       core_->opts.rank,          0,
           0,      0,          "persistent", "failed: " + st.ToString()};
    if (!v->manifest_attempted) {
      for (auto& o : v->objects) {
        if (o->written && !o->streamed) {
          doomed.push_back(DataFilePath(v->tag, v->version, core_->opts.rank, o->name));
          o->written = false;
        }
      }
    }
    core_->changed.notify_all();
  }
  core_->history.Append(row);
  core_->history.Flush();
  for (const std::string& path : doomed) (void)core_->storage->Delete(path);
}

void Persister::Loop() {
  std::unique_lock<std::mutex> lock(core_->mu);
  while (true) {
    core_->changed.wait(lock, [&] { return stop_ || history_due_ || !queue_.empty(); });
    if (history_due_) {
      history_due_ = false;
      busy_ = true;
      lock.unlock();
      core_->history.Flush();
      lock.lock();
      busy_ = false;
      core_->changed.notify_all();
      continue;
    }
    if (queue_.empty()) return;  // stopped and drained
    Job job = std::move(queue_.front());
    queue_.pop_front();
    const std::shared_ptr<VersionState>& v = job.version;
    ObjectState* o = job.object;
    if (job.kind == Kind::kCleanup) {
      running_ = v.get();
      busy_ = true;
      lock.unlock();
      Status st =
          RemoveAbandonedRankFiles(core_->storage.get(), v->tag, v->version, core_->opts.rank);
      lock.lock();
      if (!st.ok())
        core_->ReportLocked(st.WithContext("removing abandoned checkpoint '" + v->tag + "'"));
      running_ = nullptr;
      busy_ = false;
      core_->changed.notify_all();
      continue;
    }
    // Skipped: a failed or abandoned version, and, when stopping, writes of versions that
    // were never committed.
    if (v->failed || v->abandoned || (stop_ && !v->committed)) {
      if (o) {
        o->queued = false;
        if (v->abandoned) core_->versions.Release(o);
      }
      core_->changed.notify_all();
      continue;
    }
    running_ = v.get();
    busy_ = true;
    ++v->pins;  // keep the memory while writing it
    if (o) core_->changed.wait(lock, [&] { return o->sealed; });
    lock.unlock();
    Status st = o ? WriteObject(v, o) : Finish(v);
    lock.lock();
    --v->pins;
    running_ = nullptr;
    busy_ = false;
    if (o) {
      o->queued = false;
      if (v->abandoned) core_->versions.Release(o);
    }
    if (!st.ok()) {
      const std::string doing = !o && v->persisted ? "committing" : "persisting";
      const std::string object = o ? o->name : "";
      lock.unlock();
      Fail(v, st, doing, object);
      lock.lock();
    }
    core_->versions.ApplyRetention();
    core_->changed.notify_all();
  }
}

Status Persister::WriteObject(const std::shared_ptr<VersionState>& v, ObjectState* o) {
  if (!o->in_memory) {
    return Status::NotFound("'" + o->name + "' left memory before it was persisted");
  }
  NEBULITE_RETURN_IF_ERROR(CheckNotCommittedInStore(v));
  const auto t0 = Clock::now();
  DataFileWriter writer(core_->storage.get(), &core_->io);
  Result<ManifestFile> file =
      writer.WriteImage({v->tag, v->version, core_->opts.rank, o->name}, o->layout,
                        core_->arena->base() + o->block.offset, o->crcs);
  const double seconds = SecondsBetween(t0, Clock::now());
  if (!file.ok()) return file.status();
  HistoryRow row;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    o->file = *file;
    o->written = true;
    row = {v->tag,  v->version,   o->name,    core_->opts.rank, o->bytes, o->blocking_seconds,
           seconds, "persistent", "persisted"};
  }
  core_->history.Append(row);
  return Status::OK();
}

Status Persister::Finish(const std::shared_ptr<VersionState>& v) {
  NEBULITE_RETURN_IF_ERROR(CheckNotCommittedInStore(v));
  Manifest m;
  std::vector<HistoryRow> rows;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    m.tag = v->tag;
    m.version = v->version;
    m.rank = core_->opts.rank;
    m.world_size = core_->opts.world_size;
    for (auto& o : v->objects) {
      if (!o->written) {
        return Status::Internal("'" + o->name + "' was not written before its manifest");
      }
      if (o->streamed) {
        rows.push_back({v->tag, v->version, o->name, core_->opts.rank, o->bytes,
                        o->blocking_seconds, 0, "persistent", "streamed"});
      }
      m.files.push_back(o->file);
    }
    v->manifest_attempted = true;  // from here on, its files may be named by a manifest
  }
  for (const HistoryRow& r : rows) core_->history.Append(r);
  NEBULITE_RETURN_IF_ERROR(WriteManifest(core_->storage.get(), m));
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    v->persisted = true;
    v->manifest_written = EncodeManifest(m);
    if (core_->opts.world_size > 1) {
      if (core_->coordinator) core_->coordinator->AddLocked(v);
    }
  }
  if (core_->opts.world_size > 1) {
    core_->history.Flush();  // this rank's rows; the coordinator writes the commit's
    return Status::OK();
  }
  return core_->coordinator->CommitNow(v);
}

}  // namespace nebulite

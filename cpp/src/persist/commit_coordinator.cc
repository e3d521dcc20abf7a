#include "persist/commit_coordinator.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <string>

#include "persist/persister.h"

namespace nebulite {

void CommitCoordinator::AddLocked(const std::shared_ptr<VersionState>& v) {
  pending_.emplace_back(v, Clock::now());
  core_->changed.notify_all();
}

Status CommitCoordinator::CommitNow(const std::shared_ptr<VersionState>& v) {
  Storage* storage = core_->storage.get();
  const auto t0 = Clock::now();
  CommitRecord c;
  uint64_t bytes = 0;
  std::map<uint32_t, std::string> written;  // this rank's manifest: not read back
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (!v->manifest_written.empty()) written[core_->opts.rank] = v->manifest_written;
    c.tag = v->tag;
    c.version = v->version;
    c.seq = v->seq;
    c.world_size = core_->opts.world_size;
    for (auto& o : v->objects) bytes += o->bytes;
  }
  NEBULITE_ASSIGN_OR_RETURN(c.seq, ClaimCommitSeq(storage, c.seq));
  c.time_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  NEBULITE_RETURN_IF_ERROR(WriteCommitMarker(storage, c, written));
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    v->seq = c.seq;  // the store's order from now on
    core_->newest_seq = std::max(core_->newest_seq, c.seq);
  }
  core_->history.Append({c.tag, c.version, "", core_->opts.rank, bytes, 0,
                         SecondsBetween(t0, Clock::now()), "persistent", "committed"});
  Status retention;
  if (core_->opts.retention > 0) {
    auto r = ApplyRetention(storage, core_->opts.retention, &core_->checker, c.tag, c.version);
    if (r.ok()) {
      for (auto& [tag, version] : r->deleted)
        core_->history.Append(
            {tag, version, "", core_->opts.rank, 0, 0, 0, "persistent", "deleted_by_retention"});
    } else {
      retention = r.status();
    }
  }
  core_->history.Flush();  // the version's rows, in one write
  std::lock_guard<std::mutex> lock(core_->mu);
  if (!retention.ok()) core_->ReportLocked(retention.WithContext("retention"));
  v->store_committed = true;
  core_->changed.notify_all();
  return Status::OK();
}

void CommitCoordinator::Loop() {
  std::unique_lock<std::mutex> lock(core_->mu);
  while (true) {
    core_->changed.wait_for(lock, std::chrono::milliseconds(10));
    if (stop_) {
      pending_.clear();
      return;
    }
    if (pending_.empty()) continue;
    auto pending = pending_;
    busy_ = true;
    lock.unlock();
    for (auto& entry : pending) {
      const std::shared_ptr<VersionState>& v = entry.first;
      const Clock::time_point since = entry.second;
      Status st;
      bool done = false;
      auto all =
          AllManifestsPresent(core_->storage.get(), v->tag, v->version, core_->opts.world_size);
      const bool late = SecondsBetween(since, Clock::now()) > core_->opts.commit_timeout_seconds;
      if (all.ok() && *all) {
        st = CommitNow(v);
        done = st.ok();
      } else if (late) {  // a store error is retried until then
        st =
            !all.ok()
                ? all.status()
                : Status::Cancelled("not every rank persisted checkpoint '" + v->tag + "' within " +
                                    std::to_string(core_->opts.commit_timeout_seconds) + " s");
      }
      if (done || !st.ok()) {
        std::lock_guard<std::mutex> l2(core_->mu);
        pending_.erase(
            std::remove_if(pending_.begin(), pending_.end(), [&](auto& p) { return p.first == v; }),
            pending_.end());
      }
      if (!st.ok()) core_->persister->Fail(v, st, "committing");
    }
    lock.lock();
    busy_ = false;
    core_->versions.ApplyRetention();
    core_->changed.notify_all();
  }
}

}  // namespace nebulite

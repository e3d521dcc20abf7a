// Persister: writes the versions of one rank to the store in the background, and owns
// what happens when that fails.
//
// Jobs run one at a time, in the order they were queued, on its thread:
//   object   one data file, from the arena (DataFileWriter::WriteImage; the CRCs computed
//            while writing are checked against those of the staging copy)
//   finish   this rank's manifest (WriteManifest); then, with one rank, the commit
//            (CommitCoordinator::CommitNow); rank 0 of several hands the version to the
//            coordinator; other ranks are done (they learn of the commit from the marker)
//   cleanup  the files of a version this rank abandoned (RemoveAbandonedRankFiles)
// and, between jobs, the history rows held back (WriteHistoryLocked: of a version
// committed in memory only, so that committing never waits for the store).
// The first time a version touches the store, the persister checks that no commit marker
// of that name exists (a reused run id must never overwrite a committed version).
//
// Failure policy, for every job and for the coordinator (Fail() is the one place):
//  - the version is marked failed, its error queued for TakeErrors() (unless the caller
//    reports it), a history row written; jobs of it still queued are skipped;
//  - before this rank's manifest was attempted, no manifest names this rank's files: the
//    data files it wrote from memory (which a retry writes again) are removed to give
//    the space back; streamed and adopted files, which cannot be written again, are kept
//    for a retry, and stay marked written;
//  - once the manifest was attempted it may be published (its rename may have happened
//    even though a later directory sync failed), and with it the files it names: nothing
//    is removed. The coordinator checks that every file every manifest names exists
//    before it writes a marker, so a version is never committed torn;
//  - a commit that failed removes nothing either.
// Persist() after a failure retries: the objects not written are written again, then the
// manifest and the commit.
// Thread-safety: the *Locked methods need the core's mutex; the others take it.
#pragma once

#include <deque>
#include <memory>
#include <string>

#include "persist/background_loop.h"

namespace nebulite {

// Stop() lets it run what remains of committed versions and clean-ups; writes of versions
// not committed are dropped.
class Persister : public BackgroundLoop {
 public:
  explicit Persister(EngineCore* core) : BackgroundLoop(core) {}

  void EnqueueObjectLocked(const std::shared_ptr<VersionState>& v, ObjectState* o);
  // The objects of `v` not written yet, then its finish job.
  void EnqueueVersionLocked(const std::shared_ptr<VersionState>& v);
  void EnqueueCleanupLocked(const std::shared_ptr<VersionState>& v);
  // Asks for the history rows held back to be written (HistoryLog::Flush) on this thread.
  void WriteHistoryLocked();
  bool IdleLocked() const { return queue_.empty() && !busy_ && !history_due_; }
  // True while a job of `v`, or of any version named (tag, version), is queued or running.
  bool HasJobsLocked(const VersionState* v) const;
  bool HasJobsLocked(const std::string& tag, const std::string& version) const;

  // The failure policy (see above). Takes the mutex; never call it with the mutex held.
  // With `caller_reports`, neither TakeErrors() nor Flush() reports the failure.
  void Fail(const std::shared_ptr<VersionState>& v, const Status& st, const std::string& doing,
            const std::string& object = "", bool caller_reports = false);

  // FailedPrecondition if a marker of `v` exists in the store (checked once per version,
  // when it first touches the store). Takes the mutex.
  Status CheckNotCommittedInStore(const std::shared_ptr<VersionState>& v);

 private:
  enum class Kind { kObject, kFinish, kCleanup };
  struct Job {
    Kind kind;
    std::shared_ptr<VersionState> version;
    ObjectState* object = nullptr;
  };
  void Loop() override;
  Status WriteObject(const std::shared_ptr<VersionState>& v, ObjectState* o);
  Status Finish(const std::shared_ptr<VersionState>& v);

  std::deque<Job> queue_;                  // GUARDED_BY(core_->mu)
  const VersionState* running_ = nullptr;  // GUARDED_BY(core_->mu)
  bool busy_ = false;                      // GUARDED_BY(core_->mu)
  bool history_due_ = false;               // GUARDED_BY(core_->mu)
};

}  // namespace nebulite

// Stager: asynchronous staging. Records a caller marked `deferred` are copied into the
// arena after Stage() returned, by this thread, in the order they were staged, with their
// CRCs computed in the same pass; then the object's headers are filled and it is sealed.
// Until then its version is pinned (it cannot leave memory) and persisting it waits.
// Thread-safety: the *Locked methods need the core's mutex; the others take it.
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "nebulite/copy_engine.h"
#include "persist/background_thread.h"
#include "persist/engine_core.h"

namespace nebulite {

class Stager {
 public:
  explicit Stager(EngineCore* core) : core_(core) {}
  void Start(std::shared_ptr<EngineCore> keepalive);
  // Stops after the queued copies, or detaches at `deadline`.
  void Stop(Clock::time_point deadline);

  // Queues the copy of `spans`, which fill records `records` of `o`.
  void EnqueueLocked(std::shared_ptr<VersionState> v, ObjectState* o, std::vector<CopySpan> spans,
                     std::vector<size_t> records);
  bool IdleLocked() const { return queue_.empty() && !busy_; }
  // Waits until every queued copy has landed.
  void WaitIdle();

 private:
  struct Job {
    std::shared_ptr<VersionState> version;
    ObjectState* object;
    std::vector<CopySpan> spans;
    std::vector<size_t> records;
  };
  void Loop();

  EngineCore* const core_;
  std::deque<Job> queue_;  // GUARDED_BY(core_->mu)
  bool busy_ = false;      // GUARDED_BY(core_->mu)
  bool stop_ = false;      // GUARDED_BY(core_->mu)
  BackgroundThread thread_;
};

}  // namespace nebulite

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
#include "persist/background_loop.h"

namespace nebulite {

// Stop() lets it finish the queued copies first.
class Stager : public BackgroundLoop {
 public:
  explicit Stager(EngineCore* core) : BackgroundLoop(core) {}

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
  void Loop() override;

  std::deque<Job> queue_;  // GUARDED_BY(core_->mu)
  bool busy_ = false;      // GUARDED_BY(core_->mu)
};

}  // namespace nebulite

// BackgroundLoop: the shape shared by the engine's background parts (stager, persister,
// commit coordinator): one thread running Loop(), which waits on the core's `changed`
// condition and returns once `stop_` is set (and, as each part defines, its queue drained).
// Thread-safety: `stop_` is guarded by the core's mutex; Start() and Stop() are called by
// the engine only.
#pragma once

#include <memory>
#include <mutex>
#include <utility>

#include "persist/background_thread.h"
#include "persist/engine_core.h"

namespace nebulite {

class BackgroundLoop {
 public:
  virtual ~BackgroundLoop() = default;
  // `keepalive` (the core) stays alive while the thread runs.
  void Start(std::shared_ptr<EngineCore> keepalive) {
    thread_.Start(std::move(keepalive), [this] { Loop(); });
  }
  // Asks the loop to stop and waits for it until `deadline`; then it is left to finish alone.
  void Stop(Clock::time_point deadline) {
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      stop_ = true;
    }
    core_->changed.notify_all();
    thread_.JoinUntil(deadline);
  }

 protected:
  explicit BackgroundLoop(EngineCore* core) : core_(core) {}
  virtual void Loop() = 0;

  EngineCore* const core_;
  bool stop_ = false;  // GUARDED_BY(core_->mu)

 private:
  BackgroundThread thread_;
};

}  // namespace nebulite

// CommitCoordinator: commits a version in the store once every rank persisted it, on
// rank 0 (the only rank that writes commit markers and applies retention).
//
// Committing one version (CommitNow):
//   1. every rank's manifest is present (AllManifestsPresent);
//   2. the commit number is claimed in the store (ClaimCommitSeq): the commit order is
//      decided here, where the marker is written, so it never goes backwards across runs
//      and agents, whatever order they were started in;
//   3. the marker is written (WriteCommitMarker, which first checks that every file every
//      manifest names exists with its size);
//   4. retention keeps the newest versions that pass their check, never this one.
// With one rank the persister calls CommitNow() right after the manifest. With several,
// AddLocked() queues the version and this coordinator's thread polls for the other ranks'
// manifests until the commit timeout, then fails it through the persister's policy.
// Thread-safety: AddLocked() needs the core's mutex; the others take it.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "persist/background_loop.h"

namespace nebulite {

// Its thread runs with several ranks only; Stop() stops waiting for other ranks (pending
// versions stay uncommitted).
class CommitCoordinator : public BackgroundLoop {
 public:
  explicit CommitCoordinator(EngineCore* core) : BackgroundLoop(core) {}

  void AddLocked(const std::shared_ptr<VersionState>& v);
  bool IdleLocked() const { return pending_.empty() && !busy_; }

  // Commits `v` in the store now (steps 2-4; step 1 is the caller's). The failure of the
  // marker is returned; a failure of retention is reported but does not undo the commit.
  Status CommitNow(const std::shared_ptr<VersionState>& v);

 private:
  void Loop() override;

  std::vector<std::pair<std::shared_ptr<VersionState>, Clock::time_point>>
      pending_;        // GUARDED_BY(core_->mu)
  bool busy_ = false;  // GUARDED_BY(core_->mu)
};

}  // namespace nebulite

// EngineCore: what the parts of one engine share (the options, the arena, the store, the
// version table and the mutex guarding it), and the parts themselves: the stager, the
// persister and the commit coordinator. Background threads hold a reference to it, so
// that an engine closed while one of them is stuck in the store (a hung mount) can
// return: the thread finishes alone and the core goes with it.
// Thread-safety: `mu` guards the version table, `errors` and `closing`; everything else
// is immutable after construction or thread-safe itself.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "nebulite/arena.h"
#include "nebulite/commit.h"
#include "nebulite/copy_engine.h"
#include "nebulite/engine.h"
#include "persist/history.h"
#include "persist/version_table.h"

namespace nebulite {

class Stager;
class Persister;
class CommitCoordinator;

struct EngineCore {
  EngineCore(EngineOptions o, std::shared_ptr<Arena> a, std::shared_ptr<Storage> s);
  ~EngineCore();

  const EngineOptions opts;
  const std::shared_ptr<Arena> arena;
  const std::shared_ptr<Storage> storage;  // nullptr: memory tier only
  HistoryLog history;
  CopyEngine copy;  // staging copies
  CopyEngine io;    // the persister's parallel writes
  VersionChecker checker;

  std::mutex mu;
  // Signalled whenever a version's state changes: sealed, persisted, committed in the
  // store, failed, unpinned; and when a job finishes.
  std::condition_variable changed;
  VersionTable versions;       // GUARDED_BY(mu)
  std::vector<Status> errors;  // GUARDED_BY(mu)
  bool closing = false;        // GUARDED_BY(mu): no new work is accepted
  uint64_t newest_seq = 0;     // GUARDED_BY(mu): the highest commit number given or claimed

  std::unique_ptr<Stager> stager;
  std::unique_ptr<Persister> persister;
  std::unique_ptr<CommitCoordinator> coordinator;  // rank 0 with a store only

  void ReportLocked(Status st) {
    errors.push_back(std::move(st));
    if (opts.error_count != nullptr)
      std::atomic_ref<uint64_t>(*opts.error_count).fetch_add(1, std::memory_order_release);
  }
};

}  // namespace nebulite

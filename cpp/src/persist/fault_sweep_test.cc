// The engine-level fault sweep (after LevelDB's fault_injection_test, which drives its
// whole database the same way). For one and two ranks, and for every storage operation k
// of a checkpoint's persist, commit and retention, a fault is injected at operation k:
//   - kIOError / kNoSpace: operation k fails (EIO, ENOSPC) and the engine goes on;
//   - kCrash: operation k and everything after it fail (the process is gone), then the
//     store loses what was not durable (FaultStorage::Crash).
// Then the store is reopened and checked:
//   1. every version listed as committed loads bit for bit (every record of every file);
//   2. the previous committed version survives whenever the new one did not commit;
//   3. nothing committed is lost: a checkpoint whose Flush() returned OK is committed;
//   4. the store stays usable: a new engine commits one more checkpoint, which retention
//      keeps as the only one.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "base/test_util.h"
#include "nebulite/commit.h"
#include "nebulite/engine.h"
#include "nebulite/fault_storage.h"
#include "persist/engine_test_util.h"

namespace nebulite {
namespace {

using engine_test::Committed;
using engine_test::ExpectStored;
using engine_test::MakeObject;
using engine_test::Object;
using engine_test::Options;

enum class Fault { kIOError, kNoSpace, kCrash };

const char* FaultName(Fault f) {
  switch (f) {
    case Fault::kIOError:
      return "EIO";
    case Fault::kNoSpace:
      return "ENOSPC";
    case Fault::kCrash:
      return "crash";
  }
  return "?";
}

// The objects of checkpoint `c` (1, 2, 3) on `rank`: what the store must hold, bit for bit.
Object ObjectOf(int c, uint32_t rank) {
  const size_t k = static_cast<size_t>(c);
  return MakeObject({200 + 10 * k, 70000 + 4096 * k + 100 * rank, 5000},
                    static_cast<uint8_t>(16 * c + rank));
}
std::string TagOf(int c) { return "step" + std::to_string(c); }
std::string VersionOf(int c) { return "vsweep-00000" + std::to_string(c); }

struct Ranks {
  std::vector<std::unique_ptr<Engine>> engines;
};

// `commit_timeout`: short for the checkpoint under faults (a rank that failed is given up
// on quickly), long for the others (a busy machine never fails them).
Ranks OpenRanks(const std::shared_ptr<Storage>& store, uint32_t world, double commit_timeout) {
  Ranks r;
  for (uint32_t rank = 0; rank < world; ++rank) {
    EngineOptions o = Options("", 16 << 20);
    o.storage_override = store;
    o.rank = rank;
    o.world_size = world;
    o.retention = 1;
    o.commit_timeout_seconds = commit_timeout;
    o.copy_threads = 1;
    o.io_threads = 1;
    auto e = Engine::Open(o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    r.engines.push_back(std::move(e).value());
  }
  return r;
}

// Saves checkpoint `c` on every rank, commits it for the store, and flushes; returns
// whether rank 0's Flush() reported it committed. Other ranks wait at most `others_wait`
// for the marker (they cannot tell when rank 0 gave up).
bool SaveCheckpoint(Ranks& r, int c, std::vector<Object>* keep, double others_wait = 30) {
  const uint32_t world = static_cast<uint32_t>(r.engines.size());
  for (uint32_t rank = world; rank-- > 0;) {  // rank 0 last: the others are waited for
    keep->push_back(ObjectOf(c, rank));
    Engine& e = *r.engines[rank];
    if (!e.Stage(TagOf(c), VersionOf(c), "state", keep->back().records).ok()) continue;
    (void)e.Commit(TagOf(c), VersionOf(c), static_cast<uint64_t>(c), true);
  }
  bool ok = r.engines[0]->Flush(5).ok();
  for (uint32_t rank = 1; rank < world; ++rank) (void)r.engines[rank]->Flush(others_wait);
  return ok;
}

// Closes the engines and waits until every thread of theirs is gone (none may touch the
// store once it is checked); `wait` bounds how long they finish pending work.
void CloseRanks(Ranks& r, const std::shared_ptr<FaultStorage>& store, double wait = 30) {
  for (auto& e : r.engines) (void)e->Close(wait);
  r.engines.clear();
  while (store.use_count() > 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// Counts operations and injects the fault at operation k (-1: never).
struct Injector {
  Fault fault = Fault::kIOError;
  int k = -1;
  std::atomic<int> ops{0};
  std::atomic<bool> fired{false};

  FaultStorage::Hook Hook() {
    return [this](StorageOp, const std::string&) {
      const int i = ops.fetch_add(1);
      if (k < 0) return Status::OK();
      const bool hit = fault == Fault::kCrash ? i >= k : i == k;
      if (!hit) return Status::OK();
      fired = true;
      switch (fault) {
        case Fault::kIOError:
          return Status::IOError("injected EIO");
        case Fault::kNoSpace:
          return Status::NoSpace("injected ENOSPC");
        case Fault::kCrash:
          return Status::IOError("injected crash: the process is gone");
      }
      return Status::OK();
    };
  }
};

struct SweepStats {
  int runs = 0, faults = 0, committed_new = 0, kept_previous = 0, lost = 0;
};

// One run: checkpoint 1 committed cleanly, checkpoint 2 under a fault at operation k.
void RunOnce(uint32_t world, Fault fault, int k, SweepStats* stats) {
  SCOPED_TRACE(std::to_string(world) + " rank(s), " + FaultName(fault) + " at operation " +
               std::to_string(k));
  std::shared_ptr<Storage> base(NewMemoryStorage());
  std::shared_ptr<FaultStorage> store(FaultStorage::Wrap(base.get()));
  std::vector<Object> objects;  // kept alive while staged
  Ranks setup = OpenRanks(store, world, 60);
  ASSERT_TRUE(SaveCheckpoint(setup, 1, &objects));
  CloseRanks(setup, store);
  Ranks r = OpenRanks(store, world, 0.1);
  Injector inject;
  inject.fault = fault;
  inject.k = k;
  store->SetHook(inject.Hook());
  // The other ranks' outcome is not asserted: they wait briefly for the marker.
  const bool flushed = SaveCheckpoint(r, 2, &objects, /*others_wait=*/0.2);
  CloseRanks(r, store, /*wait=*/0.2);
  store->SetHook(nullptr);
  if (fault == Fault::kCrash) store->Crash();  // also when Flush() returned: it is durable
  ++stats->runs;
  if (inject.fired) ++stats->faults;

  // 1. Every committed version loads bit for bit.
  std::vector<std::string> committed = Committed(store.get());
  for (const std::string& id : committed) {
    const int c = id == TagOf(1) + "/" + VersionOf(1)   ? 1
                  : id == TagOf(2) + "/" + VersionOf(2) ? 2
                                                        : 0;
    ASSERT_NE(c, 0) << "unexpected committed version " << id;
    for (uint32_t rank = 0; rank < world; ++rank)
      ExpectStored(store.get(), DataFilePath(TagOf(c), VersionOf(c), rank, "state"),
                   ObjectOf(c, rank));
  }
  const bool has2 = std::find(committed.begin(), committed.end(), TagOf(2) + "/" + VersionOf(2)) !=
                    committed.end();
  // 2. The previous one survives whenever the new one did not commit.
  if (!has2) {
    EXPECT_EQ(committed, (std::vector<std::string>{TagOf(1) + "/" + VersionOf(1)}));
    ++stats->kept_previous;
  } else {
    ++stats->committed_new;
  }
  // 3. Nothing committed is lost.
  if (flushed && !has2) ++stats->lost;
  EXPECT_TRUE(!flushed || has2) << "Flush() returned OK but the checkpoint is not committed";
  // 4. The store stays usable.
  Ranks again = OpenRanks(store, world, 60);
  EXPECT_TRUE(SaveCheckpoint(again, 3, &objects));
  CloseRanks(again, store);
  EXPECT_EQ(Committed(store.get()), (std::vector<std::string>{TagOf(3) + "/" + VersionOf(3)}));
  for (uint32_t rank = 0; rank < world; ++rank)
    ExpectStored(store.get(), DataFilePath(TagOf(3), VersionOf(3), rank, "state"),
                 ObjectOf(3, rank));
}

// The number of storage operations of checkpoint 2 in a run without faults.
int CountOperations(uint32_t world) {
  std::shared_ptr<Storage> base(NewMemoryStorage());
  std::shared_ptr<FaultStorage> store(FaultStorage::Wrap(base.get()));
  std::vector<Object> objects;
  Ranks setup = OpenRanks(store, world, 60);
  EXPECT_TRUE(SaveCheckpoint(setup, 1, &objects));
  CloseRanks(setup, store);
  Ranks r = OpenRanks(store, world, 60);
  Injector count;
  store->SetHook(count.Hook());
  EXPECT_TRUE(SaveCheckpoint(r, 2, &objects));
  CloseRanks(r, store);
  store->SetHook(nullptr);
  return count.ops;
}

class FaultSweepTest : public ::testing::TestWithParam<std::tuple<uint32_t, Fault>> {};

TEST_P(FaultSweepTest, EveryOperationOfPersistCommitAndRetention) {
  const auto [world, fault] = GetParam();
  const int total = CountOperations(world);
  ASSERT_GT(total, 20);
  SweepStats stats;
  // A few more than counted: with several ranks the coordinator's polling varies.
  for (int k = 0; k < total + 8; ++k) {
    RunOnce(world, fault, k, &stats);
    if (::testing::Test::HasFatalFailure()) return;
  }
  std::printf(
      "fault sweep: %u rank(s), %s: %d operations, %d runs, %d faults injected, "
      "%d committed the new checkpoint, %d kept the previous one, %d lost\n",
      world, FaultName(fault), total, stats.runs, stats.faults, stats.committed_new,
      stats.kept_previous, stats.lost);
  EXPECT_EQ(stats.lost, 0);
  EXPECT_GT(stats.faults, 0);
  EXPECT_GT(stats.kept_previous, 0);  // the sweep reached the operations before the commit
}

// The rank counts swept: 1 and 2, or those listed in $NEBULITE_FAULT_SWEEP_RANKS ("1,2,3";
// make reliability sweeps 3 ranks too).
std::vector<uint32_t> SweptRanks() {
  std::vector<uint32_t> out;
  const char* env = std::getenv("NEBULITE_FAULT_SWEEP_RANKS");
  std::string list = env && *env ? env : "1,2";
  size_t start = 0;
  while (start < list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    const int n = std::atoi(list.substr(start, comma - start).c_str());
    if (n >= 1 && n <= 8) out.push_back(static_cast<uint32_t>(n));
    start = comma + 1;
  }
  if (out.empty()) out = {1, 2};
  return out;
}

INSTANTIATE_TEST_SUITE_P(Engine, FaultSweepTest,
                         ::testing::Combine(::testing::ValuesIn(SweptRanks()),
                                            ::testing::Values(Fault::kIOError, Fault::kNoSpace,
                                                              Fault::kCrash)),
                         [](const ::testing::TestParamInfo<std::tuple<uint32_t, Fault>>& info) {
                           return std::to_string(std::get<0>(info.param)) + "rank_" +
                                  (std::get<1>(info.param) == Fault::kIOError ? std::string("EIO")
                                   : std::get<1>(info.param) == Fault::kNoSpace
                                       ? std::string("ENOSPC")
                                       : std::string("crash"));
                         });

}  // namespace
}  // namespace nebulite

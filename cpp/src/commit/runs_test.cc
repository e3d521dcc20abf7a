#include "nebulite/runs.h"

#include <gtest/gtest.h>

#include "base/test_util.h"
#include "nebulite/commit.h"

namespace nebulite {
namespace {

constexpr int64_t kSecond = 1000000000;

int64_t Newest(Storage* s, const std::string& path) { return Val(s->Stat(path)).mtime_ns; }

TEST(RunsTest, VersionNames) {
  EXPECT_EQ(VersionName("abc123", 7), "vabc123-000007");
  std::string run;
  uint64_t counter = 0;
  ASSERT_TRUE(ParseVersionName("vabc123-000007", &run, &counter));
  EXPECT_EQ(run, "abc123");
  EXPECT_EQ(counter, 7u);
  ASSERT_TRUE(ParseVersionName("vR-1234567", &run, &counter));
  EXPECT_EQ(counter, 1234567u);
  for (const char* bad : {"v", "vabc-12", "abc-000001", "v-000001", "vab_c-000001", "vabc-00000x"})
    EXPECT_FALSE(ParseVersionName(bad, &run, &counter)) << bad;
  EXPECT_TRUE(ValidateRunId("abc").ok());
  EXPECT_FALSE(ValidateRunId("a/b").ok());
  EXPECT_FALSE(ValidateRunId(std::string(65, 'a')).ok());
}

TEST(RunsTest, HighestVersionCounterSeesEveryTag) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(s->CreateDirs("a/vrun-000003").ok());
  ASSERT_TRUE(s->CreateDirs("b/vrun-000012/rank0").ok());
  ASSERT_TRUE(s->CreateDirs("b/vother-000099").ok());
  EXPECT_EQ(Val(HighestVersionCounter(s.get(), "run")), 12u);
  EXPECT_EQ(Val(HighestVersionCounter(s.get(), "nobody")), 0u);
}

TEST(RunsTest, ARunIsAliveWhileItsLockIsHeld) {
  auto s = NewMemoryStorage();
  EXPECT_FALSE(Val(RunIsAlive(s.get(), "r1")));
  auto held = Val(HoldRun(s.get(), "r1"));
  ASSERT_NE(held, nullptr);
  auto again = Val(HoldRun(s.get(), "r1"));  // every process of the run holds it
  ASSERT_NE(again, nullptr);
  EXPECT_TRUE(Val(RunIsAlive(s.get(), "r1")));
  held.reset();
  again.reset();
  EXPECT_FALSE(Val(RunIsAlive(s.get(), "r1")));
}

// Uncommitted versions of dead runs go, but only once nothing in them changed for the
// grace period: a free lock alone proves nothing where locks are node-local.
TEST(RunsTest, DeadRunCleanupNeedsAFreeLockAndTheGracePeriod) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(s->WriteFileAtomic("t/vdead-000001/rank0/model", "partial").ok());
  ASSERT_TRUE(s->WriteFileAtomic("t/vlive-000001/rank0/model", "partial").ok());
  ASSERT_TRUE(s->WriteFileAtomic("t/vmine-000001/rank0/model", "partial").ok());
  ASSERT_TRUE(s->WriteFileAtomic("t/vdead-000002/COMMITTED", "a committed one").ok());
  ASSERT_TRUE(s->WriteFileAtomic("t/foreign/x", "not ours").ok());
  auto live = Val(HoldRun(s.get(), "live"));
  const int64_t written = Newest(s.get(), "t/vdead-000001/rank0/model");
  // Within the grace period nothing goes, even with the lock free.
  auto r = Val(RemoveDeadRunsVersions(s.get(), "mine", 60, written + 30 * kSecond));
  EXPECT_TRUE(r.removed.empty());
  // After it, only the dead run's uncommitted version.
  r = Val(RemoveDeadRunsVersions(s.get(), "mine", 60, written + 61 * kSecond));
  EXPECT_EQ(r.removed, (std::vector<std::string>{"t/vdead-000001"}));
  EXPECT_TRUE(Val(s->Exists("t/vlive-000001/rank0/model")));
  EXPECT_TRUE(Val(s->Exists("t/vmine-000001/rank0/model")));
  EXPECT_TRUE(Val(s->Exists("t/vdead-000002/COMMITTED")));
  EXPECT_TRUE(Val(s->Exists("t/foreign/x")));
  // A version still being written (fresh files) is kept although its run looks dead.
  live.reset();
  ASSERT_TRUE(s->WriteFileAtomic("t/vlive-000001/rank0/fresh", "x").ok());
  const int64_t fresh = Newest(s.get(), "t/vlive-000001/rank0/fresh");
  r = Val(RemoveDeadRunsVersions(s.get(), "mine", 60, fresh + 10 * kSecond));
  EXPECT_TRUE(r.removed.empty());
}

// A dry run names what a clean-up would remove, and removes nothing.
TEST(RunsTest, DeadRunCleanupDryRunRemovesNothing) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(s->WriteFileAtomic("t/vdead-000001/rank0/model", "partial").ok());
  const int64_t written = Newest(s.get(), "t/vdead-000001/rank0/model");
  auto r = Val(RemoveDeadRunsVersions(s.get(), "", 60, written + 61 * kSecond, /*dry_run=*/true));
  EXPECT_EQ(r.removed, (std::vector<std::string>{"t/vdead-000001"}));
  EXPECT_TRUE(Val(s->Exists("t/vdead-000001/rank0/model")));
  r = Val(RemoveDeadRunsVersions(s.get(), "", 60, written + 61 * kSecond));
  EXPECT_EQ(r.removed, (std::vector<std::string>{"t/vdead-000001"}));
  EXPECT_FALSE(Val(s->Exists("t")));
}

TEST(RunsTest, AbandonedRankFilesGoUnlessCommitted) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(s->WriteFileAtomic("t/v/rank1/model", "x").ok());
  ASSERT_TRUE(s->WriteFileAtomic("t/v/rank0/model", "y").ok());
  ASSERT_TRUE(RemoveAbandonedRankFiles(s.get(), "t", "v", 1).ok());
  EXPECT_FALSE(Val(s->Exists("t/v/rank1")));
  EXPECT_TRUE(Val(s->Exists("t/v/rank0/model")));
  ASSERT_TRUE(RemoveAbandonedRankFiles(s.get(), "t", "v", 0).ok());
  EXPECT_FALSE(Val(s->Exists("t")));  // emptied: the version's and the tag's directories go
  ASSERT_TRUE(s->WriteFileAtomic("u/v/rank0/model", "z").ok());
  ASSERT_TRUE(s->WriteFileAtomic("u/v/COMMITTED", "c").ok());
  ASSERT_TRUE(RemoveAbandonedRankFiles(s.get(), "u", "v", 0).ok());
  EXPECT_TRUE(Val(s->Exists("u/v/rank0/model")));
}

}  // namespace
}  // namespace nebulite

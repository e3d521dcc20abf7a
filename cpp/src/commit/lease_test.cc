#include "nebulite/lease.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "base/test_util.h"

namespace nebulite {
namespace {

constexpr int64_t kSecond = 1000000000;

int64_t Now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Lease Job(const std::string& run, const std::string& host, uint32_t pid = 100) {
  return Lease{run, host, pid, 0, 60};
}

// A renewal period no test waits for: every renewal here is an explicit Renew().
constexpr double kNever = 3600;

TEST(LeaseTest, EncodingRoundTripsAndRejectsDamage) {
  Lease l{"run1", "node-7.cluster", 4242, 1717171717000000000, 180};
  const std::string text = EncodeLease(l);
  EXPECT_EQ(text.rfind("nebulite-lease 1\nrun run1\nhost node-7.cluster\npid 4242\n", 0), 0u);
  Lease back = Val(DecodeLease(text));
  EXPECT_EQ(back.run, "run1");
  EXPECT_EQ(back.host, "node-7.cluster");
  EXPECT_EQ(back.pid, 4242u);
  EXPECT_EQ(back.renewed_unix_ns, 1717171717000000000);
  EXPECT_EQ(back.ttl_seconds, 180u);
  std::string flipped = text;
  flipped[20] ^= 1;
  for (const std::string& bad :
       {std::string(), std::string("garbage"), text.substr(0, 30), flipped}) {
    EXPECT_EQ(DecodeLease(bad).status().code(), StatusCode::kCorruption) << bad;
  }
}

TEST(LeaseTest, ASecondJobIsRefusedNamingTheFirst) {
  auto s = NewMemoryStorage();
  auto first = Val(LeaseKeeper::Acquire(s.get(), Job("jobA", "hostA", 11), kNever));
  ASSERT_NE(first, nullptr);
  auto second = LeaseKeeper::Acquire(s.get(), Job("jobB", "hostB", 22), kNever);
  ASSERT_EQ(second.status().code(), StatusCode::kStoreInUse);
  const std::string& msg = second.status().message();
  for (const char* part :
       {"run jobA", "host hostA", "pid 11", "shared_store=True", "NEBULITE_SHARED_STORE=1"}) {
    EXPECT_NE(msg.find(part), std::string::npos) << part << " in " << msg;
  }
  // The ranks of the first job share its run id and are never refused.
  auto rank1 = LeaseKeeper::Acquire(s.get(), Job("jobA", "hostC", 33), kNever);
  EXPECT_TRUE(rank1.ok()) << rank1.status().ToString();
  EXPECT_TRUE(first->status().ok());
}

TEST(LeaseTest, ReleasingLetsTheNextJobIn) {
  auto s = NewMemoryStorage();
  auto first = Val(LeaseKeeper::Acquire(s.get(), Job("jobA", "hostA"), kNever));
  first->Release();
  EXPECT_FALSE(Val(s->Exists(kLeasePath)));
  auto second = Val(LeaseKeeper::Acquire(s.get(), Job("jobB", "hostB"), kNever));
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(Val(DecodeLease(Val(s->ReadFile(kLeasePath, 4096)))).run, "jobB");
}

TEST(LeaseTest, ALeaseFromAnotherHostLivesUntilItsTtl) {
  auto s = NewMemoryStorage();
  // Written by hand, its lock free: a holder on another host whose locks this host
  // cannot see (node-local locks), alive while it renews.
  Lease fresh{"jobA", "elsewhere", 7, Now() - 5 * kSecond, 60};
  ASSERT_TRUE(s->WriteFileAtomic(kLeasePath, EncodeLease(fresh)).ok());
  EXPECT_EQ(LeaseKeeper::Acquire(s.get(), Job("jobB", "here"), kNever).status().code(),
            StatusCode::kStoreInUse);
  Lease stale{"jobA", "elsewhere", 7, Now() - 120 * kSecond, 60};
  ASSERT_TRUE(s->WriteFileAtomic(kLeasePath, EncodeLease(stale)).ok());
  auto taken = Val(LeaseKeeper::Acquire(s.get(), Job("jobB", "here"), kNever));
  ASSERT_NE(taken, nullptr);
  EXPECT_EQ(Val(DecodeLease(Val(s->ReadFile(kLeasePath, 4096)))).run, "jobB");
}

TEST(LeaseTest, ALeaseOfThisHostWithAFreeLockIsTakenOverAtOnce) {
  auto s = NewMemoryStorage();
  Lease dead{"jobA", "here", 7, Now(), 600};  // just renewed, but its process is gone
  ASSERT_TRUE(s->WriteFileAtomic(kLeasePath, EncodeLease(dead)).ok());
  auto taken = LeaseKeeper::Acquire(s.get(), Job("jobB", "here"), kNever);
  EXPECT_TRUE(taken.ok()) << taken.status().ToString();
}

TEST(LeaseTest, AHeldLockProvesAStaleLeaseAlive) {
  auto s = NewMemoryStorage();
  Lease stale{"jobA", "elsewhere", 7, Now() - 3600 * kSecond, 60};
  ASSERT_TRUE(s->WriteFileAtomic(kLeasePath, EncodeLease(stale)).ok());
  auto lock = Val(s->TryLock(kLeaseLockPath, true));
  ASSERT_NE(lock, nullptr);
  EXPECT_EQ(LeaseKeeper::Acquire(s.get(), Job("jobB", "here"), kNever).status().code(),
            StatusCode::kStoreInUse);
}

TEST(LeaseTest, AnOddLeaseFileHasNoLiveHolder) {
  for (int kind = 0; kind < 3; ++kind) {
    auto s = NewMemoryStorage();
    if (kind == 0) ASSERT_TRUE(s->WriteFileAtomic(kLeasePath, "").ok());
    if (kind == 1) ASSERT_TRUE(s->WriteFileAtomic(kLeasePath, "nebulite-lease 1\ngarbage").ok());
    if (kind == 2) ASSERT_TRUE(s->CreateDirs(std::string(kLeasePath) + "/x").ok());
    LeaseState state = Val(ReadLease(s.get(), "here", Now()));
    EXPECT_FALSE(state.present);
    ASSERT_EQ(state.warnings.size(), 1u) << kind;
    EXPECT_NE(state.warnings[0].find(kLeasePath), std::string::npos);
    // A file is replaced; a directory cannot be: the job writes without a lease, warned.
    auto keeper = LeaseKeeper::Acquire(s.get(), Job("jobB", "here"), kNever);
    ASSERT_TRUE(keeper.ok()) << keeper.status().ToString();
    EXPECT_EQ((*keeper)->TakeWarnings().size(), kind < 2 ? 1u : 2u);
  }
}

TEST(LeaseTest, AJobThatLostItsLeaseStopsAndLeavesTheNewHolderAlone) {
  auto s = NewMemoryStorage();
  auto keeper = Val(LeaseKeeper::Acquire(s.get(), Job("jobA", "hostA"), kNever));
  ASSERT_TRUE(keeper->Renew().ok());
  // Another job on another host found the lease expired (this one was paused) and took it.
  Lease other{"jobB", "hostB", 9, Now(), 60};
  const std::string text = EncodeLease(other);
  ASSERT_TRUE(s->WriteFileAtomic(kLeasePath, text).ok());
  EXPECT_EQ(keeper->Renew().code(), StatusCode::kStoreInUse);
  EXPECT_EQ(keeper->status().code(), StatusCode::kStoreInUse);
  EXPECT_NE(keeper->status().message().find("run jobB"), std::string::npos);
  keeper->Release();
  EXPECT_EQ(Val(s->ReadFile(kLeasePath, 4096)), text);  // never taken back, nor removed
}

TEST(LeaseTest, RenewalMovesTheRenewalTime) {
  auto s = NewMemoryStorage();
  auto keeper = Val(LeaseKeeper::Acquire(s.get(), Job("jobA", "hostA"), kNever));
  Lease before = Val(DecodeLease(Val(s->ReadFile(kLeasePath, 4096))));
  Lease old = before;
  old.renewed_unix_ns -= 100 * kSecond;
  ASSERT_TRUE(s->WriteFileAtomic(kLeasePath, EncodeLease(old)).ok());
  ASSERT_TRUE(keeper->Renew().ok());
  Lease after = Val(DecodeLease(Val(s->ReadFile(kLeasePath, 4096))));
  EXPECT_GE(after.renewed_unix_ns, before.renewed_unix_ns);
}

TEST(LeaseTest, TheKeeperRenewsOnItsOwnWhileTheJobLives) {
  auto s = NewMemoryStorage();
  auto keeper = Val(LeaseKeeper::Acquire(s.get(), Job("jobA", "hostA"), 0.001));
  Lease old = Val(DecodeLease(Val(s->ReadFile(kLeasePath, 4096))));
  old.renewed_unix_ns = 1;  // as if its last renewal were long ago
  ASSERT_TRUE(s->WriteFileAtomic(kLeasePath, EncodeLease(old)).ok());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (Val(DecodeLease(Val(s->ReadFile(kLeasePath, 4096)))).renewed_unix_ns == 1) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "never renewed";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  keeper->Release();
  EXPECT_FALSE(Val(s->Exists(kLeasePath)));
}

}  // namespace
}  // namespace nebulite

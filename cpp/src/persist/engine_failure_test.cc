// The engine under storage faults, restarts and misuse: what a failure may and may not
// remove, the commit order across runs, closing with a deadline, reading while retention
// deletes, and memory changed after a save.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "base/test_util.h"
#include "nebulite/commit.h"
#include "nebulite/crc32.h"
#include "nebulite/engine.h"
#include "nebulite/fault_storage.h"
#include "nebulite/stored_archive.h"
#include "persist/engine_test_util.h"

namespace nebulite {
namespace {

using engine_test::CheckEveryCommittedVersion;
using engine_test::Committed;
using engine_test::ExpectStored;
using engine_test::FaultyStore;
using engine_test::MakeObject;
using engine_test::Object;
using engine_test::Open;
using engine_test::Options;
using engine_test::OptionsOn;
using engine_test::TempDir;

// Fails the n-th (0-based) operation of kind `op` on `path`, once.
FaultStorage::Hook FailNth(StorageOp op, std::string path, int n, Status st) {
  auto seen = std::make_shared<std::atomic<int>>(0);
  return [=](StorageOp o, const std::string& p) {
    if (o == op && p == path && seen->fetch_add(1) == n) return st;
    return Status::OK();
  };
}
FaultStorage::Hook FailOnce(StorageOp op, std::string path, Status st) {
  return FailNth(op, std::move(path), 0, std::move(st));
}

// A directory sync that fails after a rank's manifest was renamed into place must not
// remove the files that manifest names: rank 0 goes on to commit (every file is there),
// and what is committed is whole.
TEST(EngineFailureTest, AFailedSyncAfterTheManifestRenameRemovesNothing) {
  FaultyStore s;
  auto e0 = Open(OptionsOn(s, 0, 2, /*retention=*/1));
  auto e1 = Open(OptionsOn(s, 1, 2, 1));
  auto a1 = MakeObject({100, 70000}, 1), b1 = MakeObject({100, 70000}, 2);
  ASSERT_TRUE(e0->Stage("t", "v1", "a", a1.records).ok());
  ASSERT_TRUE(e1->Stage("t", "v1", "b", b1.records).ok());
  ASSERT_TRUE(e0->Commit("t", "v1", 1, true).ok());
  ASSERT_TRUE(e1->Commit("t", "v1", 1, true).ok());
  ASSERT_TRUE(e0->Flush(30).ok());
  ASSERT_TRUE(e1->Flush(30).ok());
  // Rank 1's manifest of v2: the rename happens, the directory sync after it (the second
  // sync of t/v2: the first makes the rank directory's entry durable) fails.
  s.fault->SetHook(
      FailNth(StorageOp::kSyncDir, "t/v2", 1, Status::IOError("injected fsync failure")));
  auto a2 = MakeObject({100, 70000}, 3), b2 = MakeObject({100, 70000}, 4);
  ASSERT_TRUE(e1->Stage("t", "v2", "b", b2.records).ok());
  ASSERT_TRUE(e1->Commit("t", "v2", 2, true).ok());
  EXPECT_FALSE(e1->Flush(30).ok());  // rank 1 saw its manifest fail
  ASSERT_TRUE(e0->Stage("t", "v2", "a", a2.records).ok());
  ASSERT_TRUE(e0->Commit("t", "v2", 2, true).ok());
  Status flushed = e0->Flush(30);
  EXPECT_TRUE(Val(s.fault->Exists(ManifestPath("t", "v2", 1))));  // it was published
  // Whatever rank 0 decided, nothing committed is torn and something is committed.
  Status whole = CheckEveryCommittedVersion(s.fault.get());
  EXPECT_TRUE(whole.ok()) << whole.ToString();
  auto committed = Committed(s.fault.get());
  ASSERT_FALSE(committed.empty());
  if (flushed.ok()) {
    EXPECT_EQ(committed.back(), "t/v2");
    ExpectStored(s.fault.get(), DataFilePath("t", "v2", 1, "b"), b2);
  } else {
    EXPECT_EQ(committed, (std::vector<std::string>{"t/v1"}));  // the previous one survives
  }
  s.fault->SetHook(nullptr);
}

// A streamed object (larger than the memory budget) cannot be written again: a failure
// before the manifest keeps its file, and a retry commits a whole version.
TEST(EngineFailureTest, AStreamedObjectSurvivesAFailureAndARetry) {
  FaultyStore s;
  auto e = Open(OptionsOn(s, 0, 1, 0, /*memory=*/4 << 20));
  auto big = MakeObject({1000, 9 << 20}, 5);
  auto info = e->Stage("big", "v1", "model", big.records);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  ASSERT_TRUE(info->streamed);
  s.fault->SetHook(FailOnce(StorageOp::kWriteAtomic, ManifestPath("big", "v1", 0),
                            Status::NoSpace("injected: disk full")));
  ASSERT_TRUE(e->Commit("big", "v1", 1, true).ok());
  EXPECT_EQ(e->Flush(30).code(), StatusCode::kIOError);
  EXPECT_TRUE(Val(s.fault->Exists(DataFilePath("big", "v1", 0, "model"))));
  ASSERT_TRUE(e->Persist("big", "v1").ok());
  ASSERT_TRUE(e->Flush(30).ok());
  EXPECT_EQ(Committed(s.fault.get()), (std::vector<std::string>{"big/v1"}));
  Status whole = CheckEveryCommittedVersion(s.fault.get());
  EXPECT_TRUE(whole.ok()) << whole.ToString();
  ExpectStored(s.fault.get(), DataFilePath("big", "v1", 0, "model"), big);
  s.fault->SetHook(nullptr);
}

// Files written from memory are removed by a failure before the manifest (the space goes
// back), and written again by a retry.
TEST(EngineFailureTest, AFailureBeforeTheManifestGivesTheSpaceBack) {
  FaultyStore s;
  auto e = Open(OptionsOn(s));
  auto a = MakeObject({100, 70000}, 1), b = MakeObject({100, 80000}, 2);
  ASSERT_TRUE(e->Stage("t", "v", "a", a.records).ok());
  ASSERT_TRUE(e->Stage("t", "v", "b", b.records).ok());
  s.fault->SetHook(FailOnce(StorageOp::kRename, DataFilePath("t", "v", 0, "b"),
                            Status::NoSpace("injected: disk full")));
  ASSERT_TRUE(e->Commit("t", "v", 1, true).ok());
  EXPECT_FALSE(e->Flush(30).ok());
  EXPECT_FALSE(Val(s.fault->Exists(DataFilePath("t", "v", 0, "a"))));
  EXPECT_TRUE(Val(s.fault->List(RankDir("t", "v", 0))).empty());  // no temporary file either
  ASSERT_TRUE(e->Persist("t", "v").ok());
  ASSERT_TRUE(e->Flush(30).ok());
  ExpectStored(s.fault.get(), DataFilePath("t", "v", 0, "a"), a);
  ExpectStored(s.fault.get(), DataFilePath("t", "v", 0, "b"), b);
  s.fault->SetHook(nullptr);
}

// An earlier run's engine (an agent that outlived its trainer) committing late gets a later
// place in the commit order, and the new run's next commits come after it: retention never
// deletes a version just committed, and the newest commit is the latest.
TEST(EngineFailureTest, CommitOrderNeverGoesBackwardsAcrossRuns) {
  FaultyStore s;
  auto old_run = Open(OptionsOn(s, 0, 1, /*retention=*/1));
  auto new_run = Open(OptionsOn(s, 0, 1, 1));
  auto o = MakeObject({64, 5000}, 1);
  // The new run believed the store's newest commit was 9; the old one was at 50.
  ASSERT_TRUE(new_run->Stage("new", "a", "n", o.records).ok());
  ASSERT_TRUE(new_run->Commit("new", "a", 10, true).ok());
  ASSERT_TRUE(new_run->Flush(30).ok());
  ASSERT_TRUE(old_run->Stage("old", "z", "n", o.records).ok());
  ASSERT_TRUE(old_run->Commit("old", "z", 50, true).ok());
  ASSERT_TRUE(old_run->Flush(30).ok());
  ASSERT_TRUE(new_run->Stage("new", "b", "n", o.records).ok());
  ASSERT_TRUE(new_run->Commit("new", "b", 11, true).ok());
  ASSERT_TRUE(new_run->Flush(30).ok());
  EXPECT_EQ(Committed(s.fault.get()), (std::vector<std::string>{"new/b"}));
  auto versions = new_run->Versions();
  ASSERT_FALSE(versions.empty());
  EXPECT_GT(versions.back().seq, 50u);  // the store's order, reported back
}

// A version name that is already committed in the store (a reused run id restarting its
// counter) is never written again: the committed files stay as they were.
TEST(EngineFailureTest, ACommittedVersionIsNeverOverwritten) {
  FaultyStore s;
  auto first = Open(OptionsOn(s));
  auto a = MakeObject({100, 70000}, 1);
  ASSERT_TRUE(first->Stage("t", "vrun-000001", "n", a.records).ok());
  ASSERT_TRUE(first->Commit("t", "vrun-000001", 1, true).ok());
  ASSERT_TRUE(first->Flush(30).ok());
  first.reset();
  auto second = Open(OptionsOn(s));
  auto b = MakeObject({100, 70000}, 2);
  ASSERT_TRUE(second->Stage("t", "vrun-000001", "n", b.records, /*persist_now=*/true).ok());
  ASSERT_TRUE(second->Commit("t", "vrun-000001", 2, true).ok());
  Status st = second->Flush(30);
  EXPECT_FALSE(st.ok());
  auto errors = second->TakeErrors();
  ASSERT_FALSE(errors.empty());
  EXPECT_EQ(errors[0].code(), StatusCode::kFailedPrecondition) << errors[0].ToString();
  ExpectStored(s.fault.get(), DataFilePath("t", "vrun-000001", 0, "n"), a);
  Status whole = CheckEveryCommittedVersion(s.fault.get());
  EXPECT_TRUE(whole.ok()) << whole.ToString();
}

// Retention removing the last version of a tag keeps the tag's directory when another
// rank is creating a new version in it at that instant.
TEST(EngineFailureTest, RetentionKeepsATagDirectoryAnotherRankIsUsing) {
  FaultyStore s;
  auto e = Open(OptionsOn(s, 0, 1, /*retention=*/1));
  auto o = MakeObject({64, 5000}, 1);
  ASSERT_TRUE(e->Stage("x", "v1", "n", o.records).ok());
  ASSERT_TRUE(e->Commit("x", "v1", 1, true).ok());
  ASSERT_TRUE(e->Flush(30).ok());
  // While retention deletes x/v1, another rank starts x/v2 (straight in the base store).
  Storage* base = s.base.get();
  s.fault->SetHook([base](StorageOp op, const std::string& path) {
    if (op == StorageOp::kDelete && path == "x/v1") (void)base->CreateDirs("x/v2/rank1");
    return Status::OK();
  });
  ASSERT_TRUE(e->Stage("y", "v1", "n", o.records).ok());
  ASSERT_TRUE(e->Commit("y", "v1", 2, true).ok());
  ASSERT_TRUE(e->Flush(30).ok());
  s.fault->SetHook(nullptr);
  EXPECT_EQ(Committed(s.fault.get()), (std::vector<std::string>{"y/v1"}));
  EXPECT_TRUE(Val(s.fault->Exists("x/v2/rank1")));
}

// Close() returns within its timeout, whatever is pending: another rank that never
// commits, or a store that hangs.
TEST(EngineFailureTest, CloseHonoursItsTimeout) {
  FaultyStore s;
  auto o0 = OptionsOn(s, 0, 2);
  o0.commit_timeout_seconds = 1e6;  // rank 1 never comes
  auto e0 = Open(o0);
  auto o = MakeObject({64, 5000}, 1);
  ASSERT_TRUE(e0->Stage("t", "v", "n", o.records).ok());
  ASSERT_TRUE(e0->Commit("t", "v", 1, true).ok());
  EXPECT_EQ(e0->Close(0.2).code(), StatusCode::kCancelled);
  e0.reset();
  // A store whose writes hang until released.
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  FaultyStore hung;
  hung.fault->SetHook([&](StorageOp op, const std::string&) {
    if (op == StorageOp::kWrite) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return release; });
    }
    return Status::OK();
  });
  auto e = Open(OptionsOn(hung));
  ASSERT_TRUE(e->Stage("t", "v", "n", o.records).ok());
  ASSERT_TRUE(e->Commit("t", "v", 1, true).ok());
  EXPECT_EQ(e->Close(0.2).code(), StatusCode::kCancelled);
  e.reset();  // the engine is gone; its stuck thread finishes alone once the store answers
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  // The store outlives the detached thread's last use of it only if we wait for it: the
  // thread holds the engine's core, which holds the store.
  std::weak_ptr<Storage> weak = hung.fault;
  hung.fault.reset();
  while (!weak.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

// A reader that opened a data file keeps reading it whole while retention deletes its
// version (posix: the open descriptor; every driver: the handle).
TEST(EngineFailureTest, RetentionNeverPullsAFileFromUnderAReader) {
  TempDir dir;
  auto opts = Options(dir.path());
  opts.retention = 1;
  auto e = Open(opts);
  auto a = MakeObject({100, 3 << 20}, 1), b = MakeObject({100, 70000}, 2);
  ASSERT_TRUE(e->Stage("a", "v", "n", a.records).ok());
  ASSERT_TRUE(e->Commit("a", "v", 1, true).ok());
  ASSERT_TRUE(e->Flush(30).ok());
  auto reader = StoredArchive::Open(e->storage(), DataFilePath("a", "v", 0, "n"));
  ASSERT_TRUE(reader.ok());
  ASSERT_TRUE(e->Stage("b", "v", "n", b.records).ok());
  ASSERT_TRUE(e->Commit("b", "v", 2, true).ok());
  ASSERT_TRUE(e->Flush(30).ok());
  EXPECT_EQ(Committed(e->storage()), (std::vector<std::string>{"b/v"}));  // a is gone
  const auto* rec = (*reader)->index().Find("data/0");
  ASSERT_NE(rec, nullptr);
  std::vector<uint8_t> got(rec->size);
  Status st = (*reader)->ReadInto(*rec, got.data(), 2);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(got, a.payloads[1]);
}

// Memory changed after a save (a stray write into the arena) is caught when persisting:
// the version fails and is never committed.
TEST(EngineFailureTest, MemoryChangedAfterTheSaveIsNeverCommitted) {
  FaultyStore s;
  auto e = Open(OptionsOn(s));
  auto o = MakeObject({100, 70000}, 1);
  ASSERT_TRUE(e->Stage("t", "v", "n", o.records).ok());
  ASSERT_TRUE(e->Commit("t", "v", 1, /*persist=*/false).ok());
  {
    auto lease = e->Pin("t", "v", "n");
    ASSERT_TRUE(lease.ok());
    uint8_t* p = const_cast<uint8_t*>((*lease)->data()) + (*lease)->records()[1].offset + 1234;
    *p ^= 0x40;
  }
  ASSERT_TRUE(e->Persist("t", "v").ok());
  EXPECT_FALSE(e->Flush(30).ok());
  auto errors = e->TakeErrors();
  ASSERT_FALSE(errors.empty());
  EXPECT_EQ(errors[0].code(), StatusCode::kCorruption) << errors[0].ToString();
  EXPECT_NE(errors[0].message().find("changed in memory after it was saved"), std::string::npos);
  EXPECT_TRUE(Committed(s.fault.get()).empty());
  EXPECT_FALSE(Val(s.fault->Exists(DataFilePath("t", "v", 0, "n"))));
}

// Each error reported is counted where the options say (a trainer tells from that count,
// in memory an agent shares with it, whether there is anything to take).
TEST(EngineFailureTest, EachErrorReportedIsCountedWhereTheOptionsSay) {
  FaultyStore s;
  alignas(8) uint64_t count = 0;
  auto o = OptionsOn(s);
  o.error_count = &count;
  auto e = Open(o);
  for (const char* tag : {"a", "b"}) {
    auto obj = MakeObject({100, 70000}, 1);
    ASSERT_TRUE(e->Stage(tag, "v", "n", obj.records).ok());
    ASSERT_TRUE(e->Commit(tag, "v", tag[0] == 'a' ? 1 : 2, /*persist=*/false).ok());
    auto lease = e->Pin(tag, "v", "n");
    ASSERT_TRUE(lease.ok());
    uint8_t* p = const_cast<uint8_t*>((*lease)->data()) + (*lease)->records()[1].offset + 99;
    *p ^= 0x40;  // the write finds it changed: an error
  }
  auto counted = [&] { return std::atomic_ref<uint64_t>(count).load(); };
  EXPECT_EQ(counted(), 0u);
  ASSERT_TRUE(e->Persist("a", "v").ok());
  EXPECT_FALSE(e->Flush(30).ok());
  const uint64_t first = counted();
  EXPECT_GE(first, 1u);
  EXPECT_EQ(first, e->TakeErrors().size());
  ASSERT_TRUE(e->Persist("b", "v").ok());
  EXPECT_FALSE(e->Flush(30).ok());
  EXPECT_GT(counted(), first);
  EXPECT_EQ(counted() - first, e->TakeErrors().size());
}

// Pin() is for committed versions: an object reserved but not sealed is not pinnable (it
// neither waits nor touches memory a discard gives back).
TEST(EngineFailureTest, PinOnlyServesCommittedVersions) {
  auto e = Open(Options("", 16 << 20));
  auto o = MakeObject({100, 5000}, 1);
  std::vector<format::RecordSpec> specs;
  for (const auto& r : o.records) specs.push_back({r.name, r.size});
  ASSERT_TRUE(e->Reserve("t", "v", "n", specs).ok());
  EXPECT_EQ(e->Pin("t", "v", "n").status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(e->Discard("t", "v", "n").ok());
  EXPECT_EQ(e->Pin("t", "v", "n").status().code(), StatusCode::kNotFound);
}

// An abandoned version leaves nothing of this rank in the store; a renamed one moves its
// files (already written, here a streamed object) to the new name.
TEST(EngineFailureTest, AbandonAndRenameTidyTheStore) {
  FaultyStore s;
  auto e = Open(OptionsOn(s, 0, 1, 0, /*memory=*/4 << 20));
  auto small = MakeObject({100, 5000}, 1), big = MakeObject({100, 9 << 20}, 2);
  ASSERT_TRUE(e->Stage("t", "va", "small", small.records, /*persist_now=*/true).ok());
  ASSERT_TRUE(e->Stage("t", "va", "big", big.records).ok());  // streamed: in the store now
  e->Abandon("t", "va");
  ASSERT_TRUE(e->Flush(30).ok());
  ASSERT_TRUE(e->Close(30).ok());
  EXPECT_FALSE(Val(s.fault->Exists("t")));
  e = Open(OptionsOn(s, 0, 1, 0, 4 << 20));
  ASSERT_TRUE(e->Stage("t", "vb", "big", big.records).ok());
  ASSERT_TRUE(e->RenameVersion("t", "vb", "vc").ok());
  EXPECT_EQ(e->RenameVersion("t", "missing", "vd").code(), StatusCode::kOk);  // nothing here
  ASSERT_TRUE(e->Commit("t", "vc", 1, true).ok());
  EXPECT_EQ(e->RenameVersion("t", "vc", "vd").code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(e->Flush(30).ok());
  EXPECT_EQ(Committed(s.fault.get()), (std::vector<std::string>{"t/vc"}));
  ExpectStored(s.fault.get(), DataFilePath("t", "vc", 0, "big"), big);
  EXPECT_FALSE(Val(s.fault->Exists("t/vb")));
}

TEST(EngineFailureTest, RefusesBadOptionsAndNames) {
  auto o = Options("");
  o.copy_threads = 100000;
  EXPECT_EQ(Engine::Open(o).status().code(), StatusCode::kInvalidArgument);
  o = Options("");
  o.io_threads = -1;
  EXPECT_EQ(Engine::Open(o).status().code(), StatusCode::kInvalidArgument);
  o = Options("");
  o.commit_timeout_seconds = std::nan("");
  EXPECT_EQ(Engine::Open(o).status().code(), StatusCode::kInvalidArgument);
  alignas(8) char counts[16] = {};
  o = Options("");
  o.error_count = reinterpret_cast<uint64_t*>(counts + 4);  // not 8-byte aligned
  EXPECT_EQ(Engine::Open(o).status().code(), StatusCode::kInvalidArgument);
  auto e = Open(Options(""));
  auto obj = MakeObject({10}, 0);
  EXPECT_EQ(e->Stage(".hidden", "v", "n", obj.records).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(e->Stage("t", ".v", "n", obj.records).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nebulite

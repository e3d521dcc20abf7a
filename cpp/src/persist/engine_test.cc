#include "nebulite/engine.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "base/test_util.h"
#include "nebulite/commit.h"
#include "nebulite/crc32.h"
#include "nebulite/fault_storage.h"
#include "nebulite/stored_archive.h"
#include "persist/engine_test_util.h"

namespace nebulite {
namespace {

namespace fs = std::filesystem;
using engine_test::ExpectStored;
using engine_test::FaultyStore;
using engine_test::MakeObject;
using engine_test::Object;
using engine_test::Open;
using engine_test::OpenTwoRanks;
using engine_test::Options;
using engine_test::OptionsOn;
using engine_test::TempDir;

TEST(EngineTest, PersistsCommitsAndReadsBack) {
  TempDir dir;
  auto e = Engine::Open(Options(dir.path()));
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& engine = **e;
  auto obj = MakeObject({300, 5 << 20, 1, 0, 123457}, 1);
  auto info = engine.Stage("step1", "v1", "model", obj.records);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_FALSE(info->streamed);
  EXPECT_GT(info->bytes, 5u << 20);
  ASSERT_TRUE(engine.Commit("step1", "v1", 1, /*persist=*/true).ok());
  ASSERT_TRUE(engine.Flush(60).ok());

  auto cat = ReadCatalog(engine.storage());
  ASSERT_TRUE(cat.ok());
  ASSERT_EQ(cat->entries.size(), 1u);
  EXPECT_EQ(cat->entries[0].commit.tag, "step1");
  EXPECT_EQ(cat->entries[0].commit.seq, 1u);
  ExpectStored(engine.storage(), DataFilePath("step1", "v1", 0, "model"), obj);
  auto m = ReadManifest(engine.storage(), "step1", "v1", 0);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->files.size(), 1u);
  EXPECT_TRUE(
      VerifyDataFile(engine.storage(), DataFilePath("step1", "v1", 0, "model"), m->files[0]).ok());
  EXPECT_TRUE(fs::exists(dir.path() + "/checkpointHistories.csv"));
  auto versions = engine.Versions();
  ASSERT_EQ(versions.size(), 1u);
  EXPECT_TRUE(versions[0].persisted);
}

TEST(EngineTest, MemoryOnlyVersionIsReadableThroughALease) {
  auto e = Engine::Open(Options(""));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  EXPECT_EQ(engine.storage(), nullptr);
  auto obj = MakeObject({10, 70000}, 3);
  ASSERT_TRUE(engine.Stage("t", "v1", "n", obj.records).ok());
  EXPECT_TRUE(engine.Versions().empty());  // not committed yet
  ASSERT_TRUE(engine.Commit("t", "v1", 1, false).ok());
  EXPECT_EQ(engine.Commit("t", "v1", 1, true).code(), StatusCode::kOk);  // already committed
  auto lease = engine.Pin("t", "v1", "n");
  ASSERT_TRUE(lease.ok());
  const auto& refs = (*lease)->records();
  ASSERT_EQ(refs.size(), 2u);
  EXPECT_EQ(std::memcmp((*lease)->data() + refs[1].offset, obj.payloads[1].data(), 70000), 0);
  EXPECT_EQ(refs[1].offset % 4096, 0u);
  EXPECT_EQ(engine.Pin("t", "v1", "other").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(engine.Commit("t", "v2", 2, true).code(), StatusCode::kFailedPrecondition);  // no store
}

TEST(EngineTest, RejectsBadNamesAndDuplicates) {
  auto e = Engine::Open(Options(""));
  ASSERT_TRUE(e.ok());
  auto obj = MakeObject({10}, 0);
  EXPECT_EQ((*e)->Stage("../x", "v", "n", obj.records).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*e)->Stage("t", "v", "a/b", obj.records).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE((*e)->Stage("t", "v", "n", obj.records).ok());
  EXPECT_EQ((*e)->Stage("t", "v", "n", obj.records).status().code(), StatusCode::kAlreadyExists);
}

TEST(EngineTest, ReclaimableMemoryIsAllButTheNewestVersionHeldInMemoryOnly) {
  TempDir dir;
  auto e = Engine::Open(Options(dir.path(), 8 << 20));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  auto big = MakeObject({5 << 20}, 1);
  ASSERT_TRUE(engine.Stage("t", "v1", "model", big.records).ok());
  EXPECT_EQ(engine.memory_reclaimable(), 0u);  // not committed
  ASSERT_TRUE(engine.Commit("t", "v1", 1, false).ok());
  EXPECT_EQ(engine.memory_reclaimable(), 0u);  // the newest, in memory only: it stays
  const uint64_t v1 = engine.memory_used();
  auto small = MakeObject({1 << 20}, 2);
  ASSERT_TRUE(engine.Stage("t", "v2", "model", small.records).ok());
  ASSERT_TRUE(engine.Commit("t", "v2", 2, false).ok());
  EXPECT_EQ(engine.memory_reclaimable(), v1);  // an older one held in memory only may go
  ASSERT_TRUE(engine.Persist("t", "v2").ok());
  ASSERT_TRUE(engine.Flush(60).ok());
  EXPECT_EQ(engine.memory_reclaimable(), engine.memory_used());  // the newest is durable
  EXPECT_GT(engine.memory_used(), v1);
}

TEST(EngineTest, AVersionHeldInMemoryOnlyMayGoOnceANewerOneInTheStoreLeftMemory) {
  TempDir dir;
  auto e = Engine::Open(Options(dir.path(), 8 << 20));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  auto old = MakeObject({5 << 20}, 1);
  ASSERT_TRUE(engine.Stage("t", "v1", "model", old.records).ok());
  ASSERT_TRUE(engine.Commit("t", "v1", 1, false).ok());
  auto newer = MakeObject({1 << 20}, 2);
  ASSERT_TRUE(engine.Stage("t", "v2", "model", newer.records).ok());
  ASSERT_TRUE(engine.Commit("t", "v2", 2, true).ok());
  ASSERT_TRUE(engine.Flush(60).ok());  // committed in the store
  // Room for v3 is made by evicting v2 (durable) and then v1: once v2 left, v1 is not the
  // newest checkpoint, which stays in memory only while it is not durable.
  auto next = MakeObject({6 << 20}, 3);
  auto info = engine.Stage("t", "v3", "model", next.records);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_FALSE(info->streamed);
  EXPECT_FALSE(engine.MustPersist("t", "v3"));
}

TEST(EngineTest, StateLargerThanTheBudgetStreamsThroughIt) {
  TempDir dir;
  auto e = Engine::Open(Options(dir.path(), 4 << 20));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  auto obj = MakeObject({1000, 9 << 20, 3 << 20, 12345}, 5);
  auto info = engine.Stage("big", "v1", "model", obj.records);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(info->streamed);
  EXPECT_TRUE(engine.MustPersist("big", "v1"));
  EXPECT_EQ(engine.Commit("big", "v1", 1, false).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine.Commit("big", "v1", 1, true).ok());
  ASSERT_TRUE(engine.Flush(60).ok());
  ExpectStored(engine.storage(), DataFilePath("big", "v1", 0, "model"), obj);
  auto m = ReadManifest(engine.storage(), "big", "v1", 0);
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(
      VerifyDataFile(engine.storage(), DataFilePath("big", "v1", 0, "model"), m->files[0]).ok());
  EXPECT_EQ(engine.memory_used(), 0u);
}

TEST(EngineTest, WithoutAStoreAnOversizedStateIsAClearError) {
  auto e = Engine::Open(Options("", 2 << 20));
  ASSERT_TRUE(e.ok());
  auto obj = MakeObject({4 << 20}, 0);
  auto r = (*e)->Stage("t", "v", "n", obj.records);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("NEBULA_MEMORY_BUFFER_SIZE"), std::string::npos);
}

TEST(EngineTest, AnObjectThatFitsAloneButNotBesideEarlierOnesStreams) {
  TempDir dir;
  auto e = Engine::Open(Options(dir.path(), 8 << 20));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  auto model = MakeObject({1000, 5 << 20}, 1), optimizer = MakeObject({1000, 5 << 20}, 2);
  auto first = engine.Stage("t", "v1", "model", model.records);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_FALSE(first->streamed);
  // Less than half the budget is left: the window shrinks to what is free.
  auto second = engine.Stage("t", "v1", "optimizer", optimizer.records);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_TRUE(second->streamed);
  ASSERT_TRUE(engine.Commit("t", "v1", 1, true).ok());
  // Loadable once committed: the model from memory, the optimizer from its data file.
  auto versions = engine.Versions();
  ASSERT_EQ(versions.size(), 1u);
  EXPECT_FALSE(versions[0].in_memory);
  EXPECT_TRUE(versions[0].loadable);
  ASSERT_EQ(versions[0].streamed.size(), 1u);
  EXPECT_EQ(versions[0].streamed[0].name, "optimizer");
  EXPECT_TRUE(VerifyDataFile(engine.storage(), DataFilePath("t", "v1", 0, "optimizer"),
                             versions[0].streamed[0])
                  .ok());
  ExpectStored(engine.storage(), DataFilePath("t", "v1", 0, "optimizer"), optimizer);
  EXPECT_TRUE(engine.Pin("t", "v1", "model").ok());
  ASSERT_TRUE(engine.Flush(60).ok());
  ExpectStored(engine.storage(), DataFilePath("t", "v1", 0, "model"), model);
}

TEST(EngineTest, WithNoMemoryLeftEvenForTheWindowStagingFailsAndGivesNothingAway) {
  TempDir dir;
  auto arena = Arena::Create(4 << 20, false);
  ASSERT_TRUE(arena.ok());
  std::shared_ptr<Arena> shared = std::move(arena).value();
  auto o = Options(dir.path());
  o.arena = shared;
  o.reserve_timeout_seconds = 0;
  auto e = Engine::Open(o);
  ASSERT_TRUE(e.ok());
  auto all = shared->TryReserve(shared->capacity());  // another engine of the node holds it
  ASSERT_TRUE(all.ok());
  auto obj = MakeObject({1000, 1 << 20}, 3);
  auto r = (*e)->Stage("t", "v1", "model", obj.records);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE((*e)->Versions().empty());
  shared->Release(*all);
  EXPECT_EQ(shared->used(), 0u);
  ASSERT_TRUE((*e)->Stage("t", "v2", "model", obj.records).ok());
  ASSERT_TRUE((*e)->Commit("t", "v2", 1, true).ok());
  ASSERT_TRUE((*e)->Flush(60).ok());
  ExpectStored((*e)->storage(), DataFilePath("t", "v2", 0, "model"), obj);
}

TEST(EngineTest, BackPressureRecyclesMemoryOfPersistedVersions) {
  TempDir dir;
  auto e = Engine::Open(Options(dir.path(), 8 << 20));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  for (int i = 0; i < 8; ++i) {
    auto obj = MakeObject({100, 3 << 20}, static_cast<uint8_t>(i));
    std::string tag = "t" + std::to_string(i);
    auto info = engine.Stage(tag, "v", "n", obj.records);
    ASSERT_TRUE(info.ok()) << i << ": " << info.status().ToString();
    EXPECT_FALSE(info->streamed);
    ASSERT_TRUE(engine.Commit(tag, "v", i + 1, true).ok());
  }
  ASSERT_TRUE(engine.Flush(60).ok());
  auto cat = ReadCatalog(engine.storage());
  ASSERT_TRUE(cat.ok());
  EXPECT_EQ(cat->entries.size(), 8u);
  EXPECT_LE(engine.memory_used(), engine.memory_capacity());
}

TEST(EngineTest, ReusesMemoryOfPersistedVersionsBeforeTakingMore) {
  TempDir dir;
  auto e = Engine::Open(Options(dir.path(), 64 << 20));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  uint64_t one = 0;
  for (int i = 0; i < 6; ++i) {
    auto obj = MakeObject({100, 4 << 20}, static_cast<uint8_t>(i));
    std::string tag = "t" + std::to_string(i);
    auto info = engine.Stage(tag, "v", "n", obj.records);
    ASSERT_TRUE(info.ok()) << info.status().ToString();
    ASSERT_TRUE(engine.Commit(tag, "v", i + 1, true).ok());
    ASSERT_TRUE(engine.Flush(60).ok());
    if (i == 0) one = engine.memory_resident();
  }
  // Each checkpoint was persisted before the next: the memory of one was enough, even
  // though the budget holds many.
  EXPECT_GT(one, 4u << 20);
  EXPECT_EQ(engine.memory_resident(), one);
  auto versions = engine.Versions();
  ASSERT_FALSE(versions.empty());
  EXPECT_EQ(versions.back().tag, "t5");
  // Memory-only versions (never to be persisted) stay while the budget has room.
  auto mem = Engine::Open(Options("", 64 << 20));
  ASSERT_TRUE(mem.ok());
  for (int i = 0; i < 3; ++i) {
    auto o = MakeObject({100, 4 << 20}, static_cast<uint8_t>(i));
    std::string tag = "k" + std::to_string(i);
    ASSERT_TRUE((*mem)->Stage(tag, "v", "n", o.records).ok());
    ASSERT_TRUE((*mem)->Commit(tag, "v", i + 1, false).ok());
  }
  EXPECT_EQ((*mem)->Versions().size(), 3u);
  EXPECT_GE((*mem)->memory_resident(), 3 * (4u << 20));
  // What is not committed yet is never evicted: then the arena grows.
  auto obj = MakeObject({100, 4 << 20}, 9);
  auto held = Engine::Open(Options("", 64 << 20));
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE((*held)->Stage("m", "v", "a", obj.records).ok());
  ASSERT_TRUE((*held)->Stage("m", "v", "b", obj.records).ok());
  EXPECT_GE((*held)->memory_resident(), 2 * (4u << 20));
}

TEST(EngineTest, RetentionKeepsTheNewestCommittedVersions) {
  TempDir dir;
  auto opts = Options(dir.path());
  opts.retention = 2;
  auto e = Engine::Open(opts);
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  // Tags whose names sort opposite to their commit order.
  std::vector<std::string> tags = {"z", "y", "x", "w"};
  for (size_t i = 0; i < tags.size(); ++i) {
    auto obj = MakeObject({64}, static_cast<uint8_t>(i));
    ASSERT_TRUE(engine.Stage(tags[i], "v", "n", obj.records).ok());
    ASSERT_TRUE(engine.Commit(tags[i], "v", i + 1, true).ok());
    ASSERT_TRUE(engine.Flush(60).ok());
  }
  auto cat = ReadCatalog(engine.storage());
  ASSERT_TRUE(cat.ok());
  ASSERT_EQ(cat->entries.size(), 2u);
  EXPECT_EQ(cat->entries[0].commit.tag, "x");
  EXPECT_EQ(cat->entries[1].commit.tag, "w");
  EXPECT_FALSE(fs::exists(dir.path() + "/z"));
  // Memory keeps at most `retention` committed versions too.
  EXPECT_LE(engine.Versions().size(), 2u);
}

// Two ranks' engines on one store, and an object for each.
class TwoRanksTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(e[0] && e[1]); }

  TempDir dir;
  std::vector<std::unique_ptr<Engine>> e = OpenTwoRanks(Options(dir.path()));
  Object a = MakeObject({100, 4096}, 1), b = MakeObject({200, 5000}, 2);
};

TEST_F(TwoRanksTest, CommitOnlyWhenBothPersisted) {
  ASSERT_TRUE(e[0]->Stage("s", "v", "model", a.records).ok());
  ASSERT_TRUE(e[0]->Commit("s", "v", 1, true).ok());
  // Rank 0 alone cannot commit.
  usleep(100 * 1000);
  auto st = e[0]->storage()->Exists(CommitMarkerPath("s", "v"));
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(*st);
  ASSERT_TRUE(e[1]->Stage("s", "v", "optim", b.records).ok());
  ASSERT_TRUE(e[1]->Commit("s", "v", 1, true).ok());
  ASSERT_TRUE(e[0]->Flush(60).ok());
  ASSERT_TRUE(e[1]->Flush(60).ok());
  auto cat = ReadCatalog(e[0]->storage());
  ASSERT_TRUE(cat.ok());
  ASSERT_EQ(cat->entries.size(), 1u);
  EXPECT_EQ(cat->entries[0].commit.world_size, 2u);
  ExpectStored(e[0]->storage(), DataFilePath("s", "v", 1, "optim"), b);
}

TEST(EngineTest, RankOneFlushesVersionsThatRetentionRetiredBeforeItLooked) {
  // Rank 0 commits and retires t1 and t2 while rank 1 never flushes; rank 1's flush must
  // count them as committed instead of waiting for markers that are gone.
  TempDir dir;
  auto o = Options(dir.path());
  o.retention = 1;
  auto e = OpenTwoRanks(o);
  ASSERT_TRUE(e[0] && e[1]);
  std::vector<Object> objects;
  for (uint8_t i = 0; i < 6; ++i) objects.push_back(MakeObject({64, 4096}, i));
  const std::vector<std::string> tags = {"t1", "t2", "t3"};
  for (size_t i = 0; i < tags.size(); ++i) {
    ASSERT_TRUE(e[0]->Stage(tags[i], "v", "a", objects[2 * i].records).ok());
    ASSERT_TRUE(e[1]->Stage(tags[i], "v", "b", objects[2 * i + 1].records).ok());
    ASSERT_TRUE(e[0]->Commit(tags[i], "v", i + 1, true).ok());
    ASSERT_TRUE(e[1]->Commit(tags[i], "v", i + 1, true).ok());
    ASSERT_TRUE(e[0]->Flush(60).ok());
  }
  EXPECT_FALSE(fs::exists(dir.path() + "/t1"));
  EXPECT_FALSE(fs::exists(dir.path() + "/t2"));
  Status st = e[1]->Flush(5);
  EXPECT_TRUE(st.ok()) << st.ToString();
  auto cat = ReadCatalog(e[0]->storage());
  ASSERT_TRUE(cat.ok());
  ASSERT_EQ(cat->entries.size(), 1u);
  EXPECT_EQ(cat->entries[0].commit.tag, "t3");
}

TEST_F(TwoRanksTest, RankOneGivesUpACommitRankZeroNeverMadeAndKeepsItsFiles) {
  ASSERT_TRUE(e[1]->Stage("s", "v", "optim", b.records).ok());
  ASSERT_TRUE(e[1]->Commit("s", "v", 1, true).ok());
  // Rank 1 persists its part, then waits for a marker that rank 0 never writes.
  EXPECT_EQ(e[1]->Flush(0.3).code(), StatusCode::kCancelled);
  auto r0 = e[0]->GiveUpCommit("s", "v");  // rank 0 never waits for a marker
  ASSERT_TRUE(r0.ok());
  EXPECT_FALSE(*r0);
  auto gave_up = e[1]->GiveUpCommit("s", "v");
  ASSERT_TRUE(gave_up.ok()) << gave_up.status().ToString();
  EXPECT_TRUE(*gave_up);
  Status st = e[1]->Flush(5);  // nothing is awaited, and the caller reported the failure
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(e[1]->TakeErrors().empty());
  ASSERT_EQ(e[1]->Versions().size(), 1u);
  EXPECT_TRUE(e[1]->Versions()[0].failed);
  // Its files stay: rank 0, slower than thought, still commits the version whole.
  ExpectStored(e[1]->storage(), DataFilePath("s", "v", 1, "optim"), b);
  ASSERT_TRUE(e[0]->Stage("s", "v", "model", a.records).ok());
  ASSERT_TRUE(e[0]->Commit("s", "v", 1, true).ok());
  st = e[0]->Flush(60);
  ASSERT_TRUE(st.ok()) << st.ToString();
  auto cat = ReadCatalog(e[0]->storage());
  ASSERT_TRUE(cat.ok());
  ASSERT_EQ(cat->entries.size(), 1u);
  ExpectStored(e[0]->storage(), DataFilePath("s", "v", 1, "optim"), b);
  // A version committed in the store (rank 1 has not looked yet) is not given up.
  ASSERT_TRUE(e[1]->Stage("s", "w", "optim", b.records).ok());
  ASSERT_TRUE(e[0]->Stage("s", "w", "model", a.records).ok());
  ASSERT_TRUE(e[1]->Commit("s", "w", 2, true).ok());
  ASSERT_TRUE(e[0]->Commit("s", "w", 2, true).ok());
  ASSERT_TRUE(e[0]->Flush(60).ok());
  gave_up = e[1]->GiveUpCommit("s", "w");
  ASSERT_TRUE(gave_up.ok());
  EXPECT_FALSE(*gave_up);
  ASSERT_TRUE(e[1]->Flush(60).ok());
  for (const auto& v : e[1]->Versions())
    if (v.version == "w") EXPECT_FALSE(v.failed);
}

TEST_F(TwoRanksTest, FlushVersionWaitsForThatVersionAlone) {
  // Rank 1 persists "v", whose marker rank 0 never writes (it died before committing).
  ASSERT_TRUE(e[1]->Stage("s", "v", "optim", b.records).ok());
  ASSERT_TRUE(e[1]->Commit("s", "v", 1, true).ok());
  // Both ranks commit "w"; rank 1 waits for it alone, and a whole Flush() still waits.
  ASSERT_TRUE(e[1]->Stage("s", "w", "optim", b.records).ok());
  ASSERT_TRUE(e[0]->Stage("s", "w", "model", a.records).ok());
  ASSERT_TRUE(e[1]->Commit("s", "w", 2, true).ok());
  ASSERT_TRUE(e[0]->Commit("s", "w", 2, true).ok());
  Status st = e[1]->FlushVersion("s", "w", 60);
  ASSERT_TRUE(st.ok()) << st.ToString();
  for (const auto& v : e[1]->Versions()) EXPECT_EQ(v.store_committed, v.version == "w");
  EXPECT_EQ(e[1]->Flush(0.3).code(), StatusCode::kCancelled);
  EXPECT_EQ(e[1]->FlushVersion("s", "v", 0.3).code(), StatusCode::kCancelled);
  // Nothing to wait for: a version never queued for the store, or not known.
  ASSERT_TRUE(e[0]->Stage("s", "m", "model", a.records).ok());
  ASSERT_TRUE(e[0]->Commit("s", "m", 3, false).ok());
  EXPECT_TRUE(e[0]->FlushVersion("s", "m", 0).ok());
  EXPECT_TRUE(e[0]->FlushVersion("s", "none", 0).ok());
  ASSERT_TRUE(e[0]->Flush(60).ok());
}

TEST(EngineTest, FlushVersionReportsThatVersionsFailureOnce) {
  FaultyStore store;
  auto e = Open(OptionsOn(store));
  ASSERT_TRUE(e);
  auto bad = MakeObject({100, 70000}, 1);
  ASSERT_TRUE(e->Stage("bad", "v", "n", bad.records).ok());
  store.fault->FailAfter(StorageOp::kWrite, 0, Status::NoSpace("disk full (injected)"));
  ASSERT_TRUE(e->Commit("bad", "v", 1, true).ok());
  Status st = e->FlushVersion("bad", "v", 60);
  EXPECT_EQ(st.code(), StatusCode::kIOError) << st.ToString();
  EXPECT_NE(st.message().find("'bad'"), std::string::npos) << st.ToString();
  EXPECT_TRUE(e->FlushVersion("bad", "v", 60).ok());  // reported once
  EXPECT_TRUE(e->Flush(60).ok());
}

TEST(EngineTest, StoreFailureIsReportedAndEarlierCommitsStayIntact) {
  FaultyStore store;
  auto e = Open(OptionsOn(store));
  ASSERT_TRUE(e);
  Engine& engine = *e;
  auto good = MakeObject({100, 70000}, 1);
  ASSERT_TRUE(engine.Stage("good", "v", "n", good.records).ok());
  ASSERT_TRUE(engine.Commit("good", "v", 1, true).ok());
  ASSERT_TRUE(engine.Flush(60).ok());
  store.fault->FailAfter(StorageOp::kWrite, 0, Status::NoSpace("disk full (injected)"));
  auto bad = MakeObject({100, 70000}, 2);
  ASSERT_TRUE(engine.Stage("bad", "v", "n", bad.records).ok());
  ASSERT_TRUE(engine.Commit("bad", "v", 2, true).ok());
  Status flushed = engine.Flush(60);
  EXPECT_FALSE(flushed.ok());
  auto errors = engine.TakeErrors();
  ASSERT_FALSE(errors.empty());
  EXPECT_EQ(errors[0].code(), StatusCode::kNoSpace);
  store.fault->ClearFailures();
  auto cat = ReadCatalog(store.fault.get());
  ASSERT_TRUE(cat.ok());
  ASSERT_EQ(cat->entries.size(), 1u);
  EXPECT_EQ(cat->entries[0].commit.tag, "good");
  ExpectStored(store.fault.get(), DataFilePath("good", "v", 0, "n"), good);
  bool failed_row = false;
  for (const auto& r : engine.History()) failed_row |= r.outcome.rfind("failed", 0) == 0;
  EXPECT_TRUE(failed_row);
  // The failed version is still in memory and can be persisted again.
  ASSERT_TRUE(engine.Persist("bad", "v").ok());
  ASSERT_TRUE(engine.Flush(60).ok());
  cat = ReadCatalog(store.fault.get());
  ASSERT_TRUE(cat.ok());
  EXPECT_EQ(cat->entries.size(), 2u);
}

}  // namespace
}  // namespace nebulite

namespace nebulite {
namespace {

using engine_test::ExpectStored;
using engine_test::MakeObject;
using engine_test::Object;
using engine_test::OpenTwoRanks;
using engine_test::Options;
using engine_test::TempDir;

std::vector<format::RecordSpec> Specs(const Object& o) {
  std::vector<format::RecordSpec> specs;
  for (const auto& r : o.records) specs.push_back({r.name, r.size});
  return specs;
}

// Fills a reservation as another process mapping the arena would; returns the CRCs.
std::vector<uint32_t> Fill(const Engine& e, const Reservation& r, const Object& o) {
  uint8_t* image = e.arena().base() + r.arena_offset;
  std::vector<uint32_t> crcs;
  for (size_t i = 0; i < o.records.size(); ++i) {
    std::memcpy(image + r.records[i].offset, o.payloads[i].data(), o.payloads[i].size());
    crcs.push_back(Crc32(0, o.payloads[i].data(), o.payloads[i].size()));
  }
  return crcs;
}

// Committing never waits for the store: a version kept in memory only has its history
// rows written by the persister's thread, and the order of the next commit comes from the
// numbers the engine gave and claimed (NewestSeq), not from a listing of the store.
TEST(EngineTest, CommittingMakesNoRequestToTheStoreOnTheCallersThread) {
  FaultyStore store;
  auto e = Open(OptionsOn(store));
  ASSERT_TRUE(e);
  Engine& engine = *e;
  EXPECT_EQ(engine.NewestSeq(), 0u);
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<int> on_caller{0};
  store.fault->SetHook([&](StorageOp, const std::string&) {
    if (std::this_thread::get_id() == caller) ++on_caller;
    return Status::OK();
  });
  auto obj = MakeObject({100, 70000}, 1);
  ASSERT_TRUE(engine.Stage("mem", "v1", "n", obj.records).ok());
  ASSERT_TRUE(engine.Commit("mem", "v1", 3, /*persist=*/false).ok());
  EXPECT_EQ(on_caller.load(), 0);
  EXPECT_EQ(engine.NewestSeq(), 3u);
  ASSERT_TRUE(engine.Flush(60).ok());  // and the history row is written
  store.fault->SetHook(nullptr);
  std::string csv = Val(store.base->ReadFile(kHistoryFile, 1 << 20));
  EXPECT_NE(csv.find(",mem,v1,n,0,"), std::string::npos) << csv;
  EXPECT_NE(csv.find(",memory,in_memory\n"), std::string::npos) << csv;

  // Another writer claimed number 9: the next commit in the store claims above it, and
  // NewestSeq says so.
  ASSERT_TRUE(store.base->CreateFileExclusive(".nebulite/seq/00000000000000000009", "").ok());
  ASSERT_TRUE(engine.Stage("disk", "v2", "n", obj.records).ok());
  ASSERT_TRUE(engine.Commit("disk", "v2", 4, /*persist=*/true).ok());
  EXPECT_GE(engine.NewestSeq(), 4u);  // 10 once the persister claimed it
  ASSERT_TRUE(engine.Flush(60).ok());
  EXPECT_EQ(engine.NewestSeq(), 10u);
  auto cat = ReadCatalog(store.base.get());
  ASSERT_TRUE(cat.ok());
  ASSERT_EQ(cat->entries.size(), 1u);
  EXPECT_EQ(cat->entries[0].commit.seq, 10u);
}

TEST(EngineReserveTest, ReservedAndFilledObjectsPersistLikeStagedOnes) {
  TempDir dir;
  auto e = Engine::Open(Options(dir.path()));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  auto obj = MakeObject({300, 70000, 5 << 20}, 4);
  auto r = engine.Reserve("t", "v", "model", Specs(obj));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->arena_offset % 4096, 0u);
  ASSERT_EQ(r->records.size(), 3u);
  EXPECT_EQ(engine.Commit("t", "v", 1, true).code(), StatusCode::kFailedPrecondition);
  auto crcs = Fill(engine, *r, obj);
  EXPECT_EQ(engine.Seal("t", "v", "model", true, {1, 2}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(engine.Seal("t", "v", "model", /*persist_now=*/true, crcs).ok());
  EXPECT_EQ(engine.Seal("t", "v", "model", true, crcs).code(), StatusCode::kNotFound);
  ASSERT_TRUE(engine.Commit("t", "v", 1, true).ok());
  ASSERT_TRUE(engine.Flush(60).ok());
  ExpectStored(engine.storage(), DataFilePath("t", "v", 0, "model"), obj);
  auto lease = engine.Pin("t", "v", "model");
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(std::memcmp((*lease)->data() + (*lease)->records()[1].offset, obj.payloads[1].data(),
                        obj.payloads[1].size()),
            0);
}

TEST(EngineReserveTest, DiscardAndAbandonGiveTheMemoryBack) {
  auto e = Engine::Open(Options("", 16 << 20));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  auto obj = MakeObject({100, 3 << 20}, 1);
  ASSERT_TRUE(engine.Reserve("t", "v", "a", Specs(obj)).ok());
  ASSERT_TRUE(engine.Reserve("t", "v", "b", Specs(obj)).ok());
  EXPECT_GT(engine.memory_used(), 6u << 20);
  ASSERT_TRUE(engine.Discard("t", "v", "a").ok());
  EXPECT_EQ(engine.Discard("t", "v", "a").code(), StatusCode::kNotFound);
  engine.Abandon("t", "v");  // "b" was never sealed: its writer died
  EXPECT_EQ(engine.memory_used(), 0u);
  EXPECT_TRUE(engine.Versions().empty());
}

// A reservation that may not wait fails at once where the memory would come back only
// when an unsealed reservation is sealed; one that may wait gets it once that happens.
TEST(EngineReserveTest, AReservationThatMayNotWaitFailsAtOnceWhereMemoryIsOnItsWayBack) {
  auto e = Engine::Open(Options("", 8 << 20));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  auto obj = MakeObject({100, 5 << 20}, 1);
  auto first = engine.Reserve("t", "v1", "a", Specs(obj));
  ASSERT_TRUE(first.ok());
  auto at_once = engine.Reserve("t", "v2", "a", Specs(obj), /*wait_for_memory=*/false);
  EXPECT_EQ(at_once.status().code(), StatusCode::kResourceExhausted);
  std::thread sealer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto crcs = Fill(engine, *first, obj);
    ASSERT_TRUE(engine.Seal("t", "v1", "a", false, crcs).ok());
    engine.Abandon("t", "v1");
  });
  auto waited = engine.Reserve("t", "v2", "a", Specs(obj));
  sealer.join();
  EXPECT_TRUE(waited.ok()) << waited.status().ToString();
}

TEST(EngineReserveTest, EnginesOfOneNodeShareOneBudget) {
  TempDir dir;
  auto arena = Arena::Create(8 << 20, false, /*shared=*/true);
  ASSERT_TRUE(arena.ok());
  std::shared_ptr<Arena> shared = std::move(arena).value();
  EXPECT_GE(shared->fd(), 0);
  auto o = Options(dir.path());
  o.arena = shared;
  auto e = OpenTwoRanks(o);
  ASSERT_TRUE(e[0] && e[1]);
  auto a = MakeObject({100, 3 << 20}, 1), b = MakeObject({100, 3 << 20}, 2);
  ASSERT_TRUE(e[0]->Stage("s", "v", "a", a.records).ok());
  ASSERT_TRUE(e[1]->Stage("s", "v", "b", b.records).ok());
  EXPECT_EQ(e[0]->memory_used(), e[1]->memory_used());  // one budget, seen by both
  EXPECT_GT(shared->used(), 6u << 20);
  ASSERT_TRUE(e[0]->Commit("s", "v", 1, true).ok());
  ASSERT_TRUE(e[1]->Commit("s", "v", 1, true).ok());
  ASSERT_TRUE(e[0]->Flush(60).ok());
  ASSERT_TRUE(e[1]->Flush(60).ok());
  ExpectStored(e[0]->storage(), DataFilePath("s", "v", 1, "b"), b);
}

TEST(EngineReserveTest, AnEngineShortOfMemoryTakesThatOfAnotherEnginesPersistedVersions) {
  // Two engines of one node (ranks of one job; here with two stores) share an 8 MiB budget.
  // Engine 1's version is persisted; engine 0 then needs more than is free. It takes the
  // persisted version's memory (that version is then in engine 1's store only) rather
  // than stream its object, or wait for memory that only engine 1 could give back.
  TempDir dir0, dir1;
  auto arena = Arena::Create(8 << 20, false, /*shared=*/true);
  ASSERT_TRUE(arena.ok());
  std::shared_ptr<Arena> shared = std::move(arena).value();
  auto o0 = Options(dir0.path()), o1 = Options(dir1.path());
  o0.arena = o1.arena = shared;
  auto e0 = Engine::Open(o0), e1 = Engine::Open(o1);
  ASSERT_TRUE(e0.ok() && e1.ok());
  auto a = MakeObject({100, 5 << 20}, 1), b = MakeObject({100, 5 << 20}, 2);
  ASSERT_TRUE((*e1)->Stage("s", "v1", "b", b.records).ok());
  ASSERT_TRUE((*e1)->Commit("s", "v1", 1, true).ok());
  ASSERT_TRUE((*e1)->Flush(60).ok());
  auto staged = (*e0)->Stage("s", "v1", "a", a.records);
  ASSERT_TRUE(staged.ok()) << staged.status().ToString();
  EXPECT_FALSE(staged->streamed);
  EXPECT_TRUE((*e1)->Versions().empty());  // it left memory: it is in the store only
  ASSERT_TRUE((*e0)->Commit("s", "v1", 1, true).ok());
  ASSERT_TRUE((*e0)->Flush(60).ok());
  ExpectStored((*e0)->storage(), DataFilePath("s", "v1", 0, "a"), a);
  ExpectStored((*e1)->storage(), DataFilePath("s", "v1", 0, "b"), b);
  // A version held in memory only is never taken by another engine.
  ASSERT_TRUE((*e1)->Stage("t", "v2", "b", b.records).ok());
  ASSERT_TRUE((*e1)->Commit("t", "v2", 2, false).ok());
  (*e0).reset();  // its memory goes back, and its room maker with it
  EXPECT_FALSE(shared->MakeRoom(0));
  auto versions = (*e1)->Versions();
  ASSERT_EQ(versions.size(), 1u);
  EXPECT_TRUE(versions[0].in_memory);
}

}  // namespace
}  // namespace nebulite

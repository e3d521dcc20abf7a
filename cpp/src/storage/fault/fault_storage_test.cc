// FaultStorage: what survives Crash(), and failure injection.
#include "nebulite/fault_storage.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "base/test_util.h"

namespace nebulite {
namespace {

class FaultStorageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = NewMemoryStorage();
    fs_ = FaultStorage::Wrap(base_.get());
  }

  bool Exists(const std::string& path) {
    auto r = fs_->Exists(path);
    EXPECT_TRUE(r.ok());
    return r.ok() && *r;
  }
  std::string Get(const std::string& path) {
    auto r = fs_->ReadFile(path, 1 << 20);
    return r.ok() ? *r : "<" + r.status().ToString() + ">";
  }

  std::unique_ptr<Storage> base_;
  std::unique_ptr<FaultStorage> fs_;
};

TEST_F(FaultStorageTest, UnsyncedWritesVanishSyncedStay) {
  ASSERT_TRUE(fs_->CreateDirs("d").ok());
  ASSERT_TRUE(fs_->SyncDir("").ok());
  auto f = fs_->NewWritableFile("d/f", 0);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(fs_->SyncDir("d").ok());  // the file's entry is durable
  ASSERT_TRUE((*f)->WriteAt(0, "synced", 6).ok());
  ASSERT_TRUE((*f)->Sync().ok());
  ASSERT_TRUE((*f)->WriteAt(6, "-lost", 5).ok());
  EXPECT_EQ(Get("d/f"), "synced");  // reads see synced bytes only
  fs_->Crash();
  EXPECT_EQ(Get("d/f"), "synced");
  // The open file is dead after the crash.
  EXPECT_FALSE((*f)->WriteAt(0, "x", 1).ok());
  EXPECT_FALSE((*f)->Sync().ok());
}

TEST_F(FaultStorageTest, CreationWithoutSyncDirIsUndone) {
  auto f = fs_->NewWritableFile("t/v/rank0/data", 0);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->WriteAt(0, "abc", 3).ok());
  ASSERT_TRUE((*f)->Sync().ok());  // data durable, but not the entry nor the directories
  ASSERT_TRUE((*f)->Close().ok());
  ASSERT_TRUE(fs_->SyncDir("t/v/rank0").ok());
  ASSERT_TRUE(fs_->SyncDir("t/v").ok());
  // "t" never got its entry in the root synced: the whole tree goes.
  fs_->Crash();
  EXPECT_FALSE(Exists("t"));

  f = fs_->NewWritableFile("t/v/rank0/data", 0);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->WriteAt(0, "abc", 3).ok());
  ASSERT_TRUE((*f)->Sync().ok());
  ASSERT_TRUE((*f)->Close().ok());
  for (const char* d : {"t/v/rank0", "t/v", "t", ""}) ASSERT_TRUE(fs_->SyncDir(d).ok());
  fs_->Crash();
  EXPECT_EQ(Get("t/v/rank0/data"), "abc");
}

TEST_F(FaultStorageTest, RenameWithoutSyncDirIsUndone) {
  ASSERT_TRUE(fs_->WriteFileAtomic("m/target", "old").ok());
  ASSERT_TRUE(fs_->SyncDir("").ok());
  ASSERT_TRUE(fs_->WriteFileAtomic("m/src", "new").ok());
  ASSERT_TRUE(fs_->Rename("m/src", "m/target").ok());
  EXPECT_EQ(Get("m/target"), "new");
  fs_->Crash();
  EXPECT_EQ(Get("m/target"), "old");  // the overwritten target comes back
  EXPECT_EQ(Get("m/src"), "new");     // and the source is where it was

  ASSERT_TRUE(fs_->Rename("m/src", "m/target").ok());
  ASSERT_TRUE(fs_->SyncDir("m").ok());
  fs_->Crash();
  EXPECT_EQ(Get("m/target"), "new");
  EXPECT_FALSE(Exists("m/src"));
}

TEST_F(FaultStorageTest, DeleteWithoutSyncDirIsUndone) {
  ASSERT_TRUE(fs_->WriteFileAtomic("x/COMMITTED", "marker").ok());
  ASSERT_TRUE(fs_->SyncDir("").ok());
  ASSERT_TRUE(fs_->Delete("x/COMMITTED").ok());
  EXPECT_FALSE(Exists("x/COMMITTED"));
  fs_->Crash();
  EXPECT_EQ(Get("x/COMMITTED"), "marker");
  ASSERT_TRUE(fs_->Delete("x/COMMITTED").ok());
  ASSERT_TRUE(fs_->SyncDir("x").ok());
  fs_->Crash();
  EXPECT_FALSE(Exists("x/COMMITTED"));
}

TEST_F(FaultStorageTest, WriteFileAtomicIsDurableWhenItReturns) {
  ASSERT_TRUE(fs_->CreateDirs("a").ok());
  ASSERT_TRUE(fs_->SyncDir("").ok());
  ASSERT_TRUE(fs_->WriteFileAtomic("a/f", "v1").ok());
  fs_->Crash();
  EXPECT_EQ(Get("a/f"), "v1");
  // It runs as primitives: create, write, sync, rename, syncdir.
  const int creates = fs_->Count(StorageOp::kCreate);
  const int renames = fs_->Count(StorageOp::kRename);
  const int syncdirs = fs_->Count(StorageOp::kSyncDir);
  ASSERT_TRUE(fs_->WriteFileAtomic("a/f", "v2").ok());
  EXPECT_EQ(fs_->Count(StorageOp::kCreate), creates + 1);
  EXPECT_EQ(fs_->Count(StorageOp::kRename), renames + 1);
  EXPECT_EQ(fs_->Count(StorageOp::kSyncDir), syncdirs + 1);
}

TEST_F(FaultStorageTest, CrashInsideWriteFileAtomicLeavesOldOrNew) {
  ASSERT_TRUE(fs_->WriteFileAtomic("a/f", "old").ok());
  ASSERT_TRUE(fs_->SyncDir("").ok());
  for (int k = 0; k < 12; ++k) {
    SCOPED_TRACE(k);
    fs_->FailAfter(StorageOp::kAny, k, Status::IOError("power cut"));
    Status st = fs_->WriteFileAtomic("a/f", "new");
    fs_->ClearFailures();
    fs_->Crash();
    const std::string got = Get("a/f");
    if (st.ok()) {
      EXPECT_EQ(got, "new");
      ASSERT_TRUE(fs_->WriteFileAtomic("a/f", "old").ok());
    } else {
      EXPECT_TRUE(got == "old" || got == "new") << got;
    }
    // No temporary file survives a crash before its directory was synced.
    auto names = fs_->List("a");
    ASSERT_TRUE(names.ok());
    EXPECT_EQ(*names, (std::vector<std::string>{"f"}));
  }
}

TEST_F(FaultStorageTest, FailAfter) {
  fs_->FailAfter(StorageOp::kWriteAtomic, 2, Status::NoSpace("disk full"));
  EXPECT_TRUE(fs_->WriteFileAtomic("a", "1").ok());
  EXPECT_TRUE(fs_->WriteFileAtomic("b", "2").ok());
  Status st = fs_->WriteFileAtomic("c", "3");
  EXPECT_EQ(st.code(), StatusCode::kNoSpace);
  EXPECT_EQ(fs_->WriteFileAtomic("d", "4").code(), StatusCode::kNoSpace);
  EXPECT_FALSE(Val(base_->Exists("c")));              // a failed operation does nothing
  EXPECT_TRUE(fs_->Delete("a").ok());                 // other kinds are unaffected
  EXPECT_EQ(fs_->Count(StorageOp::kWriteAtomic), 4);  // failed ones are counted
  fs_->ClearFailures();
  EXPECT_TRUE(fs_->WriteFileAtomic("c", "3").ok());

  fs_->FailAfter(StorageOp::kAny, 0, Status::IOError("all fail"));
  EXPECT_EQ(fs_->Exists("c").status().code(), StatusCode::kIOError);
  EXPECT_EQ(fs_->SyncDir("").code(), StatusCode::kIOError);
  fs_->ClearFailures();

  auto f = fs_->NewWritableFile("w", 0);
  ASSERT_TRUE(f.ok());
  fs_->FailAfter(StorageOp::kSync, 0, Status::IOError("EIO on fsync"));
  ASSERT_TRUE((*f)->WriteAt(0, "x", 1).ok());
  EXPECT_EQ((*f)->Sync().code(), StatusCode::kIOError);
  fs_->ClearFailures();
  EXPECT_TRUE((*f)->Sync().ok());
  EXPECT_EQ(Get("w"), "x");
}

}  // namespace
}  // namespace nebulite

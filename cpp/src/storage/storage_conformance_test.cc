// The conformance suite every Storage driver passes. A driver registers a factory in
// kDrivers below; its special cases live in its own <driver>_test.cc.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/test_util.h"
#include "nebulite/fault_storage.h"
#include "nebulite/object_store.h"
#include "nebulite/storage.h"

namespace nebulite {
namespace {

// A driver under test plus whatever keeps it alive.
struct DriverInstance {
  std::unique_ptr<Storage> base;     // for wrappers
  std::unique_ptr<Storage> storage;  // the driver under test
  std::string temp_dir;              // removed at the end, if set
};

struct Driver {
  const char* name;
  std::function<DriverInstance()> make;
};

std::string MakeTempDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/nebulite-storage-XXXXXX";
  char* dir = ::mkdtemp(templ.data());
  if (dir == nullptr) return "";
  return dir;
}

DriverInstance MakePosix(bool direct) {
  DriverInstance d;
  d.temp_dir = MakeTempDir();
  auto s = OpenPosixStorage(d.temp_dir + "/root", direct);
  if (s.ok()) d.storage = std::move(s).value();
  return d;
}

const Driver kDrivers[] = {
    {"posix_direct", [] { return MakePosix(true); }},
    {"posix_buffered", [] { return MakePosix(false); }},
    {"memory",
     [] {
       return DriverInstance{nullptr, NewMemoryStorage(), ""};
     }},
    {"object_over_memory",
     [] {
       return DriverInstance{nullptr, OpenObjectStorage(NewMemoryObjectClient()), ""};
     }},
    {"fault_over_memory",
     [] {
       DriverInstance d;
       d.base = NewMemoryStorage();
       d.storage = FaultStorage::Wrap(d.base.get());
       return d;
     }},
};

class StorageConformanceTest : public ::testing::TestWithParam<Driver> {
 protected:
  void SetUp() override {
    instance_ = GetParam().make();
    ASSERT_NE(instance_.storage, nullptr) << "cannot create driver " << GetParam().name;
    s_ = instance_.storage.get();
  }
  void TearDown() override {
    instance_.storage.reset();
    instance_.base.reset();
    if (!instance_.temp_dir.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(instance_.temp_dir, ec);
    }
  }

  // Writes a whole file through a WritableFile, synced and closed.
  void Put(const std::string& path, const std::string& data) {
    auto f = s_->NewWritableFile(path, data.size());
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    ASSERT_TRUE((*f)->WriteAt(0, data.data(), data.size()).ok());
    ASSERT_TRUE((*f)->Sync().ok());
    ASSERT_TRUE((*f)->Close().ok());
  }

  std::string Get(const std::string& path) {
    auto r = s_->ReadFile(path, 1 << 30);
    EXPECT_TRUE(r.ok()) << path << ": " << r.status().ToString();
    return r.ok() ? *r : std::string();
  }

  std::vector<std::string> Ls(const std::string& dir) {
    auto r = s_->List(dir);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : std::vector<std::string>{};
  }

  DriverInstance instance_;
  Storage* s_ = nullptr;
};

std::string Pattern(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1103515245u + 12345u;
    s[i] = static_cast<char>(x >> 24);
  }
  return s;
}

// A buffer aligned for O_DIRECT.
struct AlignedBuffer {
  explicit AlignedBuffer(size_t n) : size(n) {
    ptr = static_cast<char*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
  }
  ~AlignedBuffer() { std::free(ptr); }
  char* ptr;
  size_t size;
};

TEST_P(StorageConformanceTest, WriteReadRoundTrip) {
  const std::string data = Pattern(10000, 1);
  Put("a/b/c.bin", data);
  EXPECT_EQ(Get("a/b/c.bin"), data);
  auto size = s_->FileSize("a/b/c.bin");
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, data.size());
  char buf[100];
  auto file = s_->NewReadableFile("a/b/c.bin");
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->size(), data.size());
  auto n = (*file)->ReadAt(9950, sizeof(buf), buf);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 50u);  // short only at end of file
  EXPECT_EQ(std::string(buf, 50), data.substr(9950));
  n = (*file)->ReadAt(20000, sizeof(buf), buf);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 0u);
  EXPECT_EQ(s_->FileSize("missing").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s_->ReadFile("missing", 10).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s_->NewReadableFile("missing").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s_->NewReadableFile("a/b").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s_->ReadFile("a/b", 10).status().code(), StatusCode::kInvalidArgument);
}

TEST_P(StorageConformanceTest, AReadHandleOutlivesDeletionAndReplacement) {
  const std::string first = Pattern(50000, 7);
  Put("v/f", first);
  auto file = s_->NewReadableFile("v/f");
  ASSERT_TRUE(file.ok());
  ASSERT_TRUE(s_->WriteFileAtomic("v/f", "replaced").ok());
  std::string got(first.size(), '\0');
  if (s_->is_object_store()) {  // the version opened is gone: an error, never other bytes
    EXPECT_EQ((*file)->ReadAt(0, got.size(), got.data()).status().code(), StatusCode::kIOError);
    ASSERT_TRUE(s_->DeleteRecursively("v").ok());
    EXPECT_EQ((*file)->ReadAt(100, 10, got.data()).status().code(), StatusCode::kIOError);
    return;
  }
  EXPECT_EQ(Val((*file)->ReadAt(0, got.size(), got.data())), first.size());
  EXPECT_TRUE(got == first);
  ASSERT_TRUE(s_->DeleteRecursively("v").ok());
  EXPECT_EQ(Val((*file)->ReadAt(100, 10, got.data())), 10u);
  EXPECT_EQ(got.substr(0, 10), first.substr(100, 10));
}

TEST_P(StorageConformanceTest, Stat) {
  Put("s/f", "12345");
  FileInfo f = Val(s_->Stat("s/f"));
  EXPECT_EQ(f.type, FileType::kFile);
  EXPECT_EQ(f.size, 5u);
  EXPECT_GT(f.mtime_ns, 0);
  EXPECT_EQ(Val(s_->Stat("s")).type, FileType::kDirectory);
  EXPECT_EQ(Val(s_->Stat("")).type, FileType::kDirectory);
  EXPECT_EQ(s_->Stat("s/missing").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s_->Stat("s/f/under_a_file").status().code(), StatusCode::kNotFound);
  // A file written after another is not older.
  Put("s/g", "later");
  EXPECT_GE(Val(s_->Stat("s/g")).mtime_ns, f.mtime_ns);
}

TEST_P(StorageConformanceTest, CreateFileExclusive) {
  ASSERT_TRUE(s_->CreateFileExclusive("x/claim", "mine").ok());
  EXPECT_EQ(Get("x/claim"), "mine");
  EXPECT_EQ(s_->CreateFileExclusive("x/claim", "theirs").code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(Get("x/claim"), "mine");
  EXPECT_EQ(Ls("x"), (std::vector<std::string>{"claim"}));  // no temporary file left
  // Racing writers: exactly one wins each name.
  std::vector<int> wins(8, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i)
        if (s_->CreateFileExclusive("race/" + std::to_string(i), std::to_string(t)).ok()) ++wins[t];
    });
  }
  for (auto& th : threads) th.join();
  int total = 0;
  for (int w : wins) total += w;
  EXPECT_EQ(total, 20);
}

TEST_P(StorageConformanceTest, AppendToFile) {
  ASSERT_TRUE(s_->AppendToFile("h/log.csv", "a,b\n").ok());
  ASSERT_TRUE(s_->AppendToFile("h/log.csv", "c,d\n").ok());
  EXPECT_EQ(Get("h/log.csv"), "a,b\nc,d\n");
}

TEST_P(StorageConformanceTest, RemoveDirIfEmpty) {
  Put("e/full/f", "x");
  ASSERT_TRUE(s_->CreateDirs("e/empty").ok());
  EXPECT_TRUE(Val(s_->RemoveDirIfEmpty("e/empty")));
  EXPECT_FALSE(Val(s_->Exists("e/empty")));
  EXPECT_TRUE(Val(s_->RemoveDirIfEmpty("e/empty")));  // missing: nothing to do
  EXPECT_FALSE(Val(s_->RemoveDirIfEmpty("e/full")));
  EXPECT_EQ(Get("e/full/f"), "x");
  EXPECT_EQ(s_->RemoveDirIfEmpty("").status().code(), StatusCode::kInvalidArgument);
}

TEST_P(StorageConformanceTest, Locks) {
  if (s_->is_object_store()) {  // no lock is shared between processes
    EXPECT_EQ(s_->TryLock("locks/run.lock", false).status().code(),
              StatusCode::kFailedPrecondition);
    return;
  }
  auto a = Val(s_->TryLock("locks/run.lock", false));
  auto b = Val(s_->TryLock("locks/run.lock", false));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);  // shared locks coexist
  EXPECT_EQ(Val(s_->TryLock("locks/run.lock", true)), nullptr);
  a.reset();
  EXPECT_EQ(Val(s_->TryLock("locks/run.lock", true)), nullptr);
  b.reset();
  auto x = Val(s_->TryLock("locks/run.lock", true));
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(Val(s_->TryLock("locks/run.lock", false)), nullptr);
  x.reset();
  EXPECT_NE(Val(s_->TryLock("locks/run.lock", false)), nullptr);
}

TEST_P(StorageConformanceTest, NewWritableFileTruncates) {
  Put("f", Pattern(5000, 2));
  Put("f", "short");
  EXPECT_EQ(Get("f"), "short");
  Put("empty", "");
  EXPECT_EQ(Get("empty"), "");
}

TEST_P(StorageConformanceTest, AlignedAndUnalignedWrites) {
  // Aligned 4 KiB blocks (the O_DIRECT path), an unaligned tail, and unaligned pieces in
  // the middle, written out of order.
  const size_t total = 5 * 4096 + 1234;
  const std::string expected = Pattern(total, 3);
  AlignedBuffer buf(total);
  std::memcpy(buf.ptr, expected.data(), total);
  auto f = s_->NewWritableFile("x/aligned.bin", total);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_TRUE((*f)->WriteAt(2 * 4096, buf.ptr + 2 * 4096, 2 * 4096).ok());  // aligned
  ASSERT_TRUE((*f)->WriteAt(5 * 4096, buf.ptr + 5 * 4096, 1234).ok());      // unaligned tail
  ASSERT_TRUE((*f)->WriteAt(0, buf.ptr, 4096).ok());                        // aligned
  ASSERT_TRUE((*f)->WriteAt(4096, buf.ptr + 4096, 100).ok());               // unaligned length
  ASSERT_TRUE((*f)->WriteAt(4196, buf.ptr + 4196, 3996).ok());              // unaligned offset
  ASSERT_TRUE((*f)->WriteAt(4 * 4096, buf.ptr + 4 * 4096, 4096).ok());      // aligned
  ASSERT_TRUE((*f)->WriteAt(0, buf.ptr, 0).ok());                           // empty
  ASSERT_TRUE((*f)->Sync().ok());
  ASSERT_TRUE((*f)->Close().ok());
  EXPECT_EQ(Val(s_->FileSize("x/aligned.bin")), total);  // exact size, no padding
  EXPECT_TRUE(Get("x/aligned.bin") == expected);
}

TEST_P(StorageConformanceTest, ConcurrentWritesToDisjointRanges) {
  const int kThreads = 8;
  const size_t kChunk = 64 * 1024 + 4096;  // aligned chunks...
  const size_t kTail = 777;                // ...and an unaligned piece per thread
  const size_t total = kThreads * (kChunk + kTail);
  const std::string expected = Pattern(total, 4);
  AlignedBuffer buf(total);
  std::memcpy(buf.ptr, expected.data(), total);
  auto f = s_->NewWritableFile("concurrent.bin", total);
  ASSERT_TRUE(f.ok());
  WritableFile* file = f->get();
  std::vector<std::thread> threads;
  std::vector<Status> results(kThreads * 2);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // The aligned chunks first, the unaligned tails at the end of the file.
      const size_t off = t * kChunk;
      results[2 * t] = file->WriteAt(off, buf.ptr + off, kChunk);
      const size_t tail = kThreads * kChunk + t * kTail;
      results[2 * t + 1] = file->WriteAt(tail, buf.ptr + tail, kTail);
    });
  }
  for (auto& th : threads) th.join();
  for (const Status& st : results) EXPECT_TRUE(st.ok()) << st.ToString();
  ASSERT_TRUE(file->Sync().ok());
  ASSERT_TRUE(file->Close().ok());
  EXPECT_TRUE(Get("concurrent.bin") == expected);
}

TEST_P(StorageConformanceTest, ListIsSortedAndMissingDirIsEmpty) {
  Put("d/b", "1");
  Put("d/a", "2");
  Put("d/c/deep", "3");
  Put("d/A", "4");
  EXPECT_EQ(Ls("d"), (std::vector<std::string>{"A", "a", "b", "c"}));
  EXPECT_EQ(Ls("d/c"), (std::vector<std::string>{"deep"}));
  EXPECT_TRUE(Ls("nope").empty());
  EXPECT_TRUE(Ls("d/nope/deeper").empty());
  EXPECT_EQ(Ls(""), (std::vector<std::string>{"d"}));
  if (s_->is_object_store()) {  // a directory is the prefix of its files: none is empty
    ASSERT_TRUE(s_->CreateDirs("e/f").ok());
    EXPECT_EQ(Ls(""), (std::vector<std::string>{"d"}));
    return;
  }
  ASSERT_TRUE(s_->CreateDirs("e/f").ok());
  EXPECT_EQ(Ls(""), (std::vector<std::string>{"d", "e"}));
  EXPECT_EQ(Ls("e"), (std::vector<std::string>{"f"}));
  EXPECT_TRUE(Ls("e/f").empty());
  ASSERT_TRUE(s_->CreateDirs("e/f").ok());  // idempotent
  ASSERT_TRUE(s_->CreateDirs("").ok());
  EXPECT_FALSE(s_->CreateDirs("d/b/under_a_file").ok());
}

TEST_P(StorageConformanceTest, Exists) {
  EXPECT_FALSE(Val(s_->Exists("f")));
  Put("dir/f", "x");
  EXPECT_TRUE(Val(s_->Exists("dir/f")));
  EXPECT_TRUE(Val(s_->Exists("dir")));
  EXPECT_TRUE(Val(s_->Exists("")));
  EXPECT_FALSE(Val(s_->Exists("dir/g")));
  EXPECT_FALSE(Val(s_->Exists("dir/f/under_a_file")));
}

TEST_P(StorageConformanceTest, Rename) {
  Put("r/a", "alpha");
  Put("r/b", "beta");
  ASSERT_TRUE(s_->Rename("r/a", "r/c").ok());
  EXPECT_FALSE(Val(s_->Exists("r/a")));
  EXPECT_EQ(Get("r/c"), "alpha");
  ASSERT_TRUE(s_->Rename("r/c", "r/b").ok());  // replaces
  EXPECT_EQ(Get("r/b"), "alpha");
  EXPECT_EQ(Ls("r"), (std::vector<std::string>{"b"}));
  EXPECT_EQ(s_->Rename("r/missing", "r/x").code(), StatusCode::kNotFound);
  ASSERT_TRUE(s_->SyncDir("r").ok());
  ASSERT_TRUE(s_->SyncDir("").ok());
}

TEST_P(StorageConformanceTest, DeleteIsIdempotent) {
  Put("del/f", "x");
  ASSERT_TRUE(s_->Delete("del/f").ok());
  EXPECT_FALSE(Val(s_->Exists("del/f")));
  EXPECT_TRUE(s_->Delete("del/f").ok());
  EXPECT_TRUE(s_->Delete("never/was").ok());
}

TEST_P(StorageConformanceTest, DeleteRecursively) {
  Put("t/v1/rank0/a", "a");
  Put("t/v1/rank0/b", "b");
  Put("t/v1/rank0.manifest", "m");
  Put("t/v2/COMMITTED", "c");
  Put("t/v10/keep", "k");  // a sibling sharing the prefix "t/v1"
  ASSERT_TRUE(s_->DeleteRecursively("t/v1").ok());
  EXPECT_FALSE(Val(s_->Exists("t/v1")));
  EXPECT_FALSE(Val(s_->Exists("t/v1/rank0/a")));
  EXPECT_EQ(Ls("t"), (std::vector<std::string>{"v10", "v2"}));
  EXPECT_EQ(Get("t/v10/keep"), "k");
  EXPECT_TRUE(s_->DeleteRecursively("t/v1").ok());                            // missing is OK
  EXPECT_EQ(s_->DeleteRecursively("").code(), StatusCode::kInvalidArgument);  // never the root
}

TEST_P(StorageConformanceTest, WriteFileAtomicReplacesContent) {
  ASSERT_TRUE(s_->WriteFileAtomic("m/COMMITTED", "first").ok());
  EXPECT_EQ(Get("m/COMMITTED"), "first");
  ASSERT_TRUE(s_->WriteFileAtomic("m/COMMITTED", "second, longer").ok());
  EXPECT_EQ(Get("m/COMMITTED"), "second, longer");
  ASSERT_TRUE(s_->WriteFileAtomic("m/COMMITTED", "").ok());
  EXPECT_EQ(Get("m/COMMITTED"), "");
  // No temporary file is left behind.
  EXPECT_EQ(Ls("m"), (std::vector<std::string>{"COMMITTED"}));
  const std::string long_name(255, 'n');
  ASSERT_TRUE(s_->WriteFileAtomic("m/" + long_name, "x").ok());
  EXPECT_EQ(Get("m/" + long_name), "x");
}

TEST_P(StorageConformanceTest, ReadFileMaxBytes) {
  Put("big", std::string(100, 'x'));
  EXPECT_TRUE(s_->ReadFile("big", 100).ok());
  EXPECT_EQ(s_->ReadFile("big", 99).status().code(), StatusCode::kCorruption);
  EXPECT_EQ(s_->ReadFile("big", 0).status().code(), StatusCode::kCorruption);
}

TEST_P(StorageConformanceTest, RejectsInvalidPaths) {
  const std::string bad[] = {"",
                             "/abs",
                             "../x",
                             "a/../b",
                             "a//b",
                             "a/",
                             "./a",
                             "a/.",
                             "..",
                             ".",
                             "a\\b",
                             std::string("a\0b", 3),
                             std::string(256, 'x')};
  for (const std::string& p : bad) {
    SCOPED_TRACE(p);
    EXPECT_EQ(s_->NewWritableFile(p, 0).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(s_->WriteFileAtomic(p, "x").code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(s_->ReadFile(p, 10).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(s_->Delete(p).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(s_->Rename("ok", p).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(s_->DeleteRecursively(p).code(), StatusCode::kInvalidArgument);
    if (!p.empty()) {  // "" is the root for directory operations
      EXPECT_EQ(s_->List(p).status().code(), StatusCode::kInvalidArgument);
      EXPECT_EQ(s_->Exists(p).status().code(), StatusCode::kInvalidArgument);
      EXPECT_EQ(s_->CreateDirs(p).code(), StatusCode::kInvalidArgument);
      EXPECT_EQ(s_->SyncDir(p).code(), StatusCode::kInvalidArgument);
    }
  }
  // Nothing escaped into the store.
  EXPECT_TRUE(Ls("").empty());
}

TEST_P(StorageConformanceTest, NamesWithSpacesAndUnicode) {
  const std::string name = "my file %20 \xC3\xA9t\xC3\xA9.bin";
  Put("tag/" + name, "data");
  EXPECT_EQ(Get("tag/" + name), "data");
  EXPECT_EQ(Ls("tag"), (std::vector<std::string>{name}));
}

TEST_P(StorageConformanceTest, WriteWholeFile) {
  const std::string a = Pattern(70000, 9), b = Pattern(3, 10);
  ASSERT_TRUE(s_->WriteWholeFile("w/rank0/model", {{a.data(), a.size()}, {nullptr, 0},
                                                   {b.data(), b.size()}})
                  .ok());
  EXPECT_TRUE(Get("w/rank0/model") == a + b);
  ASSERT_TRUE(s_->WriteWholeFile("w/rank0/model", {{b.data(), b.size()}}).ok());  // replaces
  EXPECT_EQ(Get("w/rank0/model"), b);
  ASSERT_TRUE(s_->WriteWholeFile("w/rank0/empty", {}).ok());
  EXPECT_EQ(Get("w/rank0/empty"), "");
  EXPECT_EQ(Ls("w/rank0"), (std::vector<std::string>{"empty", "model"}));  // nothing else left
  EXPECT_EQ(s_->WriteWholeFile("../x", {}).code(), StatusCode::kInvalidArgument);
}

TEST_P(StorageConformanceTest, WriteAfterCloseFails) {
  auto f = s_->NewWritableFile("closed", 0);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->Close().ok());
  EXPECT_FALSE((*f)->WriteAt(0, "x", 1).ok());
  EXPECT_TRUE((*f)->Close().ok());  // idempotent
}

INSTANTIATE_TEST_SUITE_P(Drivers, StorageConformanceTest, ::testing::ValuesIn(kDrivers),
                         [](const ::testing::TestParamInfo<Driver>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace nebulite

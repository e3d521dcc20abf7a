// The object-store driver beyond the conformance suite: the engine's whole protocol on
// an object store (data files written whole, no temporary objects, retention, two ranks,
// streaming), and the rules for runs and leases on a store without locks.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <mutex>

#include <string>
#include <utility>
#include <vector>

#include "base/test_util.h"
#include "nebulite/commit.h"
#include "nebulite/crc32.h"
#include "nebulite/engine.h"
#include "nebulite/lease.h"
#include "nebulite/object_store.h"
#include "nebulite/runs.h"
#include "persist/engine_test_util.h"

namespace nebulite {
namespace {

using engine_test::CheckEveryCommittedVersion;
using engine_test::Committed;
using engine_test::ExpectStored;
using engine_test::MakeObject;

// Engine options writing to `client` through an object storage.
EngineOptions ObjectOptions(std::shared_ptr<ObjectClient> client, uint64_t memory = 32 << 20) {
  EngineOptions o = engine_test::Options("", memory);
  o.storage_override = std::shared_ptr<Storage>(OpenObjectStorage(std::move(client)));
  return o;
}

// Every key in the store.
std::vector<std::string> Keys(ObjectClient* client) {
  std::vector<std::string> out;
  for (const auto& [key, info] : Val(client->List("", true)).objects) out.push_back(key);
  return out;
}

TEST(ObjectStorageTest, TheEngineCommitsAndReadsBackWithNoTemporaryObject) {
  auto client = NewMemoryObjectClient();
  auto e = Engine::Open(ObjectOptions(client));
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& engine = **e;
  auto obj = MakeObject({300, 5 << 20, 1, 0, 123457}, 1);
  ASSERT_TRUE(engine.Stage("step1", "v1", "model", obj.records).ok());
  ASSERT_TRUE(engine.Commit("step1", "v1", 1, /*persist=*/true).ok());
  ASSERT_TRUE(engine.Flush(60).ok());
  EXPECT_EQ(Committed(engine.storage()), (std::vector<std::string>{"step1/v1"}));
  ExpectStored(engine.storage(), DataFilePath("step1", "v1", 0, "model"), obj);
  EXPECT_TRUE(CheckEveryCommittedVersion(engine.storage()).ok());
  // The data file went straight to its name: no ".partial" object was ever needed.
  for (const std::string& key : Keys(client.get())) {
    EXPECT_EQ(key.find(".partial"), std::string::npos) << key;
  }
  const std::vector<std::string> keys = Keys(client.get());
  EXPECT_NE(std::find(keys.begin(), keys.end(), "step1/v1/COMMITTED"), keys.end());
  EXPECT_NE(std::find(keys.begin(), keys.end(), "step1/v1/rank0.manifest"), keys.end());
}

TEST(ObjectStorageTest, StateLargerThanTheBudgetIsUploadedFromItsSource) {
  auto client = NewMemoryObjectClient();
  auto e = Engine::Open(ObjectOptions(client, 4 << 20));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  auto obj = MakeObject({1000, 9 << 20, 3 << 20, 12345}, 5);
  auto info = engine.Stage("big", "v1", "model", obj.records);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(info->streamed);
  ASSERT_TRUE(engine.Commit("big", "v1", 1, true).ok());
  ASSERT_TRUE(engine.Flush(60).ok());
  ExpectStored(engine.storage(), DataFilePath("big", "v1", 0, "model"), obj);
  EXPECT_TRUE(CheckEveryCommittedVersion(engine.storage()).ok());
}

TEST(ObjectStorageTest, RetentionDeletesOldVersionsWhole) {
  auto client = NewMemoryObjectClient();
  auto opts = ObjectOptions(client);
  opts.retention = 2;
  auto e = Engine::Open(opts);
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  const std::vector<std::string> tags = {"z", "y", "x", "w"};
  for (size_t i = 0; i < tags.size(); ++i) {
    auto obj = MakeObject({64, 70000}, static_cast<uint8_t>(i));
    ASSERT_TRUE(engine.Stage(tags[i], "v", "n", obj.records).ok());
    ASSERT_TRUE(engine.Commit(tags[i], "v", i + 1, true).ok());
    ASSERT_TRUE(engine.Flush(60).ok());
  }
  EXPECT_EQ(Committed(engine.storage()), (std::vector<std::string>{"x/v", "w/v"}));
  for (const std::string& key : Keys(client.get())) {
    EXPECT_TRUE(key.rfind("z/", 0) != 0 && key.rfind("y/", 0) != 0) << key << " was kept";
  }
}

TEST(ObjectStorageTest, TwoRanksCommitOnlyWhenBothPersisted) {
  auto client = NewMemoryObjectClient();
  auto o0 = ObjectOptions(client);
  o0.world_size = 2;
  auto o1 = o0;
  o1.rank = 1;
  auto e0 = Engine::Open(o0);
  auto e1 = Engine::Open(o1);
  ASSERT_TRUE(e0.ok() && e1.ok());
  auto a = MakeObject({100, 4096}, 1), b = MakeObject({200, 5000}, 2);
  ASSERT_TRUE((*e0)->Stage("s", "v", "model", a.records).ok());
  ASSERT_TRUE((*e0)->Commit("s", "v", 1, true).ok());
  usleep(100 * 1000);
  EXPECT_FALSE(Val((*e0)->storage()->Exists(CommitMarkerPath("s", "v"))));
  ASSERT_TRUE((*e1)->Stage("s", "v", "optim", b.records).ok());
  ASSERT_TRUE((*e1)->Commit("s", "v", 1, true).ok());
  ASSERT_TRUE((*e0)->Flush(60).ok());
  ASSERT_TRUE((*e1)->Flush(60).ok());
  EXPECT_EQ(Committed((*e0)->storage()), (std::vector<std::string>{"s/v"}));
  ExpectStored((*e0)->storage(), DataFilePath("s", "v", 1, "optim"), b);
}

TEST(ObjectStorageTest, DeadRunsVersionsGoAfterTheGraceAlone) {
  auto storage = OpenObjectStorage(NewMemoryObjectClient());
  const std::string version = VersionName("deadrun", 1);
  ASSERT_TRUE(storage->WriteFileAtomic(DataFilePath("t", version, 0, "model"), "x").ok());
  // A run cannot be held or told alive on a store without locks...
  auto held = HoldRun(storage.get(), "liverun");
  ASSERT_TRUE(held.ok());
  EXPECT_NE(*held, nullptr);
  EXPECT_EQ(RunIsAlive(storage.get(), "deadrun").status().code(), StatusCode::kFailedPrecondition);
  // ... so a version is kept while it is fresh, and removed once it is older than the grace.
  const int64_t written = Val(storage->Stat(DataFilePath("t", version, 0, "model"))).mtime_ns;
  auto fresh = Val(RemoveDeadRunsVersions(storage.get(), "liverun", 3600, written + 1, false));
  EXPECT_TRUE(fresh.removed.empty());
  EXPECT_TRUE(fresh.warnings.empty());
  auto old = Val(RemoveDeadRunsVersions(storage.get(), "liverun", 3600,
                                        written + 3601ll * 1000000000, false));
  EXPECT_EQ(old.removed, (std::vector<std::string>{VersionDir("t", version)}));
  EXPECT_FALSE(Val(storage->Exists(VersionDir("t", version))));
}

TEST(ObjectStorageTest, ALeaseOfThisHostWhoseProcessIsGoneIsNotLive) {
  auto storage = OpenObjectStorage(NewMemoryObjectClient());
  // A child that exits at once: its pid names no process afterwards.
  pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  const int64_t now = 1'000'000'000'000;
  Lease dead{"deadrun", "thishost", static_cast<uint32_t>(child), now, 600};
  ASSERT_TRUE(storage->WriteFileAtomic(kLeasePath, EncodeLease(dead)).ok());
  auto state = Val(ReadLease(storage.get(), "thishost", now + 1));
  EXPECT_TRUE(state.present);
  EXPECT_FALSE(state.live);
  // Another host's lease: its renewal time decides.
  Lease other{"otherrun", "otherhost", static_cast<uint32_t>(child), now, 600};
  ASSERT_TRUE(storage->WriteFileAtomic(kLeasePath, EncodeLease(other)).ok());
  EXPECT_TRUE(Val(ReadLease(storage.get(), "thishost", now + 1)).live);
  EXPECT_FALSE(Val(ReadLease(storage.get(), "thishost", now + 601ll * 1000000000)).live);
  // A live process of this host holds it.
  Lease mine{"liverun", "thishost", static_cast<uint32_t>(getpid()), now, 600};
  ASSERT_TRUE(storage->WriteFileAtomic(kLeasePath, EncodeLease(mine)).ok());
  EXPECT_TRUE(Val(ReadLease(storage.get(), "thishost", now + 1)).live);
}

TEST(ObjectStorageTest, ReadOnlyRefusesEveryChange) {
  auto client = NewMemoryObjectClient();
  auto rw = OpenObjectStorage(client);
  ASSERT_TRUE(rw->WriteFileAtomic("a/f", "x").ok());
  auto ro = OpenObjectStorage(client, /*read_only=*/true);
  EXPECT_TRUE(ro->read_only());
  EXPECT_EQ(Val(ro->ReadFile("a/f", 10)), "x");
  EXPECT_EQ(ro->WriteFileAtomic("a/g", "y").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(ro->WriteWholeFile("a/g", {}).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(ro->Delete("a/f").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(ro->DeleteRecursively("a").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(Val(ro->ReadFile("a/f", 10)), "x");
}

}  // namespace
}  // namespace nebulite

namespace nebulite {
namespace {

// An object client whose clock ticks in whole seconds, set by the test (as S3's and
// Azure's Last-Modified do), counting the gets of each key.
class SecondsClock final : public ObjectClient {
 public:
  explicit SecondsClock(std::shared_ptr<ObjectClient> base) : base_(std::move(base)) {}
  std::string Describe() const override { return base_->Describe(); }
  Status Put(const std::string& key, const std::vector<ByteSpan>& data, bool if_absent) override {
    NEBULITE_RETURN_IF_ERROR(base_->Put(key, data, if_absent));
    std::lock_guard<std::mutex> lock(mu_);
    stamps_[key] = now_s * 1000000000;
    return Status::OK();
  }
  Result<size_t> Get(const std::string& key, uint64_t offset, size_t n, void* dst,
                     const std::string& etag) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++gets_[key];
    }
    return base_->Get(key, offset, n, dst, etag);
  }
  Result<ObjectInfo> Head(const std::string& key) override {
    NEBULITE_ASSIGN_OR_RETURN(ObjectInfo info, base_->Head(key));
    std::lock_guard<std::mutex> lock(mu_);
    info.mtime_ns = stamps_[key];
    return info;
  }
  Result<ObjectListing> List(const std::string& prefix, bool recursive) override {
    NEBULITE_ASSIGN_OR_RETURN(ObjectListing listing, base_->List(prefix, recursive));
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, info] : listing.objects) info.mtime_ns = stamps_[key];
    return listing;
  }
  Status Copy(const std::string& from, const std::string& to) override {
    return base_->Copy(from, to);
  }
  Status Delete(const std::string& key) override { return base_->Delete(key); }
  int gets(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    return gets_[key];
  }

  int64_t now_s = 1000;

 private:
  std::shared_ptr<ObjectClient> base_;
  std::mutex mu_;
  std::map<std::string, int64_t> stamps_;  // GUARDED_BY(mu_)
  std::map<std::string, int> gets_;        // GUARDED_BY(mu_)
};

// Commits version (t, v) of one rank holding `data` as file "model".
void CommitOne(Storage* s, const std::string& data) {
  ASSERT_TRUE(s->WriteWholeFile(DataFilePath("t", "v", 0, "model"), {{data.data(), data.size()}})
                  .ok());
  Manifest m{"t", "v", 0, 1, {{"model", data.size(), Crc32(0, data.data(), data.size())}}};
  ASSERT_TRUE(WriteManifest(s, m).ok());
  CommitRecord c{"t", "v", 1, 0, 1, {}};
  ASSERT_TRUE(WriteCommitMarker(s, c).ok());
}

TEST(ObjectStorageTest, ACommitMarkerIsNeverReplaced) {
  std::shared_ptr<ObjectClient> client = NewMemoryObjectClient();
  std::unique_ptr<Storage> s = OpenObjectStorage(client, /*read_only=*/false);
  CommitOne(s.get(), "bytes");
  Result<std::string> marker = s->ReadFile(CommitMarkerPath("t", "v"), 1 << 20);
  ASSERT_TRUE(marker.ok());
  // The same commit again (a retried put that had succeeded): the marker is its own.
  CommitRecord same{"t", "v", 1, 0, 1, {}};
  EXPECT_TRUE(WriteCommitMarker(s.get(), same).ok());
  // Another commit of the version (another sequence number) is refused, the marker kept.
  CommitRecord other{"t", "v", 2, 0, 1, {}};
  Status st = WriteCommitMarker(s.get(), other);
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists) << st.ToString();
  Result<std::string> after = s->ReadFile(CommitMarkerPath("t", "v"), 1 << 20);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(*after, *marker);
}

TEST(ObjectStorageTest, RetentionsCheckReadsBackOnlyAFileChangedAfterTheMarkersSecond) {
  auto clock = std::make_shared<SecondsClock>(NewMemoryObjectClient());
  auto storage = OpenObjectStorage(clock);
  const std::string data(3 << 20, 'x');
  CommitOne(storage.get(), data);  // the file and its marker in one second
  const std::string path = DataFilePath("t", "v", 0, "model");
  auto catalog = Val(ReadCatalog(storage.get()));
  ASSERT_EQ(catalog.entries.size(), 1u);
  VersionChecker checker(storage.get());
  EXPECT_TRUE(checker.Check(catalog.entries[0]).ok());
  EXPECT_EQ(clock->gets(path), 0);  // not read back
  // Replaced a second later, by someone else: read, and found damaged.
  clock->now_s += 1;
  std::string other = data;
  other[12345] ^= 1;
  ASSERT_TRUE(storage->WriteWholeFile(path, {{other.data(), other.size()}}).ok());
  EXPECT_EQ(checker.Check(catalog.entries[0]).code(), StatusCode::kCorruption);
  EXPECT_GT(clock->gets(path), 0);
}

TEST(ObjectStorageTest, SmallReadsOfAFileShareAFewRequests) {
  auto clock = std::make_shared<SecondsClock>(NewMemoryObjectClient());
  auto storage = OpenObjectStorage(clock);
  const std::string data = std::string(5 << 20, 'a') + std::string(100, 'b');
  ASSERT_TRUE(storage->WriteWholeFile("f", {{data.data(), data.size()}}).ok());
  const uint64_t end = data.size();
  // A file's index and headers: small reads at its two ends, one of them across the
  // boundary of two blocks (1 MiB, counted from the end).
  const std::vector<uint64_t> offsets = {0, 30, end - 4096, end - 22, end - 100,
                                         end - (1ull << 20) - 10};
  char buf[4096];
  auto read_all = [&](ReadableFile* file) {
    for (uint64_t off : offsets) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(sizeof(buf), end - off));
      ASSERT_EQ(Val(file->ReadAt(off, n, buf)), n);
      EXPECT_EQ(std::string(buf, n), data.substr(off, n)) << off;
    }
  };
  auto file = Val(storage->NewReadableFile("f"));
  read_all(file.get());
  // The first block (the file's first 100 bytes) and the one after it, the last two.
  EXPECT_EQ(clock->gets("f"), 4);
  // Another handle on the same version (a load opens the file twice) finds them read.
  auto again = Val(storage->NewReadableFile("f"));
  read_all(again.get());
  EXPECT_EQ(clock->gets("f"), 4);
  // A large read goes straight to the store, into the caller's buffer.
  std::string big(1 << 20, '\0');
  ASSERT_EQ(Val(file->ReadAt(1 << 20, big.size(), big.data())), big.size());
  EXPECT_TRUE(big == data.substr(1 << 20, big.size()));
  EXPECT_EQ(clock->gets("f"), 5);
  EXPECT_EQ(Val(file->ReadAt(end, 10, buf)), 0u);  // past the end: nothing
  // A new version of the file is read anew, never from the old one's blocks.
  const std::string other(end, 'z');
  ASSERT_TRUE(storage->WriteWholeFile("f", {{other.data(), other.size()}}).ok());
  auto newer = Val(storage->NewReadableFile("f"));
  ASSERT_EQ(Val(newer->ReadAt(0, 10, buf)), 10u);
  EXPECT_EQ(std::string(buf, 10), other.substr(0, 10));
}


// An object client counting the requests made of it, by operation.
class CountingClient final : public ObjectClient {
 public:
  explicit CountingClient(std::shared_ptr<ObjectClient> base) : base_(std::move(base)) {}
  std::string Describe() const override { return base_->Describe(); }
  Status Put(const std::string& key, const std::vector<ByteSpan>& data, bool if_absent) override {
    Count("put");
    return base_->Put(key, data, if_absent);
  }
  Result<size_t> Get(const std::string& key, uint64_t offset, size_t n, void* dst,
                     const std::string& etag) override {
    Count("get");
    if (n > (1u << 20)) {
      std::lock_guard<std::mutex> lock(mu_);
      big_gets_.push_back(n);
    }
    return base_->Get(key, offset, n, dst, etag);
  }
  Result<ObjectInfo> Head(const std::string& key) override {
    Count("head");
    return base_->Head(key);
  }
  Result<ObjectListing> List(const std::string& prefix, bool recursive) override {
    Count("list");
    return base_->List(prefix, recursive);
  }
  Status Copy(const std::string& from, const std::string& to) override {
    Count("copy");
    return base_->Copy(from, to);
  }
  Status Delete(const std::string& key) override {
    Count("delete");
    return base_->Delete(key);
  }
  // The requests since the last call, by operation.
  std::map<std::string, int> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(counts_, {});
  }
  // The sizes of the GETs of more than 1 MiB since the last call, in the order made.
  std::vector<size_t> TakeBigGets() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(big_gets_, {});
  }

 private:
  void Count(const char* op) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[op];
  }
  std::shared_ptr<ObjectClient> base_;
  std::mutex mu_;
  std::map<std::string, int> counts_;  // GUARDED_BY(mu_)
  std::vector<size_t> big_gets_;       // GUARDED_BY(mu_)
};

using Counts = std::map<std::string, int>;

// A data file read from an object store: the two requests that open it (its index and
// its headers) and pieces that every reading thread shares equally, no more requests in
// all than a direct read of the payload in 16 MiB ranges would make.
TEST(ObjectStorageTest, ADataFileIsReadInPiecesEveryThreadSharesEqually) {
  auto counted = std::make_shared<CountingClient>(NewMemoryObjectClient());
  std::unique_ptr<Storage> s = OpenObjectStorage(counted, /*read_only=*/false);
  const uint64_t mib = 1 << 20;
  std::string data(10 * 16 * mib + 12345, '\0');  // 10 pieces of 16 MiB and a little
  for (size_t i = 0; i < data.size(); i += 4093) data[i] = static_cast<char>(i * 7);
  const std::string path = DataFilePath("t", "v", 0, "model");
  ASSERT_TRUE(s->WriteWholeFile(path, {{data.data(), data.size()}}).ok());
  const ManifestFile f{"model", data.size(), Crc32(0, data.data(), data.size())};
  std::string into(data.size(), '\0');
  for (int threads : {4, 3, 8, 16}) {
    std::fill(into.begin(), into.end(), '\0');
    counted->Take();
    counted->TakeBigGets();
    ASSERT_TRUE(ReadDataFile(s.get(), path, f, {{0, data.size(), into.data()}}, threads).ok());
    EXPECT_TRUE(into == data) << threads;
    std::vector<size_t> gets = counted->TakeBigGets();
    const size_t direct = (data.size() + 16 * mib - 1) / (16 * mib);  // 11 ranges
    if (threads <= 8) {
      EXPECT_LE(counted->Take()["get"], static_cast<int>(direct) - 2) << threads;
      // As many pieces as fit in whole waves of `threads`, leaving room for the two
      // requests that opened the file: 8 of 4, 6 of 3, 8 of 8.
      const size_t want = (10 - 2) / threads * threads;
      ASSERT_EQ(gets.size(), want) << threads;
      const size_t largest = *std::max_element(gets.begin(), gets.end());
      const size_t smallest = *std::min_element(gets.begin(), gets.end());
      EXPECT_LE(largest - smallest, data.size() / want / 100) << threads;  // within 1%
    } else {
      // More threads than pieces: the usual 16 MiB pieces, one each (the last is small).
      EXPECT_EQ(gets.size(), direct - 1) << threads;
    }
  }
}

// Each request a commit and a load make on an object store has a reason: the counts are
// the protocol's, and one more is a regression.
TEST(ObjectStorageTest, ACommitAndALoadMakeOnlyTheRequestsTheyNeed) {
  auto counted = std::make_shared<CountingClient>(NewMemoryObjectClient());
  EngineOptions o = ObjectOptions(counted);
  o.retention = 2;
  auto e = Engine::Open(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& engine = **e;
  auto obj = MakeObject({300, 3 << 20, 1000}, 1);
  counted->Take();
  auto commit = [&](const std::string& tag) {
    ASSERT_TRUE(engine.Stage(tag, "v1", "model", obj.records).ok());
    ASSERT_TRUE(engine.Commit(tag, "v1", 0, /*persist=*/true).ok());
    ASSERT_TRUE(engine.Flush(60).ok());
  };
  // The first commit into an empty store. Before the data: is the version committed
  // already (head). The data file and the manifest (2 puts). The commit number: the
  // claims (list), none yet, so the catalog (list the root and the tag, head its marker:
  // none), the claim (put), the claims again (list). The marker (put), checked against
  // the manifest in memory. The history: not there yet (head), created with the
  // commit's rows (put). Retention: the catalog (list the root and the tag, head and get
  // the marker); the version just committed counts as intact unchecked.
  commit("t1");
  EXPECT_EQ(counted->Take(), (Counts{{"get", 1}, {"head", 4}, {"list", 6}, {"put", 5}}));
  // The next: no catalog for the commit number, the older claim deleted; the history
  // appended to (head, get, put); retention lists and reads two markers and checks the
  // older version (get its manifest, head its data file).
  commit("t2");
  EXPECT_EQ(counted->Take(),
            (Counts{{"delete", 1}, {"get", 4}, {"head", 5}, {"list", 5}, {"put", 5}}));
  // A load: the catalog, then the manifest (one get each: small files are one request).
  Storage* s = engine.storage();
  auto catalog = Val(ReadCatalog(s));
  ASSERT_EQ(catalog.entries.size(), 2u);
  auto m = Val(ReadManifest(s, "t2", "v1", 0));
  EXPECT_EQ(counted->Take(), (Counts{{"get", 3}, {"head", 2}, {"list", 3}}));
  ASSERT_EQ(m.files.size(), 1u);
  (void)m;
}

}  // namespace
}  // namespace nebulite

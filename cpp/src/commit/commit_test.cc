// Manifests, commit records, the commit protocol under crashes, catalog and retention.
#include "nebulite/commit.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/test_util.h"
#include "nebulite/crc32.h"
#include "nebulite/fault_storage.h"

namespace nebulite {
namespace {

std::string Hex8(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", v);
  return buf;
}

// Appends a valid end line, so that tests can probe the parser behind the checksum.
std::string WithEnd(const std::string& body) {
  return body + "end " + Hex8(Crc32(0, body.data(), body.size())) + "\n";
}

uint32_t CrcOf(const std::string& s) { return Crc32(0, s.data(), s.size()); }

Manifest SampleManifest() {
  Manifest m;
  m.tag = "global step 100%";
  m.version = "v\xC3\xA9rsion-1";
  m.rank = 1;
  m.world_size = 4;
  m.files = {{"model states.pt", 123456789012ull, 0xdeadbeef},
             {"100%.bin", 0, 0},
             {"\xE6\xA8\xA1\xE5\x9E\x8B", 42, 0x0000ffff}};
  return m;
}

CommitRecord SampleRecord() {
  CommitRecord c;
  c.tag = "checkpoint";
  c.version = "00000000000000000007";
  c.seq = 18446744073709551615ull;
  c.time_unix_ns = -5;
  c.world_size = 3;
  c.manifest_crc32 = {0, 0xffffffff, 0x12345678};
  return c;
}

void ExpectSame(const Manifest& a, const Manifest& b) {
  EXPECT_EQ(a.tag, b.tag);
  EXPECT_EQ(a.version, b.version);
  EXPECT_EQ(a.rank, b.rank);
  EXPECT_EQ(a.world_size, b.world_size);
  ASSERT_EQ(a.files.size(), b.files.size());
  for (size_t i = 0; i < a.files.size(); ++i) {
    EXPECT_EQ(a.files[i].name, b.files[i].name);
    EXPECT_EQ(a.files[i].size, b.files[i].size);
    EXPECT_EQ(a.files[i].crc32, b.files[i].crc32);
  }
}

// ---------------------------------------------------------------- encodings

TEST(ManifestEncodingTest, GoldenText) {
  Manifest m;
  m.tag = "a b";
  m.version = "1%";
  m.rank = 0;
  m.world_size = 2;
  m.files = {{"x\xC3\xA9", 5, 0xabc}};
  const std::string body =
      "nebulite-manifest 1\n"
      "tag a%20b\n"
      "version 1%25\n"
      "rank 0\n"
      "world_size 2\n"
      "file 5 00000abc x%C3%A9\n";
  EXPECT_EQ(EncodeManifest(m), WithEnd(body));
}

TEST(ManifestEncodingTest, RoundTrip) {
  const Manifest m = SampleManifest();
  auto decoded = DecodeManifest(EncodeManifest(m));
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  ExpectSame(*decoded, m);
  Manifest empty;
  empty.tag = "t";
  empty.version = "v";
  auto e = DecodeManifest(EncodeManifest(empty));
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ExpectSame(*e, empty);
}

TEST(CommitEncodingTest, RoundTrip) {
  const CommitRecord c = SampleRecord();
  const std::string text = EncodeCommitRecord(c);
  EXPECT_EQ(text.substr(0, 18), "nebulite-commit 1\n");
  auto d = DecodeCommitRecord(text);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->tag, c.tag);
  EXPECT_EQ(d->version, c.version);
  EXPECT_EQ(d->seq, c.seq);
  EXPECT_EQ(d->time_unix_ns, c.time_unix_ns);
  EXPECT_EQ(d->world_size, c.world_size);
  EXPECT_EQ(d->manifest_crc32, c.manifest_crc32);
  CommitRecord extreme = c;
  extreme.time_unix_ns = INT64_MIN;
  auto x = DecodeCommitRecord(EncodeCommitRecord(extreme));
  ASSERT_TRUE(x.ok()) << x.status().ToString();
  EXPECT_EQ(x->time_unix_ns, INT64_MIN);
}

// Every strict prefix, and every single-bit flip, of an encoding is rejected.
template <typename Decode>
void ExpectRejectsDamage(const std::string& text, Decode decode) {
  for (size_t len = 0; len < text.size(); ++len) {
    EXPECT_FALSE(decode(text.substr(0, len)).ok()) << "prefix of " << len << " bytes accepted";
  }
  for (size_t i = 0; i < text.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string damaged = text;
      damaged[i] = static_cast<char>(damaged[i] ^ (1 << bit));
      EXPECT_FALSE(decode(damaged).ok()) << "flip of bit " << bit << " at byte " << i;
    }
  }
  EXPECT_FALSE(decode(text + "x").ok());
  EXPECT_FALSE(decode(text + "\n").ok());
  EXPECT_FALSE(decode(text + text).ok());
}

TEST(ManifestEncodingTest, RejectsTruncationsAndBitFlips) {
  ExpectRejectsDamage(EncodeManifest(SampleManifest()),
                      [](const std::string& t) { return DecodeManifest(t); });
}

TEST(CommitEncodingTest, RejectsTruncationsAndBitFlips) {
  ExpectRejectsDamage(EncodeCommitRecord(SampleRecord()),
                      [](const std::string& t) { return DecodeCommitRecord(t); });
}

TEST(ManifestEncodingTest, VersionAndMagic) {
  auto newer = DecodeManifest(WithEnd("nebulite-manifest 2\nwhatever comes next\n"));
  EXPECT_EQ(newer.status().code(), StatusCode::kUnsupportedVersion);
  auto newer_commit = DecodeCommitRecord("nebulite-commit 17\nanything");
  EXPECT_EQ(newer_commit.status().code(), StatusCode::kUnsupportedVersion);
  // A commit record is not a manifest, and vice versa.
  EXPECT_EQ(DecodeManifest(EncodeCommitRecord(SampleRecord())).status().code(),
            StatusCode::kCorruption);
  EXPECT_EQ(DecodeCommitRecord(EncodeManifest(SampleManifest())).status().code(),
            StatusCode::kCorruption);
  EXPECT_EQ(DecodeManifest(WithEnd("nebulite-manifest 0\n")).status().code(),
            StatusCode::kCorruption);
  EXPECT_EQ(DecodeManifest(WithEnd("nebulite-manifest 01\n")).status().code(),
            StatusCode::kCorruption);
  EXPECT_EQ(DecodeManifest("").status().code(), StatusCode::kCorruption);
}

TEST(ManifestEncodingTest, RejectsMalformedBodies) {
  const std::string head = "nebulite-manifest 1\ntag t\nversion v\n";
  const std::vector<std::string> bad = {
      head + "rank 0\n",                                                      // missing world_size
      head + "world_size 1\nrank 0\n",                                        // wrong order
      head + "rank 0\nworld_size 0\n",                                        // world_size 0
      head + "rank 2\nworld_size 2\n",                                        // rank out of range
      head + "rank 4294967296\nworld_size 1\n",                               // > u32
      head + "rank 00\nworld_size 1\n",                                       // leading zero
      head + "rank -0\nworld_size 1\n",                                       // sign
      head + "rank 0 \nworld_size 1\n",                                       // trailing space
      head + "rank  0\nworld_size 1\n",                                       // double space
      head + "rank 0\nworld_size 1\nfile 1 0000000a\n",                       // missing name
      head + "rank 0\nworld_size 1\nfile 1 0000000A x\n",                     // uppercase crc
      head + "rank 0\nworld_size 1\nfile 1 000000a x\n",                      // short crc
      head + "rank 0\nworld_size 1\nfile 18446744073709551616 0000000a x\n",  // > u64
      head + "rank 0\nworld_size 1\nfile 1 0000000a x\nfile 2 0000000a x\n",  // duplicate
      head + "rank 0\nworld_size 1\nfile 1 0000000a ..\n",                    // unsafe name
      head + "rank 0\nworld_size 1\nfile 1 0000000a a%2Fb\n",                 // '/' in a name
      head + "rank 0\nworld_size 1\nfile 1 0000000a a%00b\n",                 // NUL in a name
      head + "rank 0\nworld_size 1\nfile 1 0000000a a%2\n",                   // truncated escape
      head + "rank 0\nworld_size 1\nfile 1 0000000a a%41\n",                  // needless escape
      head + "rank 0\nworld_size 1\nfile 1 0000000a a%c3%a9\n",               // lowercase escape
      head + "rank 0\nworld_size 1\nsomething else\n",                        // unknown line
      "nebulite-manifest 1\ntag \nversion v\nrank 0\nworld_size 1\n",         // empty tag
      "nebulite-manifest 1\ntag ..%2Fx\nversion v\nrank 0\nworld_size 1\n",
  };
  for (const std::string& body : bad) {
    auto r = DecodeManifest(WithEnd(body));
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << body;
  }
  EXPECT_TRUE(DecodeManifest(WithEnd(head + "rank 0\nworld_size 1\n")).ok());
  // Bounded size.
  std::string huge = head + "rank 0\nworld_size 1\n";
  huge.resize(kMaxManifestBytes + 1, 'x');
  EXPECT_EQ(DecodeManifest(huge).status().code(), StatusCode::kCorruption);
}

TEST(CommitEncodingTest, RejectsMalformedBodies) {
  const std::string head = "nebulite-commit 1\ntag t\nversion v\nseq 1\ntime_unix_ns 5\n";
  const std::vector<std::string> bad = {
      head + "world_size 2\nmanifest 0 00000000\n",                       // too few
      head + "world_size 1\nmanifest 0 00000000\nmanifest 1 00000000\n",  // too many
      head + "world_size 2\nmanifest 1 00000000\nmanifest 0 00000000\n",  // order
      head + "world_size 0\n",                                            // zero
      head + "world_size 1\nmanifest 0 0000000g\n",                       // bad hex
      "nebulite-commit 1\ntag t\nversion v\nseq 18446744073709551616\ntime_unix_ns 5\n"
      "world_size 1\nmanifest 0 00000000\n",  // seq > u64
      "nebulite-commit 1\ntag t\nversion v\nseq 1\ntime_unix_ns 9223372036854775808\n"
      "world_size 1\nmanifest 0 00000000\n",  // time > i64
      "nebulite-commit 1\ntag t\nversion v\nseq 1\ntime_unix_ns -0\n"
      "world_size 1\nmanifest 0 00000000\n",  // negative zero
      "nebulite-commit 1\ntag t\nversion v\ntime_unix_ns 5\nseq 1\n"
      "world_size 1\nmanifest 0 00000000\n",  // order of fields
  };
  for (const std::string& body : bad) {
    EXPECT_EQ(DecodeCommitRecord(WithEnd(body)).status().code(), StatusCode::kCorruption) << body;
  }
  EXPECT_TRUE(DecodeCommitRecord(WithEnd(head + "world_size 1\nmanifest 0 00000000\n")).ok());
}

// ---------------------------------------------------------------- paths

TEST(CommitPathsTest, Layout) {
  EXPECT_EQ(VersionDir("t", "v"), "t/v");
  EXPECT_EQ(DataFilePath("t", "v", 3, "model.pt"), "t/v/rank3/model.pt");
  EXPECT_EQ(ManifestPath("t", "v", 12), "t/v/rank12.manifest");
  EXPECT_EQ(CommitMarkerPath("t", "v"), "t/v/COMMITTED");
}

TEST(CommitPathsTest, RejectsUnsafeIds) {
  auto storage = NewMemoryStorage();
  const std::vector<std::string> bad = {"../x", "/abs", "a/b", std::string("a\0b", 3),
                                        "",     ".",    ".."};
  for (const std::string& id : bad) {
    SCOPED_TRACE(id);
    Manifest m;
    m.tag = id;
    m.version = "v";
    EXPECT_EQ(WriteManifest(storage.get(), m).code(), StatusCode::kInvalidArgument);
    m.tag = "t";
    m.version = id;
    EXPECT_EQ(WriteManifest(storage.get(), m).code(), StatusCode::kInvalidArgument);
    m.version = "v";
    m.files = {{id, 1, 0}};
    EXPECT_EQ(WriteManifest(storage.get(), m).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(ReadManifest(storage.get(), id, "v", 0).status().code(),
              StatusCode::kInvalidArgument);
    CommitRecord c;
    c.tag = id;
    c.version = "v";
    EXPECT_EQ(WriteCommitMarker(storage.get(), c).code(), StatusCode::kInvalidArgument);
  }
  auto listed = storage->List("");
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
}

// ---------------------------------------------------------------- protocol

using RankFiles = std::map<std::string, std::string>;  // name -> content

// One save: data files of every rank, each rank's manifest, then the marker.
Status SaveVersion(Storage* s, const std::string& tag, const std::string& version, uint64_t seq,
                   const std::vector<RankFiles>& ranks) {
  const uint32_t world = static_cast<uint32_t>(ranks.size());
  for (uint32_t r = 0; r < world; ++r) {
    Manifest m;
    m.tag = tag;
    m.version = version;
    m.rank = r;
    m.world_size = world;
    for (const auto& [name, content] : ranks[r]) {
      NEBULITE_ASSIGN_OR_RETURN(auto f, s->NewWritableFile(DataFilePath(tag, version, r, name), 0));
      NEBULITE_RETURN_IF_ERROR(f->WriteAt(0, content.data(), content.size()));
      NEBULITE_RETURN_IF_ERROR(f->Sync());
      NEBULITE_RETURN_IF_ERROR(f->Close());
      m.files.push_back({name, content.size(), CrcOf(content)});
    }
    NEBULITE_RETURN_IF_ERROR(WriteManifest(s, m));
  }
  NEBULITE_ASSIGN_OR_RETURN(bool all, AllManifestsPresent(s, tag, version, world));
  if (!all) return Status::Internal("manifests missing after WriteManifest");
  CommitRecord c;
  c.tag = tag;
  c.version = version;
  c.seq = seq;
  c.time_unix_ns = 1700000000000000000 + static_cast<int64_t>(seq);
  c.world_size = world;
  return WriteCommitMarker(s, c);
}

std::vector<RankFiles> TwoRanks(const std::string& salt) {
  return {{{"model.pt", "weights of rank 0 " + salt}, {"optim 0.pt", std::string(5000, 'o')}},
          {{"model.pt", "weights of rank 1 " + salt}, {"empty", ""}}};
}

// Everything a committed version promises is there and intact.
Status CheckIntact(Storage* s, const CommitRecord& c) {
  for (uint32_t r = 0; r < c.world_size; ++r) {
    const std::string path = ManifestPath(c.tag, c.version, r);
    NEBULITE_ASSIGN_OR_RETURN(std::string text, s->ReadFile(path, kMaxManifestBytes));
    if (CrcOf(text) != c.manifest_crc32.at(r)) return Status::Corruption(path + " changed");
    NEBULITE_ASSIGN_OR_RETURN(Manifest m, ReadManifest(s, c.tag, c.version, r));
    for (const ManifestFile& f : m.files) {
      NEBULITE_RETURN_IF_ERROR(VerifyDataFile(s, DataFilePath(c.tag, c.version, r, f.name), f));
    }
  }
  return Status::OK();
}

std::vector<std::string> CommittedIds(Storage* s, bool check_intact = true) {
  auto catalog = ReadCatalog(s);
  EXPECT_TRUE(catalog.ok()) << catalog.status().ToString();
  std::vector<std::string> ids;
  if (!catalog.ok()) return ids;
  EXPECT_TRUE(catalog->warnings.empty()) << catalog->warnings.front();
  for (const CatalogEntry& e : catalog->entries) {
    if (check_intact) {
      Status st = CheckIntact(s, e.commit);
      EXPECT_TRUE(st.ok()) << e.commit.tag << "/" << e.commit.version << ": " << st.ToString();
    }
    ids.push_back(e.commit.tag + "/" + e.commit.version);
  }
  return ids;
}

TEST(CommitProtocolTest, FullProtocolOnFaultStorage) {
  auto base = NewMemoryStorage();
  auto fs = FaultStorage::Wrap(base.get());
  ASSERT_TRUE(SaveVersion(fs.get(), "checkpoint", "v1", 1, TwoRanks("a")).ok());
  fs->Crash();  // everything the protocol wrote is durable
  EXPECT_EQ(CommittedIds(fs.get()), (std::vector<std::string>{"checkpoint/v1"}));
  auto catalog = ReadCatalog(fs.get());
  ASSERT_TRUE(catalog.ok());
  const CommitRecord& c = catalog->entries.at(0).commit;
  EXPECT_EQ(c.seq, 1u);
  EXPECT_EQ(c.world_size, 2u);
  ASSERT_EQ(c.manifest_crc32.size(), 2u);
  auto m1 = ReadManifest(fs.get(), "checkpoint", "v1", 1);
  ASSERT_TRUE(m1.ok());
  EXPECT_EQ(m1->files.size(), 2u);
  EXPECT_EQ(m1->files[0].name, "empty");
  EXPECT_EQ(ReadManifest(fs.get(), "checkpoint", "v1", 0)->rank, 0u);
}

TEST(CommitProtocolTest, WriteCommitMarkerChecksManifests) {
  auto s = NewMemoryStorage();
  Manifest m;
  m.tag = "t";
  m.version = "v";
  m.rank = 0;
  m.world_size = 2;
  ASSERT_TRUE(WriteManifest(s.get(), m).ok());
  CommitRecord c;
  c.tag = "t";
  c.version = "v";
  c.seq = 1;
  c.world_size = 2;
  EXPECT_FALSE(Val(AllManifestsPresent(s.get(), "t", "v", 2)));
  EXPECT_EQ(WriteCommitMarker(s.get(), c).code(), StatusCode::kFailedPrecondition);
  m.rank = 1;
  m.world_size = 3;  // inconsistent with the commit
  ASSERT_TRUE(WriteManifest(s.get(), m).ok());
  EXPECT_TRUE(Val(AllManifestsPresent(s.get(), "t", "v", 2)));
  EXPECT_EQ(WriteCommitMarker(s.get(), c).code(), StatusCode::kCorruption);
  m.world_size = 2;
  ASSERT_TRUE(WriteManifest(s.get(), m).ok());
  c.manifest_crc32 = {1, 2};  // not what the files hold
  EXPECT_EQ(WriteCommitMarker(s.get(), c).code(), StatusCode::kCorruption);
  c.manifest_crc32 = {1};  // wrong count
  EXPECT_EQ(WriteCommitMarker(s.get(), c).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(Val(s->Exists(CommitMarkerPath("t", "v"))));
  c.manifest_crc32 = {CrcOf(Val(s->ReadFile(ManifestPath("t", "v", 0), 1 << 20))),
                      CrcOf(Val(s->ReadFile(ManifestPath("t", "v", 1), 1 << 20)))};
  EXPECT_TRUE(WriteCommitMarker(s.get(), c).ok());
  EXPECT_EQ(CommittedIds(s.get()), (std::vector<std::string>{"t/v"}));
}

TEST(CommitProtocolTest, VerifyDataFile) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(SaveVersion(s.get(), "t", "v", 1, TwoRanks("x")).ok());
  auto m = ReadManifest(s.get(), "t", "v", 0);
  ASSERT_TRUE(m.ok());
  const ManifestFile f = m->files.at(0);  // "model.pt"
  const std::string path = DataFilePath("t", "v", 0, f.name);
  EXPECT_TRUE(VerifyDataFile(s.get(), path, f).ok());
  ManifestFile wrong_size = f;
  wrong_size.size += 1;
  Status st = VerifyDataFile(s.get(), path, wrong_size);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_NE(st.message().find(path), std::string::npos);
  ManifestFile wrong_crc = f;
  wrong_crc.crc32 ^= 1;
  st = VerifyDataFile(s.get(), path, wrong_crc);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_NE(st.message().find(path), std::string::npos);
  st = VerifyDataFile(s.get(), "t/v/rank0/missing", f);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_NE(st.message().find("t/v/rank0/missing"), std::string::npos);
  // Multi-chunk files (the reader works in 8 MiB chunks).
  std::string big(20u << 20, '\0');
  for (size_t i = 0; i < big.size(); i += 4099) big[i] = static_cast<char>(i);
  ASSERT_TRUE(s->WriteFileAtomic("t/v/rank0/big", big).ok());
  EXPECT_TRUE(VerifyDataFile(s.get(), "t/v/rank0/big", {"big", big.size(), CrcOf(big)}).ok());
}

TEST(CommitProtocolTest, ReadDataFileReadsAndVerifiesInOnePass) {
  auto s = NewMemoryStorage();
  // Several pieces of the reader (16 MiB) and sizes that are not a multiple of anything.
  std::string big((40u << 20) + 12345, '\0');
  for (size_t i = 0; i < big.size(); i += 4099) big[i] = static_cast<char>(i);
  ASSERT_TRUE(s->WriteFileAtomic("t/v/rank0/big", big).ok());
  const ManifestFile f{"big", big.size(), CrcOf(big)};
  const std::string path = "t/v/rank0/big";
  for (int threads : {1, 3}) {
    // The whole file into one buffer.
    std::string got(big.size(), 'x');
    ASSERT_TRUE(ReadDataFile(s.get(), path, f, {{0, big.size(), got.data()}}, threads).ok());
    EXPECT_EQ(got, big);
    // Two records into their own buffers, the bytes around them only checksummed.
    std::string a(3u << 20, 'x'), b((20u << 20) + 7, 'x');
    const uint64_t a_at = 4096, b_at = a_at + a.size() + 100;
    std::vector<FileSpan> spans = {{0, a_at, nullptr},
                                   {a_at, a.size(), a.data()},
                                   {a_at + a.size(), 100, nullptr},
                                   {b_at, b.size(), b.data()},
                                   {b_at + b.size(), big.size() - b_at - b.size(), nullptr}};
    std::vector<uint32_t> crcs;
    ASSERT_TRUE(ReadDataFile(s.get(), path, f, spans, threads, &crcs).ok());
    EXPECT_EQ(a, big.substr(a_at, a.size()));
    EXPECT_EQ(b, big.substr(b_at, b.size()));
    ASSERT_EQ(crcs.size(), spans.size());
    for (size_t k = 0; k < spans.size(); ++k)
      EXPECT_EQ(crcs[k], CrcOf(big.substr(spans[k].offset, spans[k].size))) << k;
  }
  std::string got(big.size() + 1, 'x');
  ManifestFile wrong_crc = f;
  wrong_crc.crc32 ^= 1;
  Status st = ReadDataFile(s.get(), path, wrong_crc, {{0, f.size, got.data()}}, 2);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_NE(st.message().find(path), std::string::npos);
  ManifestFile wrong_size = f;
  wrong_size.size += 1;
  EXPECT_EQ(ReadDataFile(s.get(), path, wrong_size, {{0, wrong_size.size, got.data()}}, 2).code(),
            StatusCode::kCorruption);
  EXPECT_EQ(ReadDataFile(s.get(), "t/v/rank0/missing", f, {{0, f.size, got.data()}}, 2).code(),
            StatusCode::kCorruption);
  // Spans that do not tile the file are the caller's mistake.
  EXPECT_EQ(
      ReadDataFile(s.get(), path, f, {{0, 10, nullptr}, {11, f.size - 11, nullptr}}, 2).code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadDataFile(s.get(), path, f, {{0, f.size - 1, nullptr}}, 2).code(),
            StatusCode::kInvalidArgument);
  // An empty file.
  ASSERT_TRUE(s->WriteFileAtomic("t/v/rank0/empty", "").ok());
  EXPECT_TRUE(ReadDataFile(s.get(), "t/v/rank0/empty", {"empty", 0, CrcOf("")}, {}, 2).ok());
}

// A crash at every operation index of a save never exposes a torn version and never
// harms the version committed before it.
TEST(CommitProtocolTest, CrashAtEveryOperationOfASave) {
  int completed_at = -1;
  for (int k = 0; k < 500 && completed_at < 0; ++k) {
    SCOPED_TRACE("crash after " + std::to_string(k) + " operations");
    auto base = NewMemoryStorage();
    auto fs = FaultStorage::Wrap(base.get());
    ASSERT_TRUE(SaveVersion(fs.get(), "checkpoint", "v1", 1, TwoRanks("old")).ok());
    fs->FailAfter(StorageOp::kAny, k, Status::IOError("power cut"));
    Status saved = SaveVersion(fs.get(), "checkpoint", "v2", 2, TwoRanks("new"));
    fs->ClearFailures();
    fs->Crash();
    const std::vector<std::string> ids = CommittedIds(fs.get());  // all intact
    if (saved.ok()) {
      completed_at = k;
      EXPECT_EQ(ids, (std::vector<std::string>{"checkpoint/v1", "checkpoint/v2"}));
    } else {
      EXPECT_EQ(ids, (std::vector<std::string>{"checkpoint/v1"}));
    }
    // The store stays usable after the crash: the save can be redone.
    ASSERT_TRUE(SaveVersion(fs.get(), "checkpoint", "v3", 3, TwoRanks("again")).ok());
    fs->Crash();
    EXPECT_EQ(CommittedIds(fs.get()).back(), "checkpoint/v3");
  }
  EXPECT_GT(completed_at, 20) << "the save should take many operations";
}

// The same with only the data writes and syncs failing, i.e. torn data files.
TEST(CommitProtocolTest, CrashWithUnsyncedDataNeverCommits) {
  auto base = NewMemoryStorage();
  auto fs = FaultStorage::Wrap(base.get());
  fs->FailAfter(StorageOp::kSync, 1, Status::IOError("EIO"));
  EXPECT_FALSE(SaveVersion(fs.get(), "t", "v", 1, TwoRanks("x")).ok());
  fs->ClearFailures();
  fs->Crash();
  EXPECT_TRUE(CommittedIds(fs.get()).empty());
}

// ---------------------------------------------------------------- catalog, retention

TEST(CatalogTest, OrdersBySeqNotByName) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(SaveVersion(s.get(), "global_step900", "v", 1, TwoRanks("a")).ok());
  ASSERT_TRUE(SaveVersion(s.get(), "global_step1000", "v", 2, TwoRanks("b")).ok());
  ASSERT_TRUE(SaveVersion(s.get(), "checkpoint", "v1", 3, TwoRanks("c")).ok());
  ASSERT_TRUE(SaveVersion(s.get(), "checkpoint", "v0", 4, TwoRanks("d")).ok());
  // An uncommitted version is invisible.
  Manifest m;
  m.tag = "checkpoint";
  m.version = "in-progress";
  ASSERT_TRUE(WriteManifest(s.get(), m).ok());
  EXPECT_EQ(CommittedIds(s.get()),
            (std::vector<std::string>{"global_step900/v", "global_step1000/v", "checkpoint/v1",
                                      "checkpoint/v0"}));
}

TEST(CatalogTest, SkipsCorruptMarkerWithWarning) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(SaveVersion(s.get(), "good", "v", 1, TwoRanks("a")).ok());
  ASSERT_TRUE(SaveVersion(s.get(), "bad", "v", 2, TwoRanks("b")).ok());
  auto text = s->ReadFile(CommitMarkerPath("bad", "v"), 1 << 20);
  ASSERT_TRUE(text.ok());
  std::string damaged = *text;
  damaged[damaged.size() / 2] ^= 0x10;
  ASSERT_TRUE(s->WriteFileAtomic(CommitMarkerPath("bad", "v"), damaged).ok());
  // A marker copied into another version's directory does not count either.
  ASSERT_TRUE(s->WriteFileAtomic(CommitMarkerPath("good", "copy"), *text).ok());
  // Stray files at the top level are ignored.
  ASSERT_TRUE(s->WriteFileAtomic(".leftover.tmp", "x").ok());
  auto catalog = ReadCatalog(s.get());
  ASSERT_TRUE(catalog.ok()) << catalog.status().ToString();
  ASSERT_EQ(catalog->entries.size(), 1u);
  EXPECT_EQ(catalog->entries[0].commit.tag, "good");
  ASSERT_EQ(catalog->warnings.size(), 2u);
  EXPECT_NE(catalog->warnings[0].find("bad/v/COMMITTED"), std::string::npos)
      << catalog->warnings[0];
  EXPECT_NE(catalog->warnings[1].find("good/copy/COMMITTED"), std::string::npos)
      << catalog->warnings[1];
}

using Pair = std::pair<std::string, std::string>;

// Retention with a fresh checker; the deleted versions.
Result<std::vector<Pair>> Retain(Storage* s, uint32_t keep) {
  VersionChecker checker(s);
  NEBULITE_ASSIGN_OR_RETURN(RetentionResult r, ApplyRetention(s, keep, &checker));
  return r.deleted;
}

TEST(RetentionTest, KeepsNewestBySeq) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(SaveVersion(s.get(), "global_step9", "v", 1, TwoRanks("a")).ok());
  ASSERT_TRUE(SaveVersion(s.get(), "checkpoint", "v1", 2, TwoRanks("b")).ok());
  ASSERT_TRUE(SaveVersion(s.get(), "global_step10", "v", 3, TwoRanks("c")).ok());
  ASSERT_TRUE(SaveVersion(s.get(), "checkpoint", "v2", 4, TwoRanks("d")).ok());
  Manifest in_progress;
  in_progress.tag = "global_step9";
  in_progress.version = "w";
  ASSERT_TRUE(WriteManifest(s.get(), in_progress).ok());

  EXPECT_EQ(Retain(s.get(), 0).status().code(), StatusCode::kInvalidArgument);
  auto deleted = Retain(s.get(), 2);
  ASSERT_TRUE(deleted.ok()) << deleted.status().ToString();
  EXPECT_EQ(*deleted, (std::vector<Pair>{{"global_step9", "v"}, {"checkpoint", "v1"}}));
  EXPECT_EQ(CommittedIds(s.get()), (std::vector<std::string>{"global_step10/v", "checkpoint/v2"}));
  // The uncommitted version was not touched; the emptied tag directory would be removed.
  EXPECT_TRUE(Val(s->Exists(ManifestPath("global_step9", "w", 0))));
  EXPECT_FALSE(Val(s->Exists("checkpoint/v1")));

  deleted = Retain(s.get(), 1);
  ASSERT_TRUE(deleted.ok());
  EXPECT_EQ(*deleted, (std::vector<Pair>{{"global_step10", "v"}}));
  EXPECT_FALSE(Val(s->Exists("global_step10")));  // empty tag directory removed
  EXPECT_EQ(CommittedIds(s.get()), (std::vector<std::string>{"checkpoint/v2"}));
  deleted = Retain(s.get(), 1);
  ASSERT_TRUE(deleted.ok());
  EXPECT_TRUE(deleted->empty());
}

// A crash at every operation index of retention leaves each version either committed and
// intact or invisible, and never touches the newest.
TEST(RetentionTest, CrashAtEveryOperation) {
  int completed_at = -1;
  for (int k = 0; k < 500 && completed_at < 0; ++k) {
    SCOPED_TRACE("crash after " + std::to_string(k) + " operations");
    auto base = NewMemoryStorage();
    auto fs = FaultStorage::Wrap(base.get());
    ASSERT_TRUE(SaveVersion(fs.get(), "b", "v", 1, TwoRanks("1")).ok());
    ASSERT_TRUE(SaveVersion(fs.get(), "a", "v", 2, TwoRanks("2")).ok());
    ASSERT_TRUE(SaveVersion(fs.get(), "a", "w", 3, TwoRanks("3")).ok());
    fs->FailAfter(StorageOp::kAny, k, Status::IOError("power cut"));
    auto deleted = Retain(fs.get(), 1);
    fs->ClearFailures();
    fs->Crash();
    const std::vector<std::string> ids = CommittedIds(fs.get());  // all intact
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(ids.back(), "a/w");
    // Checks that hit the failure count nothing as kept, so retention may end without
    // deleting; once it deleted both, only the newest is left.
    if (deleted.ok() && deleted->size() == 2) {
      completed_at = k;
      EXPECT_EQ(ids, (std::vector<std::string>{"a/w"}));
    }
    // Retention can be rerun after the crash and finishes the job.
    ASSERT_TRUE(Retain(fs.get(), 1).ok());
    fs->Crash();
    EXPECT_EQ(CommittedIds(fs.get()), (std::vector<std::string>{"a/w"}));
  }
  EXPECT_GT(completed_at, 5);
}

// A damaged version never counts as one to keep: retention keeps the newest intact ones
// and never deletes an intact version because of a damaged newer one.
TEST(RetentionTest, DamagedVersionsDoNotCount) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(SaveVersion(s.get(), "a", "v", 1, TwoRanks("1")).ok());
  ASSERT_TRUE(SaveVersion(s.get(), "b", "v", 2, TwoRanks("2")).ok());
  // Damage b in place (same size: only its CRC tells).
  const std::string path = DataFilePath("b", "v", 1, "model.pt");
  auto text = s->ReadFile(path, 1 << 20);
  ASSERT_TRUE(text.ok());
  std::string flipped = *text;
  flipped[0] ^= 1;
  auto f = s->NewWritableFile(path, 0);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->WriteAt(0, flipped.data(), flipped.size()).ok());
  ASSERT_TRUE((*f)->Close().ok());
  ASSERT_TRUE(SaveVersion(s.get(), "c", "v", 3, TwoRanks("3")).ok());
  VersionChecker checker(s.get());
  auto r = ApplyRetention(s.get(), 2, &checker);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->deleted.empty());  // c and a are the two intact ones: nothing older to drop
  ASSERT_EQ(r->warnings.size(), 1u);
  EXPECT_NE(r->warnings[0].find("'b'"), std::string::npos) << r->warnings[0];
  // Once two newer intact versions exist, the damaged one and the old one go.
  ASSERT_TRUE(SaveVersion(s.get(), "d", "v", 4, TwoRanks("4")).ok());
  r = ApplyRetention(s.get(), 2, &checker);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->deleted, (std::vector<Pair>{{"a", "v"}, {"b", "v"}}));
  // A missing file is damage too; a version that lost one is skipped, its elder kept.
  ASSERT_TRUE(s->Delete(DataFilePath("d", "v", 0, "model.pt")).ok());
  r = ApplyRetention(s.get(), 1, &checker);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->deleted.empty());
  auto catalog = ReadCatalog(s.get());
  ASSERT_TRUE(catalog.ok());
  EXPECT_EQ(catalog->entries.size(), 2u);
}

TEST(RetentionTest, NeverDeletesTheProtectedVersion) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(SaveVersion(s.get(), "a", "v", 5, TwoRanks("1")).ok());
  ASSERT_TRUE(SaveVersion(s.get(), "b", "v", 9, TwoRanks("2")).ok());
  VersionChecker checker(s.get());
  auto r = ApplyRetention(s.get(), 1, &checker, "a", "v");
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->deleted.empty());
}

// The marker never vouches for a file that is not there.
TEST(CommitProtocolTest, MarkerRequiresEveryFileWithItsSize) {
  auto s = NewMemoryStorage();
  Manifest m;
  m.tag = "t";
  m.version = "v";
  m.files.push_back({"gone", 10, 0});
  ASSERT_TRUE(WriteManifest(s.get(), m).ok());
  CommitRecord c;
  c.tag = "t";
  c.version = "v";
  c.seq = 1;
  Status st = WriteCommitMarker(s.get(), c);
  EXPECT_EQ(st.code(), StatusCode::kCorruption) << st.ToString();
  EXPECT_NE(st.message().find("t/v/rank0/gone"), std::string::npos) << st.ToString();
  ASSERT_TRUE(s->WriteFileAtomic(DataFilePath("t", "v", 0, "gone"), "short").ok());
  EXPECT_EQ(WriteCommitMarker(s.get(), c).code(), StatusCode::kCorruption);
  EXPECT_FALSE(Val(s->Exists(CommitMarkerPath("t", "v"))));
  ASSERT_TRUE(s->WriteFileAtomic(DataFilePath("t", "v", 0, "gone"), "0123456789").ok());
  EXPECT_TRUE(WriteCommitMarker(s.get(), c).ok());
}

// Commit numbers come from the store: monotonic whatever the caller believes, unique
// among writers, above every committed version of a store that has no claims yet.
TEST(CommitProtocolTest, ClaimCommitSeq) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(SaveVersion(s.get(), "old", "v", 41, TwoRanks("1")).ok());
  EXPECT_EQ(Val(ClaimCommitSeq(s.get(), 1)), 42u);
  EXPECT_EQ(Val(ClaimCommitSeq(s.get(), 1)), 43u);  // a stale caller still moves forward
  EXPECT_EQ(Val(ClaimCommitSeq(s.get(), 100)), 100u);
  EXPECT_EQ(Val(ClaimCommitSeq(s.get(), 7)), 101u);
  EXPECT_EQ(Val(s->List(".nebulite/seq")).size(), 1u);  // only the newest claim is kept
  // Concurrent claimants never get the same number.
  std::vector<uint64_t> got(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] { got[t] = Val(ClaimCommitSeq(s.get(), 1)); });
  for (auto& th : threads) th.join();
  std::sort(got.begin(), got.end());
  EXPECT_EQ(std::unique(got.begin(), got.end()), got.end());
  EXPECT_GT(got.front(), 101u);
}

TEST(CatalogTest, SkipsWhatItCannotReadAndOddEntries) {
  auto s = NewMemoryStorage();
  ASSERT_TRUE(SaveVersion(s.get(), "good", "v", 1, TwoRanks("a")).ok());
  ASSERT_TRUE(s->CreateDirs("odd/v/COMMITTED").ok());  // a directory where a marker goes
  ASSERT_TRUE(s->CreateDirs(".hidden/v").ok());        // the store's own names are skipped
  auto catalog = ReadCatalog(s.get());
  ASSERT_TRUE(catalog.ok()) << catalog.status().ToString();
  ASSERT_EQ(catalog->entries.size(), 1u);
  ASSERT_EQ(catalog->warnings.size(), 1u);
  EXPECT_NE(catalog->warnings[0].find("odd/v/COMMITTED"), std::string::npos);
}

TEST(CommitProtocolTest, TagsAndVersionsStartingWithADotAreRefused) {
  EXPECT_EQ(ValidateTag(".hidden").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateVersionName(".v").code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateTag("global_step.5").ok());
  Manifest m;
  m.tag = ".hidden";
  m.version = "v";
  EXPECT_EQ(WriteManifest(NewMemoryStorage().get(), m).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nebulite

// Helpers shared by the engine's GoogleTest suites (included by *_test.cc files only).
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "nebulite/commit.h"
#include "nebulite/crc32.h"
#include "nebulite/engine.h"
#include "nebulite/fault_storage.h"
#include "nebulite/stored_archive.h"

namespace nebulite::engine_test {

class TempDir {
 public:
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "nebulite_engine_XXXXXX").string();
    path_ = mkdtemp(t.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 7 + seed + (i >> 12));
  return v;
}

// An object to stage: its payloads and the records pointing at them.
struct Object {
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<SourceRecord> records;
};

inline Object MakeObject(const std::vector<size_t>& sizes, uint8_t seed) {
  Object o;
  o.payloads.reserve(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) o.payloads.push_back(Bytes(sizes[i], seed + i));
  for (size_t i = 0; i < sizes.size(); ++i)
    o.records.push_back({i == 0 ? "data.pkl" : "data/" + std::to_string(i - 1),
                         o.payloads[i].data(), o.payloads[i].size()});
  return o;
}

inline EngineOptions Options(const std::string& root, uint64_t memory = 32 << 20) {
  EngineOptions o;
  o.persist_root = root;
  o.memory_bytes = memory;
  o.prefault = false;
  o.copy_threads = 2;
  o.io_threads = 2;
  return o;
}

// A memory store behind a fault-injecting wrapper, shared by engines.
struct FaultyStore {
  std::shared_ptr<Storage> base{NewMemoryStorage()};
  std::shared_ptr<FaultStorage> fault{FaultStorage::Wrap(base.get())};
};

inline EngineOptions OptionsOn(const FaultyStore& s, uint32_t rank = 0, uint32_t world = 1,
                        uint32_t retention = 0, uint64_t memory = 32 << 20) {
  EngineOptions o = Options("", memory);
  o.storage_override = s.fault;
  o.rank = rank;
  o.world_size = world;
  o.retention = retention;
  o.commit_timeout_seconds = 30;
  return o;
}

inline std::unique_ptr<Engine> Open(const EngineOptions& o) {
  auto e = Engine::Open(o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

// The engines of ranks 0 and 1 of a world of two, with the options `o` otherwise (null
// where opening failed, a failure of the caller's test).
inline std::vector<std::unique_ptr<Engine>> OpenTwoRanks(EngineOptions o) {
  o.world_size = 2;
  std::vector<std::unique_ptr<Engine>> ranks;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    o.rank = rank;
    ranks.push_back(Open(o));
  }
  return ranks;
}

// Reads every record of a persisted data file back and compares it (failures are the
// caller's test failures).
inline void ExpectStored(Storage* s, const std::string& path, const Object& o) {
  auto a = StoredArchive::Open(s, path);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  for (size_t i = 0; i < o.records.size(); ++i) {
    const auto* e = (*a)->index().Find(o.records[i].name);
    ASSERT_NE(e, nullptr) << o.records[i].name;
    std::vector<uint8_t> got(e->size);
    Status rs = (*a)->ReadInto(*e, got.data(), 2);
    ASSERT_TRUE(rs.ok()) << rs.ToString();
    EXPECT_EQ(got, o.payloads[i]) << o.records[i].name;
  }
}

// OK if every committed version in the store is whole: every file of every manifest
// verifies against its size and CRC.
inline Status CheckEveryCommittedVersion(Storage* s) {
  NEBULITE_ASSIGN_OR_RETURN(Catalog catalog, ReadCatalog(s));
  for (const CatalogEntry& e : catalog.entries) {
    for (uint32_t r = 0; r < e.commit.world_size; ++r) {
      NEBULITE_ASSIGN_OR_RETURN(Manifest m, ReadManifest(s, e.commit.tag, e.commit.version, r));
      for (const ManifestFile& f : m.files) {
        NEBULITE_RETURN_IF_ERROR(
            VerifyDataFile(s, DataFilePath(e.commit.tag, e.commit.version, r, f.name), f));
      }
    }
  }
  return Status::OK();
}

// The (tag, version) pairs committed in the store, oldest first.
inline std::vector<std::string> Committed(Storage* s) {
  std::vector<std::string> out;
  auto catalog = ReadCatalog(s);
  EXPECT_TRUE(catalog.ok()) << catalog.status().ToString();
  if (!catalog.ok()) return out;
  for (const auto& e : catalog->entries) out.push_back(e.commit.tag + "/" + e.commit.version);
  return out;
}

}  // namespace nebulite::engine_test

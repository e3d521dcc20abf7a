// VersionTable: the versions one engine knows, their objects, and the decisions about
// their memory: which versions may leave the arena, and when.
//
// Life of a version in the table:
//   open         objects are being staged (Stage, Reserve/Seal, Adopt)
//   committed    complete on this rank (Commit); loadable from memory
//   [persisting] persist_requested: its data files and manifest are being written;
//                persisted once this rank's manifest is durable; store_committed once
//                its commit marker is known to be in the store; or failed
//   evicted      its arena blocks went back (it stays loadable from the store if it was
//                persisted)
//   forgotten    removed from the table once nothing more is expected of it
// A version leaves memory only when nobody reads it (pins == 0) and it is durable or will
// never be persisted; the newest committed version stays unless it is durable (or a newer
// one, committed in the store, has left memory and been forgotten).
//
// Thread-safety: none. The engine calls every method with its mutex held.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "nebulite/arena.h"
#include "nebulite/commit.h"
#include "nebulite/engine.h"
#include "nebulite/format.h"

namespace nebulite {

struct ObjectState {
  std::string name;
  format::ArchiveLayout layout;
  std::vector<RecordRef> refs;
  std::vector<uint32_t> crcs;  // each record's CRC-32, computed while it was staged
  ArenaBlock block;
  bool in_memory = false;        // its image is in `block`
  bool streamed = false;         // written straight to the store (or adopted): not in memory
  bool sealed = true;            // every byte and CRC is in place (false while being copied)
  bool awaiting_writer = false;  // reserved by Reserve(), not yet sealed by its writer
  bool queued = false;           // a persist job for it is queued or running
  bool written = false;          // its data file is durable at its final name (`file` valid)
  uint64_t bytes = 0;
  double blocking_seconds = 0;
  ManifestFile file;  // name, size and whole-file CRC (known once sealed or written)
};

struct VersionState {
  std::string tag, version;
  std::vector<std::unique_ptr<ObjectState>> objects;
  bool committed = false;
  uint64_t seq = 0;  // the commit order given at Commit(); the store's once committed there
  int64_t commit_unix_ns = 0;
  bool must_persist = false;  // an object was streamed: the version exists only in the store
  bool persist_requested = false;
  bool store_touched = false;       // this rank created something of it in the store
  bool manifest_attempted = false;  // this rank's manifest may be published: keep its files
  std::string manifest_written;     // this rank's manifest as written (the commit's copy)
  bool persisted = false;           // this rank's manifest is durable
  bool store_committed = false;     // the commit marker is known to exist
  bool failed = false;
  bool failure_flushed = false;  // a Flush() has returned this failure
  Status error;
  bool evicted = false;
  bool abandoned = false;
  int pins = 0;  // readers, jobs and copies that need its memory

  ObjectState* Find(const std::string& name) {
    for (auto& o : objects)
      if (o->name == name) return o.get();
    return nullptr;
  }
  // Waiting for the store: persisting, or persisted and waiting for the commit marker.
  bool PendingInStore() const { return persist_requested && !failed && !store_committed; }
};

class VersionTable {
 public:
  VersionTable(Arena* arena, uint32_t retention) : arena_(arena), retention_(retention) {}

  std::shared_ptr<VersionState> Find(const std::string& tag, const std::string& version) const;
  std::shared_ptr<VersionState> GetOrCreate(const std::string& tag, const std::string& version);
  void Remove(const std::shared_ptr<VersionState>& v) { versions_.remove(v); }
  const std::list<std::shared_ptr<VersionState>>& all() const { return versions_; }

  // Gives an object's arena block back.
  void Release(ObjectState* o);
  // Evicts the oldest version that may leave memory; with `durable_only`, only one whose
  // files are persisted (it stays loadable from the store). False if there is none.
  bool EvictOldest(bool durable_only);
  // Forgets versions that left memory and need nothing more.
  void Collect();
  // Keeps at most `retention` committed versions in memory (0: no limit), then Collect().
  void ApplyRetention();
  // See Engine::memory_reclaimable().
  uint64_t Reclaimable() const;

 private:
  bool Evictable(const VersionState& v, const VersionState* newest) const;
  // The newest committed version held, the one that stays in memory unless it is durable;
  // none once a newer one, committed in the store, was forgotten (it supersedes them all).
  const VersionState* NewestCommitted() const;

  Arena* arena_;
  const uint32_t retention_;
  std::list<std::shared_ptr<VersionState>> versions_;
  uint64_t forgotten_durable_seq_ = 0;  // the newest commit order Collect() forgot, in the store
};

}  // namespace nebulite

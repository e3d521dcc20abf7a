// Engine: the checkpoint engine of one rank. It owns the tier-1 arena, the copy
// engine, the persister and (on rank 0) the commit coordinator. The same engine
// runs embedded in a trainer process or hosted by a node agent.
//
// Lifecycle of a version (one save of a tag), as seen through this class:
//   Stage() for each object        reserve -> copy into the arena, computing each
//                                  record's CRC-32 -> sealed (returns)
//   Commit(seq, persist)           complete on this rank; visible in Versions()
//   [persist] background persister data files (their CRCs checked against those of the
//                                  staging copy) -> manifest  ("persisted")
//   [rank 0]  coordinator          all ranks' manifests, every file they name present ->
//                                  commit number claimed in the store -> COMMITTED
//                                  marker -> retention of older committed versions
//   eviction                       arena blocks released once the version is persisted,
//                                  or superseded when it was never to be persisted
// An object larger than the free arena, when a store is configured, streams through
// the arena in chunks straight into its data file; its version must then be persisted.
//
// Errors of background work never abort: they are queued for TakeErrors() and
// written to the history with outcome "failed". No failure deletes a file that a
// manifest that may be published names (persist/persister.h has the policy).
// Thread-safety: all public methods are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nebulite/arena.h"
#include "nebulite/commit.h"
#include "nebulite/format.h"
#include "nebulite/status.h"
#include "nebulite/storage.h"

namespace nebulite {

struct EngineOptions {
  std::string persist_root;  // "" = memory tier only
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint64_t memory_bytes = 0;  // arena capacity; 0 = DefaultMemoryBytes()
  bool prefault = false;      // touch the whole arena once in the background
  int copy_threads = 0;       // 0 = every CPU
  int io_threads = 0;         // 0 = 4
  bool direct_io = true;
  uint32_t file_mode = 0;                // of the files it persists: PosixOptions::file_mode
  uint32_t retention = 0;                // committed versions kept (store and memory); 0 = all
  double commit_timeout_seconds = 600;   // how long rank 0 waits for other ranks
  double reserve_timeout_seconds = 600;  // how long a save waits for arena space
  bool write_history = true;             // checkpointHistories.csv in the store
  // Tests: a store to use instead of opening persist_root (which then only names
  // the directory of the history file, and may be empty).
  std::shared_ptr<Storage> storage_override;
  // An arena shared with other engines (several ranks of one node drawing on one
  // budget); memory_bytes and prefault are then ignored.
  std::shared_ptr<Arena> arena;
  // Where the engine counts the errors it reports for TakeErrors(): it adds 1 to this
  // 8-byte-aligned counter, atomically, after each. In memory shared with the process that
  // takes them, that process tells without asking that there is nothing to take. It must
  // stay valid while the engine's threads may run (the life of the process, in practice).
  uint64_t* error_count = nullptr;
};

// Limits of EngineOptions (Open() refuses anything else with InvalidArgument).
inline constexpr int kMaxThreads = 1024;

// 25% of physical memory, rounded to 2 MiB.
uint64_t DefaultMemoryBytes();

struct SourceRecord {
  std::string name;  // record name in the archive, e.g. "data.pkl", "data/0"
  const void* data;
  uint64_t size;
  // The caller guarantees these bytes stay unchanged until WaitStaged() returns, so
  // they may be copied in the background after Stage() returns.
  bool deferred = false;
};

struct StageInfo {
  uint64_t bytes = 0;           // size of the data file
  double blocking_seconds = 0;  // time spent in Stage()
  bool streamed = false;        // written through to the store instead of kept in memory
  bool deferred = false;        // some bytes are still being copied in the background
};

struct RecordRef {
  std::string name;
  uint64_t offset = 0;  // of the payload within the image
  uint64_t size = 0;
};

// An object's image reserved in the arena, for a writer that fills it itself (another
// process mapping the same arena, say): record i's payload goes to
// arena base + arena_offset + records[i].offset, and its CRC-32 is handed to Seal().
struct Reservation {
  uint64_t arena_offset = 0;
  uint64_t bytes = 0;  // size of the data file
  std::vector<RecordRef> records;
};

// A pinned, sealed object in the arena. The memory stays valid (and the version
// is not evicted) while the lease lives.
class ObjectLease {
 public:
  virtual ~ObjectLease() = default;
  virtual const uint8_t* data() const = 0;
  virtual const std::vector<RecordRef>& records() const = 0;
};

struct VersionInfo {
  std::string tag;
  std::string version;
  uint64_t seq = 0;            // the commit order: the store's once committed there
  int64_t commit_unix_ns = 0;  // wall time of Commit()
  bool in_memory = false;      // every object of this rank is loadable from the arena
  // Every object of this rank is loadable: from the arena, or, streamed, from its data
  // file at DataFilePath() (durable, though the version may not be committed in the
  // store yet).
  bool loadable = false;
  std::vector<ManifestFile> streamed;  // the objects of this rank written straight to the store
  bool persist_requested = false;
  bool persisted = false;        // this rank's files and manifest are durable
  bool failed = false;           // persisting failed (see TakeErrors)
  bool store_committed = false;  // its commit marker is known to be in the store
  std::vector<std::string> names;
};

struct HistoryRow {
  std::string tag, version, name;
  uint32_t rank = 0;
  uint64_t bytes = 0;
  double blocking_seconds = 0, persist_seconds = 0;
  std::string tier, outcome;
  int64_t time_unix_ns = 0;  // when the row was added (0 until then)
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Open(const EngineOptions& options);
  virtual ~Engine() = default;

  // Copies the records into tier 1 as the data file of (tag, version, name, rank).
  // Returns once the bytes are sealed in memory (or, streamed, durable in the store).
  // `persist_now`: the version will be persisted, so its data file may be written
  // at once, before the version is committed (its manifest still waits for Commit).
  virtual Result<StageInfo> Stage(const std::string& tag, const std::string& version,
                                  const std::string& name, const std::vector<SourceRecord>& records,
                                  bool persist_now = false) = 0;
  // Zero-copy staging: Reserve() lays out the object and writes its headers; the caller
  // fills every payload and then calls Seal() with each record's CRC-32 (computed while
  // copying), which makes it a staged object exactly as Stage() would (persisted at once
  // with `persist_now`). Discard() drops a reservation
  // that will never be sealed (its writer died). A version cannot be committed while one
  // of its objects is reserved but not sealed. Reserve() never streams: an image larger
  // than the free memory (after waiting) is ResourceExhausted. Without `wait_for_memory`
  // it does not wait: memory that only persisting, unpinning or sealing would give back
  // is ResourceExhausted at once (a caller whose own reservations await their seals, on
  // a connection this call holds, would otherwise wait for itself).
  virtual Result<Reservation> Reserve(const std::string& tag, const std::string& version,
                                      const std::string& name,
                                      const std::vector<format::RecordSpec>& records,
                                      bool wait_for_memory = true) = 0;
  virtual Status Seal(const std::string& tag, const std::string& version, const std::string& name,
                      bool persist_now, const std::vector<uint32_t>& crcs) = 0;
  virtual Status Discard(const std::string& tag, const std::string& version,
                         const std::string& name) = 0;
  // Adds an object whose data file another process already wrote durably at
  // DataFilePath(tag, version, rank, name) (streamed: too large for the memory budget).
  // Its version must then be persisted.
  virtual Status Adopt(const std::string& tag, const std::string& version,
                       const ManifestFile& file) = 0;
  virtual const Arena& arena() const = 0;

  // Waits until every deferred copy has landed in the arena; the sources of deferred
  // records may change after it returns.
  virtual void WaitStaged() = 0;
  // True if some object of the version had to be streamed (it must be persisted).
  virtual bool MustPersist(const std::string& tag, const std::string& version) = 0;
  // Completes the version on this rank. `persist` queues it for the store.
  virtual Status Commit(const std::string& tag, const std::string& version, uint64_t seq,
                        bool persist) = 0;
  // Queues a committed, memory-only version for the store.
  virtual Status Persist(const std::string& tag, const std::string& version) = 0;
  // Waits until everything queued is persisted and committed in the store.
  virtual Status Flush(double timeout_seconds) = 0;
  // Flush() of one version: waits until it is persisted and committed in the store (the
  // others may still be on their way), and reports its failure once. A version that was
  // never queued for the store, or that the engine no longer knows, is not waited for.
  virtual Status FlushVersion(const std::string& tag, const std::string& version,
                              double timeout_seconds) = 0;
  // Drops an uncommitted version: its arena space is released, and what of it this rank
  // already wrote to the store is removed in the background.
  virtual void Abandon(const std::string& tag, const std::string& version) = 0;
  // On a rank other than 0, for a version this rank persisted and whose commit marker it
  // awaits: stops waiting, for whoever would commit it is gone (rank 0's trainer may have
  // died before committing it). Looks in the store once more; if the version is not
  // committed there, it fails (neither Flush() nor TakeErrors() reports it: the caller
  // does) and true is returned. Its files stay in the store: rank 0 may still commit them.
  virtual Result<bool> GiveUpCommit(const std::string& tag, const std::string& version) = 0;
  // Renames an uncommitted version (the ranks agreed on another name for it): its objects,
  // and its files already in the store, move to `to`.
  virtual Status RenameVersion(const std::string& tag, const std::string& from,
                               const std::string& to) = 0;

  // Committed versions of this rank still known to the engine, ordered by seq.
  virtual std::vector<VersionInfo> Versions() = 0;
  // The highest commit number this engine was given (Commit) or claimed in the store (its
  // commits there take a number above every other writer's): the next commit's order
  // starts after it, without a request to the store. 0 before any commit.
  virtual uint64_t NewestSeq() = 0;
  // Pins an object of a committed version held in memory (NotFound otherwise), waiting
  // for a deferred copy of it to land.
  virtual Result<std::shared_ptr<ObjectLease>> Pin(const std::string& tag,
                                                   const std::string& version,
                                                   const std::string& name) = 0;

  virtual std::vector<Status> TakeErrors() = 0;
  virtual std::vector<HistoryRow> History() = 0;  // rows so far (also in the CSV)
  virtual Storage* storage() = 0;                 // nullptr without a store
  virtual uint64_t memory_capacity() const = 0;
  virtual uint64_t memory_used() const = 0;
  virtual uint64_t memory_resident() const = 0;  // the arena's high-water mark
  // Bytes of the arena that this engine's versions hold and that its reservations can have
  // back without a newer commit: every committed version's but the newest's while it is
  // held in memory only (one being persisted comes back once written, one being read once
  // its reader is done). With the arena's free bytes, what objects still to be staged can
  // take without streaming.
  virtual uint64_t memory_reclaimable() const = 0;
  virtual void WaitPrefaulted() = 0;
  // Finishes queued work and stops the background threads, returning within
  // `timeout_seconds` in any case: work still pending then is dropped (a version not
  // committed in the store stays uncommitted), and a thread stuck in the store (a hung
  // mount) is left to finish alone.
  virtual Status Close(double timeout_seconds) = 0;
};

}  // namespace nebulite

// The writer lease: which job writes a store (docs/format.md, "Writer lease").
//
// Two jobs writing one store delete each other's checkpoints (each one's retention counts
// only what it sees) and interleave their commits. A job that writes holds the store's
// lease: `.nebulite/lease`, a small record naming its run, host and process and when it
// last renewed it, rewritten atomically (0600) periodically while the job lives.
// Beside it, `.nebulite/lease.lock` is locked (flock, exclusive) by the holding process.
//
// Another run's lease is live (the store is in use) when:
//  1. its lock is held: a held lock proves a live holder on any filesystem; else
//  2. its host is another host and it was renewed less than its TTL ago: locks may be
//     node-local (Lustre localflock, FUSE), so a free lock proves nothing there.
// Object stores have no locks: there, a lease of this host whose process is gone belongs
// to a dead process, and the renewal time decides the rest.
// A lease of this host whose lock is free belongs to a dead process: a job restarted
// after a crash takes over at once (a node agent still persisting the dead trainer's last
// checkpoint never holds the lease lock, so it does not block the restart). A missing
// lease, or one that is not a regular file or does not decode, has no live holder.
// The ranks of one job share a run id and never refuse each other.
// Thread-safety: the free functions may be called concurrently; a LeaseKeeper's methods
// may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nebulite/status.h"
#include "nebulite/storage.h"

namespace nebulite {

inline constexpr char kLeasePath[] = ".nebulite/lease";
inline constexpr char kLeaseLockPath[] = ".nebulite/lease.lock";

struct Lease {
  std::string run;  // the run id of the job holding the store
  std::string host;
  uint32_t pid = 0;
  int64_t renewed_unix_ns = 0;  // the holder's wall clock when it last wrote the lease
  uint32_t ttl_seconds = 0;     // how long the lease stays live without renewal
};

// Text encoding (docs/format.md): Decode rejects anything else as Corruption.
std::string EncodeLease(const Lease& lease);
Result<Lease> DecodeLease(const std::string& text);

struct LeaseState {
  bool present = false;  // a lease that decodes is there
  bool live = false;     // ... held by a live job (see the rules above)
  Lease lease;
  std::vector<std::string> warnings;  // a damaged or odd lease file, named
};

// Reads the store's lease and decides whether its holder is live, as seen from `host` at
// wall time `now_ns`. A damaged lease is not present (with a warning); storage errors
// other than NotFound are returned. `lock_is_mine`: the caller holds the lease lock, so
// the holder named in the lease does not.
Result<LeaseState> ReadLease(Storage* storage, const std::string& host, int64_t now_ns,
                             bool lock_is_mine = false);

// The StoreInUse error naming `holder`, as seen at `now_ns`.
Status StoreInUseError(const std::string& store, const Lease& holder, int64_t now_ns);

// Holds the store's lease for one job while it writes, renewing it on a thread.
class LeaseKeeper {
 public:
  // Takes the lease for `me` (me.renewed_unix_ns is ignored): StoreInUse when another run
  // holds a live one. Renews it every `renew_seconds` until Release() or destruction.
  static Result<std::unique_ptr<LeaseKeeper>> Acquire(Storage* storage, Lease me,
                                                      double renew_seconds);
  ~LeaseKeeper();
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  // Reads the lease again and renews it: OK while this job holds the store, StoreInUse
  // once another live job took it (a lost lease is never taken back: this job stops
  // committing instead). Storage errors are returned without losing the lease.
  Status Renew();
  // OK while held; the StoreInUse error once the lease was found lost.
  Status status() const;
  // Warnings of the lease's renewals (a damaged lease file replaced), taken once.
  std::vector<std::string> TakeWarnings();
  // Stops renewing and removes the lease if it still names this job.
  void Release();

 private:
  struct State;
  explicit LeaseKeeper(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace nebulite

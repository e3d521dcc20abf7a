// Runs: the training jobs writing to a store, and clean-up of what dead ones left.
//
// A run has an id ([0-9a-zA-Z]{1,64}); its versions are named v<run>-<counter>. A run is
// alive while some process holds a lock on .nebulite/runs/<run>.lock (its trainers, and
// node agents still working for it). A version directory without a commit marker is in
// progress, or was left by a run that died. It is removed only when both hold:
//  1. its run's lock is free; and
//  2. nothing in it changed for `grace_seconds`: a free lock proves nothing on a store
//     whose locks are node-local (Lustre localflock, FUSE mounts), where a live run on
//     another node looks dead; a run that writes keeps its files fresh, and one that
//     waits for its other ranks waits at most its commit timeout, which the grace
//     exceeds.
// Object stores have no locks: there, rule 2 alone decides (an object appears when its
// upload completes, so a version whose one file uploads for longer than the grace looks
// dead: the default grace, an hour, covers terabytes), HoldRun holds nothing and
// RunIsAlive is FailedPrecondition.
// Thread-safety: free functions.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nebulite/status.h"
#include "nebulite/storage.h"

namespace nebulite {

Status ValidateRunId(const std::string& run);
std::string RunLockPath(const std::string& run);
std::string VersionName(const std::string& run, uint64_t counter);
// Splits "v<run>-<counter>"; false for any other name.
bool ParseVersionName(const std::string& version, std::string* run, uint64_t* counter);

// Marks `run` alive while the returned lock lives (a shared lock: every process of the
// run holds one). nullptr when the lock is taken exclusively (a clean-up is deciding
// about the run at this instant: try again).
Result<std::unique_ptr<StoreLock>> HoldRun(Storage* storage, const std::string& run);

// True while some process holds `run`'s lock (false when nobody does; on stores whose
// locks are node-local, only this node's holders count).
Result<bool> RunIsAlive(Storage* storage, const std::string& run);

// The highest counter of `run`'s versions in the store (0 if none): of every version, or
// with `committed_only` of the committed ones.
Result<uint64_t> HighestVersionCounter(Storage* storage, const std::string& run,
                                       bool committed_only = false);

struct CleanupResult {
  std::vector<std::string> removed;   // version directories removed
  std::vector<std::string> warnings;  // what could not be looked at or removed
};
// Removes the uncommitted versions of dead runs (see above), never `live_run`'s (""
// for none). `now_ns` is the wall clock, compared with the store's mtimes. With `dry_run`,
// `removed` lists what would be removed, and nothing is.
Result<CleanupResult> RemoveDeadRunsVersions(Storage* storage, const std::string& live_run,
                                             double grace_seconds, int64_t now_ns,
                                             bool dry_run = false);

// Removes rank `rank`'s files of an uncommitted version this rank will never commit (its
// trainer abandoned it), then the version's and the tag's directories if they are empty.
// A version whose marker exists is left alone.
Status RemoveAbandonedRankFiles(Storage* storage, const std::string& tag,
                                const std::string& version, uint32_t rank);

}  // namespace nebulite

// Runs and dead-run clean-up; see nebulite/runs.h for the rules.
#include "nebulite/runs.h"

#include <algorithm>
#include <cstdio>

#include "nebulite/commit.h"

namespace nebulite {
namespace {

constexpr char kRunsDir[] = ".nebulite/runs";

// The newest mtime of `path` and everything below it.
Result<int64_t> NewestChange(Storage* storage, const std::string& path, int depth = 0) {
  NEBULITE_ASSIGN_OR_RETURN(FileInfo info, storage->Stat(path));
  int64_t newest = info.mtime_ns;
  if (info.type != FileType::kDirectory || depth > 4) return newest;
  NEBULITE_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->List(path));
  for (const std::string& n : names) {
    Result<int64_t> t = NewestChange(storage, JoinPath(path, n), depth + 1);
    if (!t.ok()) {
      if (t.status().code() == StatusCode::kNotFound) continue;  // removed meanwhile
      return t.status();
    }
    newest = std::max(newest, *t);
  }
  return newest;
}

}  // namespace

Status ValidateRunId(const std::string& run) {
  if (run.empty() || run.size() > 64) {
    return Status::InvalidArgument("run id '" + run + "' must have 1 to 64 characters");
  }
  for (char c : run) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))) {
      return Status::InvalidArgument("run id '" + run + "' may only hold letters and digits");
    }
  }
  return Status::OK();
}

std::string RunLockPath(const std::string& run) {
  return std::string(kRunsDir) + "/" + run + ".lock";
}

std::string VersionName(const std::string& run, uint64_t counter) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%06llu", static_cast<unsigned long long>(counter));
  return "v" + run + "-" + buf;
}

bool ParseVersionName(const std::string& version, std::string* run, uint64_t* counter) {
  if (version.size() < 4 || version[0] != 'v') return false;
  const size_t dash = version.rfind('-');
  if (dash == std::string::npos || dash < 2) return false;
  const std::string r = version.substr(1, dash - 1);
  const std::string digits = version.substr(dash + 1);
  if (!ValidateRunId(r).ok() || digits.size() < 6 || digits.size() > 19) return false;
  uint64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  *run = r;
  *counter = v;
  return true;
}

// What HoldRun returns on a store without locks.
class NoLock final : public StoreLock {};

Result<std::unique_ptr<StoreLock>> HoldRun(Storage* storage, const std::string& run) {
  NEBULITE_RETURN_IF_ERROR(ValidateRunId(run));
  if (storage->is_object_store()) return std::unique_ptr<StoreLock>(new NoLock);
  return storage->TryLock(RunLockPath(run), /*exclusive=*/false);
}

Result<bool> RunIsAlive(Storage* storage, const std::string& run) {
  NEBULITE_RETURN_IF_ERROR(ValidateRunId(run));
  if (storage->is_object_store()) {
    return Status::FailedPrecondition(storage->Describe() +
                                      " is an object store: it cannot tell which runs are alive");
  }
  NEBULITE_ASSIGN_OR_RETURN(bool exists, storage->FileExists(RunLockPath(run)));
  if (!exists) return false;
  NEBULITE_ASSIGN_OR_RETURN(std::unique_ptr<StoreLock> lock,
                            storage->TryLock(RunLockPath(run), /*exclusive=*/true));
  return lock == nullptr;
}

Result<uint64_t> HighestVersionCounter(Storage* storage, const std::string& run,
                                       bool committed_only) {
  uint64_t highest = 0;
  NEBULITE_ASSIGN_OR_RETURN(std::vector<std::string> tags, storage->List(""));
  for (const std::string& tag : tags) {
    if (!ValidateTag(tag).ok()) continue;
    Result<std::vector<std::string>> versions = storage->List(tag);
    if (!versions.ok()) continue;  // unreadable: none of ours can be there
    for (const std::string& v : *versions) {
      std::string r;
      uint64_t counter;
      if (!ParseVersionName(v, &r, &counter) || r != run || counter <= highest) continue;
      if (committed_only) {
        Result<bool> committed = storage->FileExists(CommitMarkerPath(tag, v));
        if (!committed.ok() || !*committed) continue;
      }
      highest = counter;
    }
  }
  return highest;
}

Result<CleanupResult> RemoveDeadRunsVersions(Storage* storage, const std::string& live_run,
                                             double grace_seconds, int64_t now_ns, bool dry_run) {
  CleanupResult out;
  const int64_t grace_ns = static_cast<int64_t>(std::max(0.0, grace_seconds) * 1e9);
  NEBULITE_ASSIGN_OR_RETURN(std::vector<std::string> tags, storage->List(""));
  for (const std::string& tag : tags) {
    if (!ValidateTag(tag).ok()) continue;
    Result<std::vector<std::string>> versions = storage->List(tag);
    if (!versions.ok()) {
      out.warnings.push_back("cannot list '" + tag + "': " + versions.status().ToString());
      continue;
    }
    for (const std::string& version : *versions) {
      std::string run;
      uint64_t counter;
      if (!ParseVersionName(version, &run, &counter) || run == live_run) continue;
      const std::string dir = VersionDir(tag, version);
      Result<bool> committed = storage->FileExists(CommitMarkerPath(tag, version));
      if (!committed.ok() || *committed) continue;
      // 1. Its run's lock must be free: hold it exclusively while deciding, so that a
      //    process of that run starting now waits for the decision (HoldRun fails).
      //    Object stores have none: the grace alone decides.
      Result<std::unique_ptr<StoreLock>> lock = std::unique_ptr<StoreLock>(new NoLock);
      if (!storage->is_object_store()) lock = storage->TryLock(RunLockPath(run), true);
      if (!lock.ok()) {
        out.warnings.push_back("cannot tell whether run " + run +
                               " is alive: " + lock.status().ToString());
        continue;
      }
      if (*lock == nullptr) continue;  // alive
      // 2. ... and nothing in it may have changed for the grace period.
      Result<int64_t> newest = NewestChange(storage, dir);
      if (!newest.ok()) {
        if (newest.status().code() != StatusCode::kNotFound) {
          out.warnings.push_back("cannot look at '" + dir + "': " + newest.status().ToString());
        }
        continue;
      }
      if (now_ns - *newest < grace_ns) continue;
      if (dry_run) {
        out.removed.push_back(dir);
        continue;
      }
      Status st = storage->DeleteRecursively(dir);
      if (!st.ok()) {
        out.warnings.push_back("cannot remove '" + dir + "': " + st.ToString());
        continue;
      }
      out.removed.push_back(dir);
    }
    if (!dry_run) (void)storage->RemoveDirIfEmpty(tag);
  }
  return out;
}

Status RemoveAbandonedRankFiles(Storage* storage, const std::string& tag,
                                const std::string& version, uint32_t rank) {
  NEBULITE_ASSIGN_OR_RETURN(bool committed, storage->FileExists(CommitMarkerPath(tag, version)));
  if (committed) return Status::OK();
  NEBULITE_RETURN_IF_ERROR(storage->Delete(ManifestPath(tag, version, rank)));
  NEBULITE_RETURN_IF_ERROR(storage->DeleteRecursively(RankDir(tag, version, rank)));
  NEBULITE_ASSIGN_OR_RETURN(bool removed, storage->RemoveDirIfEmpty(VersionDir(tag, version)));
  if (removed) (void)storage->RemoveDirIfEmpty(tag);
  return Status::OK();
}

}  // namespace nebulite

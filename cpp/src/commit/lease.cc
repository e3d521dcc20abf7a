// The writer lease; see nebulite/lease.h for the rules.
#include "nebulite/lease.h"

#include <signal.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <thread>

#include "nebulite/runs.h"
#include "persist/background_thread.h"

namespace nebulite {
namespace {

constexpr uint64_t kMaxLeaseBytes = 4096;

int64_t WallNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string UtcTime(int64_t unix_ns) {
  std::time_t t = static_cast<std::time_t>(unix_ns / 1000000000);
  std::tm tm{};
  char buf[32] = "?";
  if (gmtime_r(&t, &tm) != nullptr) std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// Whether the lease lock is held by some process (nullopt-like -1 when it cannot be told).
int LockHeld(Storage* storage) {
  Result<std::unique_ptr<StoreLock>> lock = storage->TryLock(kLeaseLockPath, /*exclusive=*/true);
  if (!lock.ok()) return -1;
  return *lock == nullptr ? 1 : 0;
}

}  // namespace

Result<LeaseState> ReadLease(Storage* storage, const std::string& host, int64_t now_ns,
                             bool lock_is_mine) {
  LeaseState out;
  const std::string path = kLeasePath;
  Result<FileInfo> info = storage->StatFile(path);
  if (!info.ok()) {
    if (info.status().code() == StatusCode::kNotFound) return out;
    out.warnings.push_back("ignoring the writer lease " + path + ": " + info.status().ToString());
    return out;
  }
  if (info->type != FileType::kFile) {  // never opened: a FIFO could block
    out.warnings.push_back("ignoring the writer lease " + path + ": it is not a regular file");
    return out;
  }
  Result<std::string> text = storage->ReadFile(path, kMaxLeaseBytes);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) return out;  // released meanwhile
    out.warnings.push_back("ignoring the writer lease " + path + ": " + text.status().ToString());
    return out;
  }
  Result<Lease> lease = DecodeLease(*text);
  if (lease.ok() && !ValidateRunId(lease->run).ok()) {
    lease = Status::Corruption("lease: bad run id '" + lease->run + "'");
  }
  if (!lease.ok()) {
    out.warnings.push_back("ignoring the writer lease " + path + ": " + lease.status().ToString());
    return out;
  }
  out.present = true;
  out.lease = std::move(lease).value();
  // 1. A held lock proves a live holder, on any filesystem.
  const int held = lock_is_mine ? 0 : LockHeld(storage);
  if (held == 1) {
    out.live = true;
    return out;
  }
  // 2. A free lock proves a dead holder only on the holder's own host; elsewhere the
  //    renewal time decides. Object stores have no locks: on the holder's host, its
  //    process being gone proves it dead.
  if (out.lease.host == host && held == 0) return out;
  if (out.lease.host == host && storage->is_object_store() && out.lease.pid > 0 &&
      ::kill(static_cast<pid_t>(out.lease.pid), 0) != 0 && errno == ESRCH) {
    return out;
  }
  const int64_t ttl_ns = static_cast<int64_t>(out.lease.ttl_seconds) * 1000000000;
  out.live = now_ns - out.lease.renewed_unix_ns < ttl_ns;
  return out;
}

Status StoreInUseError(const std::string& store, const Lease& holder, int64_t now_ns) {
  char ago[64];
  std::snprintf(ago, sizeof(ago), "%.0f s ago",
                static_cast<double>(now_ns - holder.renewed_unix_ns) / 1e9);
  return Status::StoreInUse(
      "the store " + store + " is in use by another job: run " + holder.run + " on host " +
      holder.host + " (pid " + std::to_string(holder.pid) + "), which last renewed its writer " +
      "lease at " + UtcTime(holder.renewed_unix_ns) + " (" + ago + "; it expires " +
      std::to_string(holder.ttl_seconds) + " s after its last renewal unless that job is seen " +
      "alive). Two jobs writing one store delete each other's checkpoints: use another " +
      "persistent_storage_path, stop the other job, or, if both jobs must write here, opt into " +
      "sharing with init(shared_store=True) or NEBULITE_SHARED_STORE=1 in every job");
}

// Two locks: `io_mu` serialises renewals (store I/O, which may hang on a sick store) and
// guards `lock`; `mu` guards the rest, so that status() and Release() never wait for I/O.
struct LeaseKeeper::State {
  Storage* storage = nullptr;
  Lease me;
  double renew_seconds = 0;
  std::mutex io_mu;
  std::unique_ptr<StoreLock> lock;  // GUARDED_BY(io_mu)
  mutable std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;              // GUARDED_BY(mu)
  Status lost;                        // GUARDED_BY(mu); OK while held
  std::vector<std::string> warnings;  // GUARDED_BY(mu)
  BackgroundThread thread;

  void Warn(std::string w) {
    std::lock_guard<std::mutex> l(mu);
    warnings.push_back(std::move(w));
  }
  Status Lost() const {
    std::lock_guard<std::mutex> l(mu);
    return lost;
  }

  // One renewal; call with io_mu held.
  Status RenewIo() {
    NEBULITE_RETURN_IF_ERROR(Lost());
    const int64_t now = WallNowNs();
    NEBULITE_ASSIGN_OR_RETURN(LeaseState state,
                              ReadLease(storage, me.host, now, /*lock_is_mine=*/lock != nullptr));
    for (std::string& w : state.warnings) Warn(std::move(w));
    if (state.present && state.lease.run != me.run && state.live) {
      std::lock_guard<std::mutex> l(mu);
      lost = StoreInUseError(storage->Describe(), state.lease, now);
      return lost;
    }
    if (lock == nullptr && !storage->is_object_store()) {
      Result<std::unique_ptr<StoreLock>> l = storage->TryLock(kLeaseLockPath, true);
      if (l.ok()) lock = std::move(l).value();
    }
    Lease mine = me;
    mine.renewed_unix_ns = now;
    return storage->WritePrivateFileAtomic(kLeasePath, EncodeLease(mine));
  }

  // Removes the lease if it still names this job; call with io_mu held.
  void RemoveIfMine() {
    Result<FileInfo> info = storage->StatFile(kLeasePath);
    if (!info.ok() || info->type != FileType::kFile) return;
    Result<std::string> text = storage->ReadFile(kLeasePath, kMaxLeaseBytes);
    if (!text.ok()) return;
    Result<Lease> lease = DecodeLease(*text);
    if (lease.ok() && lease->run == me.run && lease->pid == me.pid && lease->host == me.host) {
      (void)storage->Delete(kLeasePath);
    }
  }
};

LeaseKeeper::LeaseKeeper(std::shared_ptr<State> state) : state_(std::move(state)) {}

Result<std::unique_ptr<LeaseKeeper>> LeaseKeeper::Acquire(Storage* storage, Lease me,
                                                          double renew_seconds) {
  NEBULITE_RETURN_IF_ERROR(ValidateRunId(me.run));
  auto state = std::make_shared<State>();
  state->storage = storage;
  state->me = me;
  state->renew_seconds = renew_seconds;
  const int64_t now = WallNowNs();
  NEBULITE_ASSIGN_OR_RETURN(LeaseState current, ReadLease(storage, me.host, now));
  if (current.present && current.lease.run != me.run && current.live) {
    return StoreInUseError(storage->Describe(), current.lease, now);
  }
  {
    std::lock_guard<std::mutex> io(state->io_mu);
    // The lock proves this job alive to the processes of this host (and, where locks are
    // shared, of every host). Another process checking the lease holds it for an instant.
    const bool ours = current.present && current.lease.run == me.run;
    for (int attempt = 0; attempt < 200 && state->lock == nullptr && !storage->is_object_store();
         ++attempt) {
      Result<std::unique_ptr<StoreLock>> lock = storage->TryLock(kLeaseLockPath, true);
      if (!lock.ok()) {
        state->Warn("cannot lock " + std::string(kLeaseLockPath) + ": " + lock.status().ToString());
        break;
      }
      state->lock = std::move(lock).value();
      if (state->lock == nullptr && ours) break;  // another process of this job holds it
      if (state->lock == nullptr) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    Status written = state->RenewIo();
    if (written.code() == StatusCode::kStoreInUse) return written;
    if (!written.ok()) {  // e.g. a directory in the lease's place: write, warned, without
      state->Warn("cannot write the writer lease " + std::string(kLeasePath) +
                  " (this job writes without one): " + written.ToString());
    }
    // Two jobs that both found the store free: the last writer holds it, and the other
    // learns it here (or, in a closer race, at its next renewal).
    Result<LeaseState> after =
        ReadLease(storage, me.host, WallNowNs(), /*lock_is_mine=*/state->lock != nullptr);
    if (after.ok() && after->present && after->lease.run != me.run) {
      return StoreInUseError(storage->Describe(), after->lease, WallNowNs());
    }
  }
  State* s = state.get();
  state->thread.Start(state, [s] {
    const auto period = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(s->renew_seconds));
    while (true) {
      {
        std::unique_lock<std::mutex> l(s->mu);
        if (s->cv.wait_for(l, period, [s] { return s->stopping; })) return;
      }
      std::lock_guard<std::mutex> io(s->io_mu);
      Status st = s->RenewIo();
      if (!st.ok() && st.code() != StatusCode::kStoreInUse) {
        s->Warn("cannot renew the writer lease: " + st.ToString());
      }
    }
  });
  return std::unique_ptr<LeaseKeeper>(new LeaseKeeper(std::move(state)));
}

LeaseKeeper::~LeaseKeeper() { Release(); }

Status LeaseKeeper::Renew() {
  {
    std::lock_guard<std::mutex> l(state_->mu);
    if (state_->stopping) return Status::FailedPrecondition("the writer lease was released");
  }
  std::lock_guard<std::mutex> io(state_->io_mu);
  return state_->RenewIo();
}

Status LeaseKeeper::status() const { return state_->Lost(); }

std::vector<std::string> LeaseKeeper::TakeWarnings() {
  std::lock_guard<std::mutex> l(state_->mu);
  std::vector<std::string> out;
  out.swap(state_->warnings);
  return out;
}

void LeaseKeeper::Release() {
  {
    std::lock_guard<std::mutex> l(state_->mu);
    if (state_->stopping) return;
    state_->stopping = true;
  }
  state_->cv.notify_all();
  // A renewal stuck on a hung store is left to finish alone (it holds the state alive).
  if (!state_->thread.JoinUntil(DeadlineAfter(10))) return;
  std::unique_lock<std::mutex> io(state_->io_mu, std::try_to_lock);
  if (!io.owns_lock()) return;
  if (state_->Lost().ok()) state_->RemoveIfMine();
  state_->lock.reset();
}

}  // namespace nebulite

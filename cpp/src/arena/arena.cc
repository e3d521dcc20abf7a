#include "nebulite/arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace nebulite {
namespace {
constexpr uint64_t kMapGranule = 2ull << 20;
constexpr uint64_t kPrefaultStep = 64ull << 20;
uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
}  // namespace

Result<std::unique_ptr<Arena>> Arena::Create(uint64_t capacity, bool prefault, bool shared) {
  if (capacity == 0) return Status::InvalidArgument("arena capacity must be positive");
  if (capacity > (1ull << 46))
    return Status::InvalidArgument("arena capacity is implausibly large");
  capacity = RoundUp(capacity, kMapGranule);
  int fd = -1;
  void* p = MAP_FAILED;
  if (shared) {
    fd = memfd_create("nebulite-arena", MFD_CLOEXEC);
    if (fd < 0) return Status::FromErrno(errno, "memfd_create");
    if (ftruncate(fd, static_cast<off_t>(capacity)) != 0) {
      int err = errno;
      close(fd);
      return Status::FromErrno(err, "sizing the arena");
    }
    p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  } else {
    p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
             -1, 0);
  }
  if (p == MAP_FAILED) {
    int err = errno;
    if (fd >= 0) close(fd);
    return Status::FromErrno(err, "mapping the arena of " + std::to_string(capacity) + " bytes");
  }
  madvise(p, capacity, MADV_HUGEPAGE);  // best effort
  std::unique_ptr<Arena> arena(new Arena(static_cast<uint8_t*>(p), capacity, fd));
  if (prefault) {
    Arena* a = arena.get();
    a->prefault_thread_ = std::thread([a] {
      for (uint64_t off = 0; off < a->capacity_; off += kPrefaultStep) {
        {
          std::lock_guard<std::mutex> lock(a->mu_);
          if (a->stop_prefault_) return;
        }
        uint64_t n = std::min(kPrefaultStep, a->capacity_ - off);
        {
          std::lock_guard<std::mutex> lock(a->mu_);
          a->high_water_ = std::max(a->high_water_, off + n);
        }
#ifdef MADV_POPULATE_WRITE
        if (madvise(a->base_ + off, n, MADV_POPULATE_WRITE) == 0) continue;
#endif
        // Fallback: touch one byte per page. The arena is zero-filled on creation and
        // pages handed out are overwritten by their owner, so writing 0 is harmless
        // only for pages nobody owns yet; a volatile read-modify-write of the same
        // value is safe for every page.
        for (uint64_t i = 0; i < n; i += 4096) {
          volatile uint8_t* b = a->base_ + off + i;
          __atomic_fetch_add(const_cast<uint8_t*>(b), 0, __ATOMIC_RELAXED);
        }
      }
    });
  }
  return arena;
}

Arena::Arena(uint8_t* base, uint64_t capacity, int fd) : base_(base), capacity_(capacity), fd_(fd) {
  free_[0] = capacity;
}

Arena::~Arena() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_prefault_ = true;
  }
  WaitPrefaulted();
  munmap(base_, capacity_);
  if (fd_ >= 0) close(fd_);
}

uint64_t Arena::AddRoomMaker(std::function<bool()> make_room) {
  std::lock_guard<std::mutex> lock(makers_mu_);
  makers_[next_maker_] = std::move(make_room);
  return next_maker_++;
}

void Arena::RemoveRoomMaker(uint64_t id) {
  std::lock_guard<std::mutex> lock(makers_mu_);
  makers_.erase(id);
}

bool Arena::MakeRoom(uint64_t except) {
  // makers_mu_ is held across each call (a maker takes its engine's lock, then this
  // arena's mu_; no engine holds its lock while it calls MakeRoom).
  std::lock_guard<std::mutex> lock(makers_mu_);
  for (auto& [id, make_room] : makers_)
    if (id != except && make_room()) return true;
  return false;
}

void Arena::WaitPrefaulted() {
  std::lock_guard<std::mutex> lock(join_mu_);  // several threads may wait at once
  if (prefault_thread_.joinable()) prefault_thread_.join();
}

bool Arena::TryReserveLocked(uint64_t size, uint64_t limit, ArenaBlock* out) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    if (it->first + size > limit) return false;  // first fit: later ranges lie higher
    out->offset = it->first;
    out->size = size;
    uint64_t rest = it->second - size;
    uint64_t next = it->first + size;
    free_.erase(it);
    if (rest > 0) free_[next] = rest;
    used_ += size;
    high_water_ = std::max(high_water_, next);
    return true;
  }
  return false;
}

Result<ArenaBlock> Arena::TryReserve(uint64_t size, bool grow) {
  size = RoundUp(std::max<uint64_t>(size, 1), kAlignment);
  if (size > capacity_) {
    return Status::ResourceExhausted("request of " + std::to_string(size) +
                                     " bytes exceeds the memory budget of " +
                                     std::to_string(capacity_) + " bytes");
  }
  std::lock_guard<std::mutex> lock(mu_);
  ArenaBlock b;
  if (TryReserveLocked(size, grow ? capacity_ : high_water_, &b)) return b;
  return Status::ResourceExhausted(grow ? "the memory budget is full"
                                        : "no room below the resident high-water mark");
}

Result<ArenaBlock> Arena::Reserve(uint64_t size, std::chrono::milliseconds timeout,
                                  const std::function<bool()>& make_room) {
  size = RoundUp(std::max<uint64_t>(size, 1), kAlignment);
  if (size > capacity_) {
    return Status::ResourceExhausted("request of " + std::to_string(size) +
                                     " bytes exceeds the memory budget of " +
                                     std::to_string(capacity_) + " bytes");
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mu_);
  ArenaBlock b;
  while (true) {
    if (TryReserveLocked(size, capacity_, &b)) return b;
    if (make_room) {
      lock.unlock();
      make_room();
      lock.lock();
      if (TryReserveLocked(size, capacity_, &b)) return b;
    }
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) break;
    // Wait for a Release(); wake periodically to retry make_room.
    released_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(20)));
  }
  return Status::ResourceExhausted("timed out waiting for " + std::to_string(size) +
                                   " bytes of the memory budget (" + std::to_string(used_) +
                                   " of " + std::to_string(capacity_) + " in use)");
}

void Arena::Release(const ArenaBlock& block) {
  if (block.size == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t off = block.offset, size = block.size;
  auto next = free_.lower_bound(off);
  if (next != free_.end() && off + size == next->first) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      off = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  free_[off] = size;
  used_ -= block.size;
  released_.notify_all();
}

uint64_t Arena::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

uint64_t Arena::resident() const {
  std::lock_guard<std::mutex> lock(mu_);
  return high_water_;
}

uint64_t Arena::largest_free() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t m = 0;
  for (auto& [o, s] : free_) m = std::max(m, s);
  return m;
}

}  // namespace nebulite

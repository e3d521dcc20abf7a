// Arena: the tier-1 memory budget. One mapping allocated once, pre-faulted in the
// background, and reused for every save: no allocation per save. A shared arena is
// a memfd that another process can map; a private one is anonymous memory backed by
// transparent huge pages where the kernel allows, which faults several times faster.
//
// Memory is taken as it is needed: pages are touched when first written (or by the
// optional background pre-fault) and stay resident afterwards, so the arena's resident
// size is its high-water mark. TryReserve(size, /*grow=*/false) only hands out ranges
// below that mark, which lets a caller free old blocks before touching new memory.
//
// Allocations are 4 KiB-aligned ranges handed out first-fit. Reserve() waits for
// space (back-pressure) until the deadline; a request larger than the whole
// capacity fails at once with ResourceExhausted, so that callers can stream instead.
// Thread-safety: all methods are thread-safe. Release() wakes waiting Reserve() calls.
//
// The engines of one node share one arena, and each evicts only its own versions. So that
// one engine's reservation is not refused (or left waiting) while another engine holds
// memory it could give back, each engine registers a room maker, which frees memory of
// its own that may go (a version already persisted); MakeRoom() asks the others in turn.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "nebulite/status.h"

namespace nebulite {

struct ArenaBlock {
  uint64_t offset = 0;
  uint64_t size = 0;  // rounded up to the alignment
};

class Arena {
 public:
  static constexpr uint64_t kAlignment = 4096;

  // Maps `capacity` bytes (rounded up to 2 MiB). With `prefault`, a background
  // thread touches every page once so that later copies never fault.
  static Result<std::unique_ptr<Arena>> Create(uint64_t capacity, bool prefault,
                                               bool shared = false);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  uint8_t* base() const { return base_; }
  uint64_t capacity() const { return capacity_; }
  int fd() const { return fd_; }  // -1 for a private arena

  // Reserves `size` bytes. If they do not fit now, calls `make_room` (which may
  // release blocks; it returns false when nothing more can be freed soon) and then
  // waits until space is released or `timeout` passes (ResourceExhausted).
  Result<ArenaBlock> Reserve(uint64_t size, std::chrono::milliseconds timeout,
                             const std::function<bool()>& make_room = nullptr);
  // Non-blocking: ResourceExhausted if it does not fit now. Without `grow`, only space
  // below the resident high-water mark counts.
  Result<ArenaBlock> TryReserve(uint64_t size, bool grow = true);
  void Release(const ArenaBlock& block);

  uint64_t used() const;
  // Bytes from the start of the mapping that have been handed out (or pre-faulted) at
  // least once: an upper bound of the arena's resident memory.
  uint64_t resident() const;
  uint64_t largest_free() const;
  // Waits until the background pre-fault has finished (tests, benchmarks). Thread-safe.
  void WaitPrefaulted();

  // A room maker frees some memory of its owner that may go and returns true, or returns
  // false when it has none. It is called with the makers' own lock held (not the lock of
  // the arena's memory): it may call Release(), but no room maker method. AddRoomMaker
  // returns its id; after RemoveRoomMaker(id) returns, it is not called again.
  uint64_t AddRoomMaker(std::function<bool()> make_room);
  void RemoveRoomMaker(uint64_t id);
  // Asks each room maker but `except` (an id), one after another, until one frees
  // memory: true if one did.
  bool MakeRoom(uint64_t except);

 private:
  Arena(uint8_t* base, uint64_t capacity, int fd);
  bool TryReserveLocked(uint64_t size, uint64_t limit, ArenaBlock* out);

  uint8_t* base_;
  uint64_t capacity_;
  int fd_;
  mutable std::mutex mu_;
  std::condition_variable released_;
  std::map<uint64_t, uint64_t> free_;  // offset -> size, coalesced; GUARDED_BY(mu_)
  uint64_t used_ = 0;                  // GUARDED_BY(mu_)
  uint64_t high_water_ = 0;            // GUARDED_BY(mu_)
  std::mutex join_mu_;                 // serialises joining prefault_thread_
  // Room makers by id; held while one is called, so that removing it waits for the call.
  std::mutex makers_mu_;
  std::map<uint64_t, std::function<bool()>> makers_;  // GUARDED_BY(makers_mu_)
  uint64_t next_maker_ = 1;                           // GUARDED_BY(makers_mu_)
  std::thread prefault_thread_;
  bool stop_prefault_ = false;
};

}  // namespace nebulite

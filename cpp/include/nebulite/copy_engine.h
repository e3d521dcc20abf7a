// CopyEngine: copies many buffers at once with every core. Owns a fixed pool of
// worker threads; Copy() splits the spans into pieces of similar size, runs them on
// the pool and on the calling thread, and returns when all bytes are copied.
// Thread-safety: Copy() may be called from several threads; calls are serialised.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace nebulite {

struct CopySpan {
  void* dst;
  const void* src;
  size_t size;
};

// memcpy with non-temporal stores for large sizes (plain memcpy below 256 KiB and on
// CPUs without them); the bytes are visible to other threads when it returns.
void StreamCopy(void* dst, const void* src, size_t n);
// Copies n bytes as StreamCopy does and returns their CRC-32, extending `crc`.
uint32_t StreamCopyWithCrc(void* dst, const void* src, size_t n, uint32_t crc);

class CopyEngine {
 public:
  // threads <= 0: the number of online CPUs.
  explicit CopyEngine(int threads);
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // bypass_caches: large pieces are copied with StreamCopy (the destination is not read
  // again soon); false when the caller reads the destination right after.
  void Copy(const std::vector<CopySpan>& spans, bool bypass_caches = true);
  // Copies as Copy() does and computes each span's CRC-32 in the same pass: every block
  // is checksummed while it is in the cache, then copied (crcs[i] is span i's).
  void CopyWithCrc(const std::vector<CopySpan>& spans, std::vector<uint32_t>* crcs);
  // Runs fn(i) for i in [0, n) on the pool and the calling thread.
  void ParallelFor(size_t n, const std::function<void(size_t)>& fn);

 private:
  void WorkerLoop();

  std::mutex call_mu_;  // serialises Copy/ParallelFor
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  const std::function<void(size_t)>* job_ = nullptr;  // GUARDED_BY(mu_)
  size_t job_size_ = 0, next_ = 0, done_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace nebulite

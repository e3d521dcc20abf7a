#include "nebulite/copy_engine.h"

#include <algorithm>
#include <cstring>

namespace nebulite {
namespace {
constexpr size_t kPiece = 4ull << 20;   // bytes per unit of work
constexpr size_t kInline = 1ull << 20;  // below this, copy on the calling thread
}  // namespace

CopyEngine::CopyEngine(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void CopyEngine::WorkerLoop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return stop_ || (job_ != nullptr && generation_ != seen); });
    if (stop_) return;
    seen = generation_;
    const auto* job = job_;
    while (next_ < job_size_) {
      size_t i = next_++;
      lock.unlock();
      (*job)(i);
      lock.lock();
      if (++done_ == job_size_) done_cv_.notify_all();
    }
  }
}

void CopyEngine::ParallelFor(size_t n, const std::function<void(size_t)>& fn) {
  if (n == 0) return;
  if (n == 1 || workers_.empty()) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> call(call_mu_);
  std::unique_lock<std::mutex> lock(mu_);
  job_ = &fn;
  job_size_ = n;
  next_ = 0;
  done_ = 0;
  ++generation_;
  work_cv_.notify_all();
  while (next_ < job_size_) {
    size_t i = next_++;
    lock.unlock();
    fn(i);
    lock.lock();
    ++done_;
  }
  done_cv_.wait(lock, [&] { return done_ == job_size_; });
  job_ = nullptr;
}

void CopyEngine::Copy(const std::vector<CopySpan>& spans) {
  size_t total = 0;
  for (const auto& s : spans) total += s.size;
  if (total <= kInline || workers_.empty()) {
    for (const auto& s : spans)
      if (s.size) std::memcpy(s.dst, s.src, s.size);
    return;
  }
  // Cut into pieces of about kPiece bytes (at least one piece per thread), so that
  // a state of many small tensors and one of a few huge ones both balance.
  size_t piece = std::max<size_t>(64 << 10, std::min(kPiece, total / (threads() * 4) + 1));
  piece = (piece + 4095) & ~size_t{4095};
  std::vector<CopySpan> pieces;
  pieces.reserve(total / piece + spans.size() + 1);
  for (const auto& s : spans) {
    for (size_t off = 0; off < s.size; off += piece) {
      size_t n = std::min(piece, s.size - off);
      pieces.push_back(
          {static_cast<uint8_t*>(s.dst) + off, static_cast<const uint8_t*>(s.src) + off, n});
    }
  }
  ParallelFor(pieces.size(),
              [&](size_t i) { std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].size); });
}

}  // namespace nebulite

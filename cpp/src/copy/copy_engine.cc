#include "nebulite/copy_engine.h"

#include <algorithm>
#include <cstring>

#include "nebulite/crc32.h"

#if defined(__x86_64__)  // SSE2 is part of the x86-64 baseline
#include <emmintrin.h>
#define NEBULITE_STREAM_STORES 1
#endif

namespace nebulite {
namespace {
constexpr size_t kPiece = 4ull << 20;      // bytes per unit of work
constexpr size_t kInline = 1ull << 20;     // below this, copy on the calling thread
constexpr size_t kStream = 256ull << 10;   // from this size on, bypass the caches
constexpr size_t kCrcBlock = 64ull << 10;  // checksummed, then copied, while in L1/L2

// The streaming loop of StreamCopy, for any size (dst need not be aligned).
void StreamStores(uint8_t* d, const uint8_t* s, size_t n) {
#ifdef NEBULITE_STREAM_STORES
  size_t head = std::min(n, (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t body = n & ~size_t{63};
  for (size_t off = 0; off < body; off += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + off));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + off + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + off + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + off + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + off), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + off + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + off + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + off + 48), e);
  }
  std::memcpy(d + body, s + body, n - body);
#else
  std::memcpy(d, s, n);
#endif
}

}  // namespace

// The C library's memcpy switches to non-temporal stores only for copies larger than a
// fraction of the last-level cache (hundreds of MiB on large parts), and the pieces of
// a staging copy are far smaller; a checkpoint's destination is not read again by this
// core soon, so caching it only evicts the training's working set and costs a
// read-for-ownership of every destination line. Streaming stores write it straight to
// memory: on a 2-vCPU EPYC, 15 GB/s with memcpy per 4 MiB piece, against the 20 GB/s
// that memcpy of one large block per thread reaches (profile_save.py, step 2).
void StreamCopy(void* dst, const void* src, size_t n) {
  if (n < kStream) {
    std::memcpy(dst, src, n);
    return;
  }
  StreamStores(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
#ifdef NEBULITE_STREAM_STORES
  _mm_sfence();  // streaming stores are weakly ordered: make them visible before returning
#endif
}

uint32_t StreamCopyWithCrc(void* dst, const void* src, size_t n, uint32_t crc) {
  if (n >= kStream && Crc32CopyWide(dst, src, n, &crc)) return crc;
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  const bool stream = n >= kStream;
  for (size_t off = 0; off < n; off += kCrcBlock) {
    const size_t b = std::min(kCrcBlock, n - off);
    crc = Crc32(crc, s + off, b);  // brings the block into the cache...
    if (stream) {
      StreamStores(d + off, s + off, b);  // ...from where it is copied
    } else {
      std::memcpy(d + off, s + off, b);
    }
  }
#ifdef NEBULITE_STREAM_STORES
  if (stream) _mm_sfence();
#endif
  return crc;
}

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

void CopyEngine::CopyWithCrc(const std::vector<CopySpan>& spans, std::vector<uint32_t>* crcs) {
  crcs->assign(spans.size(), 0);
  size_t total = 0;
  for (const auto& s : spans) total += s.size;
  if (total <= kInline || workers_.empty()) {
    for (size_t i = 0; i < spans.size(); ++i)
      (*crcs)[i] = StreamCopyWithCrc(spans[i].dst, spans[i].src, spans[i].size, 0);
    return;
  }
  size_t piece = std::max<size_t>(64 << 10, std::min(kPiece, total / (threads() * 4) + 1));
  piece = (piece + 4095) & ~size_t{4095};
  struct Piece {
    CopySpan span;
    size_t owner;  // index of the span it belongs to
    uint32_t crc;
  };
  std::vector<Piece> pieces;
  pieces.reserve(total / piece + spans.size() + 1);
  for (size_t i = 0; i < spans.size(); ++i) {
    const auto& s = spans[i];
    for (size_t off = 0; off < s.size; off += piece) {
      size_t n = std::min(piece, s.size - off);
      pieces.push_back(
          {{static_cast<uint8_t*>(s.dst) + off, static_cast<const uint8_t*>(s.src) + off, n},
           i,
           0});
    }
  }
  ParallelFor(pieces.size(), [&](size_t k) {
    Piece& p = pieces[k];
    p.crc = StreamCopyWithCrc(p.span.dst, p.span.src, p.span.size, 0);
  });
  for (const Piece& p : pieces)  // a span's pieces are in order
    (*crcs)[p.owner] = Crc32Combine((*crcs)[p.owner], p.crc, p.span.size);
}

void CopyEngine::Copy(const std::vector<CopySpan>& spans, bool bypass_caches) {
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
  if (bypass_caches) {
    ParallelFor(pieces.size(),
                [&](size_t i) { StreamCopy(pieces[i].dst, pieces[i].src, pieces[i].size); });
  } else {
    ParallelFor(pieces.size(),
                [&](size_t i) { std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].size); });
  }
}

}  // namespace nebulite

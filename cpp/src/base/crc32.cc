// CRC-32 (zlib's polynomial). Bulk data goes through a carry-less multiplication
// folding kernel (PCLMULQDQ, after Intel's "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ Instruction", with the constants Chromium's zlib uses)
// when the CPU has it, four times wider with VPCLMULQDQ on AVX-512 CPUs; short tails,
// other CPUs and combination go through zlib.
#include "nebulite/crc32.h"

#include <zlib.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define NEBULITE_HAVE_CLMUL_KERNEL 1
#endif

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace nebulite {

namespace {

#ifdef NEBULITE_HAVE_CLMUL_KERNEL
// The reflected constants below are x^n mod P(x) (P the CRC-32 polynomial), bit-reversed
// and shifted left by one, as the folding algorithm wants them: folding a 128-bit lane
// forward by D bits multiplies its low half by x^(D+32) and its high half by x^(D-32).
alignas(16) constexpr uint64_t kFold64[] = {0x0154442bd4, 0x01c6e41596};  // D = 512
alignas(16) constexpr uint64_t kFold16[] = {0x01751997d0, 0x00ccaa009e};  // D = 128
alignas(16) constexpr uint64_t k5k0[] = {0x0163cd6124, 0x0000000000};
alignas(16) constexpr uint64_t kPoly[] = {0x01db710641, 0x01f7011641};

// Folds four 128-bit lanes (the state after 64-byte steps) with the `len` bytes at `buf`
// (a multiple of 16) and reduces to the pre-inverted CRC.
__attribute__((target("sse4.1,pclmul"))) uint32_t ClmulFinish(__m128i x1, __m128i x2, __m128i x3,
                                                              __m128i x4, const unsigned char* buf,
                                                              size_t len) {
  __m128i x0, x5, x6, x7, x8, y5, y6, y7, y8;
  x0 = _mm_load_si128(reinterpret_cast<const __m128i*>(kFold64));
  // Fold four 128-bit lanes in parallel, 64 bytes a step.
  while (len >= 64) {
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
    x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
    x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
    x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
    y5 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x00));
    y6 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x10));
    y7 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x20));
    y8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x30));
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
    x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
    x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
    x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
    buf += 64;
    len -= 64;
  }

  // Fold the four lanes into one.
  x0 = _mm_load_si128(reinterpret_cast<const __m128i*>(kFold16));
  x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
  x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
  x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
  x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);

  // Remaining 16-byte blocks.
  while (len >= 16) {
    x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    buf += 16;
    len -= 16;
  }

  // 128 -> 64 bits.
  x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
  x3 = _mm_setr_epi32(~0, 0, ~0, 0);
  x1 = _mm_srli_si128(x1, 8);
  x1 = _mm_xor_si128(x1, x2);
  x0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k5k0));
  x2 = _mm_srli_si128(x1, 4);
  x1 = _mm_and_si128(x1, x3);
  x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
  x1 = _mm_xor_si128(x1, x2);

  // Barrett reduction to 32 bits.
  x0 = _mm_load_si128(reinterpret_cast<const __m128i*>(kPoly));
  x2 = _mm_and_si128(x1, x3);
  x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
  x2 = _mm_and_si128(x2, x3);
  x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
  x1 = _mm_xor_si128(x1, x2);
  return static_cast<uint32_t>(_mm_extract_epi32(x1, 1));
}

// Folds `len` bytes (len >= 64, a multiple of 16) into the pre-inverted `crc`.
__attribute__((target("sse4.1,pclmul"))) uint32_t Crc32Clmul(const unsigned char* buf, size_t len,
                                                             uint32_t crc) {
  __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x00));
  __m128i x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x10));
  __m128i x3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x20));
  __m128i x4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + 0x30));
  x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128(static_cast<int>(crc)));
  return ClmulFinish(x1, x2, x3, x4, buf + 64, len - 64);
}

// The same folding, 256 bytes a step in four 512-bit registers (VPCLMULQDQ folds four
// 128-bit lanes per instruction); then the four registers are folded into one, whose four
// lanes are the state ClmulFinish() continues from. len >= 256, a multiple of 16.
// GCC 12's AVX-512 headers build some results from _mm512_undefined_*(), which it then
// reports as uninitialized: a known false positive.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define NEBULITE_WIDE_CLMUL \
  __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.1"), always_inline)) inline
NEBULITE_WIDE_CLMUL __m512i fold(__m512i z, __m512i k) {
  return _mm512_xor_si512(_mm512_clmulepi64_epi128(z, k, 0x00),
                          _mm512_clmulepi64_epi128(z, k, 0x11));
}
NEBULITE_WIDE_CLMUL __m512i constants(uint64_t lo, uint64_t hi) {
  return _mm512_broadcast_i32x4(
      _mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo)));
}
#undef NEBULITE_WIDE_CLMUL

__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.1"))) uint32_t Crc32Vpclmul(
    const unsigned char* buf, size_t len, uint32_t crc) {
  const __m512i k256 = constants(0x011542778a, 0x01322d1430);  // D = 2048
  __m512i z0 = _mm512_loadu_si512(buf + 0x00);
  __m512i z1 = _mm512_loadu_si512(buf + 0x40);
  __m512i z2 = _mm512_loadu_si512(buf + 0x80);
  __m512i z3 = _mm512_loadu_si512(buf + 0xc0);
  z0 = _mm512_xor_si512(z0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  buf += 256;
  len -= 256;
  while (len >= 256) {
    z0 = _mm512_xor_si512(fold(z0, k256), _mm512_loadu_si512(buf + 0x00));
    z1 = _mm512_xor_si512(fold(z1, k256), _mm512_loadu_si512(buf + 0x40));
    z2 = _mm512_xor_si512(fold(z2, k256), _mm512_loadu_si512(buf + 0x80));
    z3 = _mm512_xor_si512(fold(z3, k256), _mm512_loadu_si512(buf + 0xc0));
    buf += 256;
    len -= 256;
  }
  z3 = _mm512_xor_si512(z3, fold(z0, constants(0x01821d8bc0, 0x012e958ac4)));  // D = 1536
  z3 = _mm512_xor_si512(z3, fold(z1, constants(0x01e88ef372, 0x014a7fe880)));  // D = 1024
  z3 = _mm512_xor_si512(z3, fold(z2, constants(0x0154442bd4, 0x01c6e41596)));  // D = 512
  return ClmulFinish(_mm512_extracti32x4_epi32(z3, 0), _mm512_extracti32x4_epi32(z3, 1),
                     _mm512_extracti32x4_epi32(z3, 2), _mm512_extracti32x4_epi32(z3, 3), buf, len);
}

// Copies `len` bytes (>= 256, a multiple of 256) from `src` to `dst` (64-byte aligned) with
// non-temporal stores and folds them into the pre-inverted `crc` as Crc32Vpclmul does, in
// the same pass: each 256 bytes are loaded once, stored, and folded from the registers.
__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.1"))) uint32_t Crc32CopyVpclmul(
    unsigned char* dst, const unsigned char* src, size_t len, uint32_t crc) {
  const __m512i k256 = constants(0x011542778a, 0x01322d1430);  // D = 2048
  __m512i z0 = _mm512_loadu_si512(src + 0x00);
  __m512i z1 = _mm512_loadu_si512(src + 0x40);
  __m512i z2 = _mm512_loadu_si512(src + 0x80);
  __m512i z3 = _mm512_loadu_si512(src + 0xc0);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 0x00), z0);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 0x40), z1);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 0x80), z2);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 0xc0), z3);
  z0 = _mm512_xor_si512(z0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  src += 256;
  dst += 256;
  len -= 256;
  while (len >= 256) {
    const __m512i y0 = _mm512_loadu_si512(src + 0x00);
    const __m512i y1 = _mm512_loadu_si512(src + 0x40);
    const __m512i y2 = _mm512_loadu_si512(src + 0x80);
    const __m512i y3 = _mm512_loadu_si512(src + 0xc0);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 0x00), y0);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 0x40), y1);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 0x80), y2);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 0xc0), y3);
    z0 = _mm512_xor_si512(fold(z0, k256), y0);
    z1 = _mm512_xor_si512(fold(z1, k256), y1);
    z2 = _mm512_xor_si512(fold(z2, k256), y2);
    z3 = _mm512_xor_si512(fold(z3, k256), y3);
    src += 256;
    dst += 256;
    len -= 256;
  }
  _mm_sfence();  // the streaming stores are weakly ordered
  z3 = _mm512_xor_si512(z3, fold(z0, constants(0x01821d8bc0, 0x012e958ac4)));  // D = 1536
  z3 = _mm512_xor_si512(z3, fold(z1, constants(0x01e88ef372, 0x014a7fe880)));  // D = 1024
  z3 = _mm512_xor_si512(z3, fold(z2, constants(0x0154442bd4, 0x01c6e41596)));  // D = 512
  return ClmulFinish(_mm512_extracti32x4_epi32(z3, 0), _mm512_extracti32x4_epi32(z3, 1),
                     _mm512_extracti32x4_epi32(z3, 2), _mm512_extracti32x4_epi32(z3, 3), src, 0);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

bool HaveClmul() {
  static const bool have = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return have;
}

bool HaveVpclmul() {
  static const bool have = HaveClmul() && __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("vpclmulqdq");
  return have;
}
#endif

}  // namespace

uint32_t Crc32(uint32_t crc, const void* data, size_t n) {
  if (n == 0) return crc;
  const auto* p = static_cast<const unsigned char*>(data);
#ifdef NEBULITE_HAVE_CLMUL_KERNEL
  if (n >= 64 && HaveClmul()) {
    const size_t bulk = n & ~size_t{15};
    crc = bulk >= 1024 && HaveVpclmul() ? ~Crc32Vpclmul(p, bulk, ~crc) : ~Crc32Clmul(p, bulk, ~crc);
    p += bulk;
    n -= bulk;
    if (n == 0) return crc;
  }
#endif
  return static_cast<uint32_t>(crc32_z(crc, p, n));
}

bool Crc32CopyWide(void* dst, const void* src, size_t n, uint32_t* crc) {
#ifdef NEBULITE_HAVE_CLMUL_KERNEL
  if (n < 4096 || !HaveVpclmul()) return false;
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  const size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  std::memcpy(d, s, head);
  uint32_t c = Crc32(*crc, s, head);
  const size_t bulk = (n - head) & ~size_t{255};
  c = ~Crc32CopyVpclmul(d + head, s + head, bulk, ~c);
  const size_t done = head + bulk;
  std::memcpy(d + done, s + done, n - done);
  *crc = Crc32(c, s + done, n - done);
  return true;
#else
  (void)dst, (void)src, (void)n, (void)crc;
  return false;
#endif
}

uint32_t Crc32Zlib(uint32_t crc, const void* data, size_t n) {
  if (n == 0) return crc;
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), n));
}

uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return static_cast<uint32_t>(crc32_combine64(crc_a, crc_b, static_cast<z_off64_t>(len_b)));
}

uint32_t Crc32Parallel(const void* data, size_t n, int threads) {
  // Below this size a thread costs more than it saves.
  constexpr size_t kMinChunk = 1 << 20;
  size_t chunks = threads <= 1 ? 1 : static_cast<size_t>(threads);
  chunks = std::min(chunks, std::max<size_t>(1, n / kMinChunk));
  if (chunks <= 1) return Crc32(0, data, n);

  const auto* bytes = static_cast<const unsigned char*>(data);
  const size_t chunk = n / chunks;
  std::vector<uint32_t> crcs(chunks, 0);
  std::vector<size_t> lens(chunks, chunk);
  lens.back() = n - chunk * (chunks - 1);
  std::vector<std::thread> workers;
  workers.reserve(chunks - 1);
  for (size_t i = 1; i < chunks; ++i) {
    workers.emplace_back([&, i] { crcs[i] = Crc32(0, bytes + i * chunk, lens[i]); });
  }
  crcs[0] = Crc32(0, bytes, lens[0]);
  for (auto& w : workers) w.join();
  uint32_t crc = crcs[0];
  for (size_t i = 1; i < chunks; ++i) crc = Crc32Combine(crc, crcs[i], lens[i]);
  return crc;
}

}  // namespace nebulite

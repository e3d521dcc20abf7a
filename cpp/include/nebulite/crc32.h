// CRC-32 (the zip / zlib polynomial, reflected 0xEDB88320), the checksum every
// nebulite payload carries (see docs/format.md). Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace nebulite {

// Extends `crc` (0 for a fresh checksum) over `n` bytes at `data`.
uint32_t Crc32(uint32_t crc, const void* data, size_t n);

// Copies n bytes from src to dst with non-temporal stores and extends `*crc` over them, in
// one pass (each block is loaded once, stored and folded from the registers), where the CPU
// folds CRCs 512 bits wide (AVX-512 with VPCLMULQDQ) and n >= 4096. Returns false, having
// done nothing, elsewhere.
bool Crc32CopyWide(void* dst, const void* src, size_t n, uint32_t* crc);

// The portable implementation (zlib), for tests and benchmarks of the fast path.
uint32_t Crc32Zlib(uint32_t crc, const void* data, size_t n);

// CRC of A||B given crc(A), crc(B) and len(B).
uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// CRC of `n` bytes computed by `threads` threads (<= 1: the calling thread only).
uint32_t Crc32Parallel(const void* data, size_t n, int threads);

}  // namespace nebulite

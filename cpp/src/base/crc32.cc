// CRC-32 on top of zlib, whose crc32_z is table- or hardware-accelerated.
#include "nebulite/crc32.h"

#include <zlib.h>

#include <algorithm>
#include <thread>
#include <vector>

namespace nebulite {

uint32_t Crc32(uint32_t crc, const void* data, size_t n) {
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

#include "nebulite/crc32.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

namespace nebulite {
namespace {

std::vector<unsigned char> Pattern(size_t n) {
  std::vector<unsigned char> v(n);
  uint32_t x = 12345;
  for (auto& b : v) {
    x = x * 1103515245u + 12345u;
    b = static_cast<unsigned char>(x >> 16);
  }
  return v;
}

TEST(Crc32Test, KnownVectors) {
  EXPECT_EQ(Crc32(0, "123456789", 9), 0xCBF43926u);
  EXPECT_EQ(Crc32(0, "", 0), 0u);
  EXPECT_EQ(Crc32(0, nullptr, 0), 0u);
  EXPECT_EQ(Crc32(0, "a", 1), 0xE8B7BE43u);
  const std::string fox = "The quick brown fox jumps over the lazy dog";
  EXPECT_EQ(Crc32(0, fox.data(), fox.size()), 0x414FA339u);
}

TEST(Crc32Test, Incremental) { EXPECT_EQ(Crc32(Crc32(0, "12345", 5), "6789", 4), 0xCBF43926u); }

TEST(Crc32Test, Combine) {
  const uint32_t a = Crc32(0, "1234", 4);
  const uint32_t b = Crc32(0, "56789", 5);
  EXPECT_EQ(Crc32Combine(a, b, 5), 0xCBF43926u);
  EXPECT_EQ(Crc32Combine(a, 0, 0), a);
  auto data = Pattern(100003);
  for (size_t split : {size_t{0}, size_t{1}, size_t{4097}, size_t{100002}, size_t{100003}}) {
    const uint32_t left = Crc32(0, data.data(), split);
    const uint32_t right = Crc32(0, data.data() + split, data.size() - split);
    EXPECT_EQ(Crc32Combine(left, right, data.size() - split), Crc32(0, data.data(), data.size()))
        << "split " << split;
  }
}

TEST(Crc32Test, ParallelMatchesSerial) {
  for (size_t n :
       {size_t{0}, size_t{1}, size_t{4095}, size_t{(8u << 20) + 7}, size_t{(5u << 20) + 12345}}) {
    auto data = Pattern(n);
    const uint32_t serial = Crc32(0, data.data(), n);
    for (int threads : {-1, 0, 1, 2, 3, 7, 16}) {
      EXPECT_EQ(Crc32Parallel(data.data(), n, threads), serial)
          << "n=" << n << " threads=" << threads;
    }
  }
}

}  // namespace
}  // namespace nebulite

namespace nebulite {
namespace {

TEST(Crc32FastPathTest, MatchesZlibOnEverySizeAndAlignment) {
  std::vector<unsigned char> buf(70000);
  uint32_t x = 12345;
  for (auto& b : buf) {
    x = x * 1103515245 + 12345;
    b = static_cast<unsigned char>(x >> 16);
  }
  for (size_t off = 0; off < 17; ++off) {
    // Around the bounds of each kernel: the 16-byte steps, the 64-byte folding, and the
    // 256-byte folding of the wide kernel (from 1024 bytes on, where the CPU has it).
    for (size_t n : {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 1023, 1024,
                     1040, 1088, 1279, 1280, 1296, 4096, 4097, 65536, 69000}) {
      if (off + n > buf.size()) continue;
      EXPECT_EQ(Crc32(0, buf.data() + off, n), Crc32Zlib(0, buf.data() + off, n))
          << off << " " << n;
      EXPECT_EQ(Crc32(0xDEADBEEF, buf.data() + off, n), Crc32Zlib(0xDEADBEEF, buf.data() + off, n));
    }
  }
  // Incremental use across arbitrary splits equals one pass.
  uint32_t whole = Crc32(0, buf.data(), buf.size());
  uint32_t parts = Crc32(Crc32(Crc32(0, buf.data(), 100), buf.data() + 100, 33333),
                         buf.data() + 33433, buf.size() - 33433);
  EXPECT_EQ(whole, parts);
}

}  // namespace
}  // namespace nebulite

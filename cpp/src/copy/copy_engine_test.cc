#include "nebulite/copy_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <numeric>
#include <thread>
#include <vector>

#include "nebulite/crc32.h"

namespace nebulite {
namespace {

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed);
  return v;
}

TEST(CopyEngineTest, CopiesManySpansOfMixedSizesExactly) {
  CopyEngine engine(3);
  EXPECT_EQ(engine.threads(), 3);
  std::vector<size_t> sizes = {0, 1, 7, 4096, 4097, 1 << 20, (3 << 20) + 5, 17 << 20};
  std::vector<std::vector<uint8_t>> src, dst;
  std::vector<CopySpan> spans;
  for (size_t i = 0; i < sizes.size(); ++i) {
    src.push_back(Pattern(sizes[i], static_cast<uint8_t>(i)));
    dst.emplace_back(sizes[i], 0);
  }
  for (size_t i = 0; i < sizes.size(); ++i)
    spans.push_back({dst[i].data(), src[i].data(), sizes[i]});
  engine.Copy(spans);
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(src[i], dst[i]) << "span " << i;
}

TEST(CopyEngineTest, ParallelForRunsEveryIndexOnce) {
  CopyEngine engine(4);
  std::vector<std::atomic<int>> hits(1000);
  for (int round = 0; round < 20; ++round) {
    engine.ParallelFor(hits.size(), [&](size_t i) { hits[i]++; });
  }
  for (auto& h : hits) EXPECT_EQ(h.load(), 20);
}

TEST(CopyEngineTest, ConcurrentCallersAreSerialisedSafely) {
  CopyEngine engine(2);
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([&, c] {
      for (int i = 0; i < 5; ++i) {
        auto src = Pattern(3 << 20, static_cast<uint8_t>(c + i));
        std::vector<uint8_t> dst(src.size());
        engine.Copy({{dst.data(), src.data(), src.size()}});
        if (dst != src) ++bad;
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(CopyEngineTest, SingleThreadEngineStillCopies) {
  CopyEngine engine(1);
  auto src = Pattern(5 << 20, 9);
  std::vector<uint8_t> dst(src.size());
  engine.Copy({{dst.data(), src.data(), src.size()}});
  EXPECT_EQ(dst, src);
}

TEST(CopyEngineTest, StreamCopyHandlesEveryAlignmentAndTail) {
  // Large enough for the streaming path; odd offsets exercise the unaligned head and
  // the tail shorter than one 64-byte line.
  auto src = Pattern((1 << 20) + 333, 5);
  for (size_t shift : {0, 1, 15, 63}) {
    for (size_t n : {size_t{300 << 10}, (size_t{1} << 20) + 7, (size_t{256} << 10) + 63}) {
      std::vector<uint8_t> dst(n + 64, 0xAB);
      StreamCopy(dst.data() + shift, src.data() + 3, n);
      EXPECT_TRUE(std::equal(dst.begin() + shift, dst.begin() + shift + n, src.begin() + 3))
          << "shift " << shift << " n " << n;
      EXPECT_EQ(dst[shift + n], 0xAB);  // nothing written past the end
      if (shift > 0) EXPECT_EQ(dst[shift - 1], 0xAB);
    }
  }
}

TEST(CopyEngineTest, CopyWithAndWithoutBypassingCachesIsExact) {
  CopyEngine engine(2);
  auto src = Pattern((9 << 20) + 11, 3);
  for (bool bypass : {true, false}) {
    std::vector<uint8_t> dst(src.size(), 0);
    engine.Copy({{dst.data(), src.data(), src.size()}}, bypass);
    EXPECT_EQ(dst, src) << "bypass " << bypass;
  }
}

// The copy that checksums in the same pass (the staging copy): every byte lands and the CRC
// equals zlib's, for every size around the kernels' bounds and every alignment.
TEST(CopyEngineTest, CopyWithCrcIsExactAndMatchesZlib) {
  auto src = Pattern((3 << 20) + 777, 7);
  for (size_t shift : {0, 1, 17, 63}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{255}, size_t{4095}, size_t{4096}, size_t{4097},
                     size_t{(256 << 10) - 1}, size_t{256 << 10}, size_t{(256 << 10) + 300},
                     (size_t{1} << 20) + 77, size_t{3} << 20}) {
      std::vector<uint8_t> dst(n + 128, 0xAB);
      const uint32_t crc = StreamCopyWithCrc(dst.data() + shift, src.data() + 5, n, 0x1234);
      EXPECT_EQ(crc, Crc32Zlib(0x1234, src.data() + 5, n)) << "shift " << shift << " n " << n;
      EXPECT_TRUE(std::equal(dst.begin() + shift, dst.begin() + shift + n, src.begin() + 5))
          << "shift " << shift << " n " << n;
      EXPECT_EQ(dst[shift + n], 0xAB);
    }
  }
  CopyEngine engine(2);
  std::vector<uint8_t> dst(src.size(), 0);
  std::vector<CopySpan> spans = {{dst.data(), src.data(), 1000},
                                 {dst.data() + 1000, src.data() + 1000, 0},
                                 {dst.data() + 4096, src.data() + 4096, src.size() - 4096}};
  std::vector<uint32_t> crcs;
  engine.CopyWithCrc(spans, &crcs);
  ASSERT_EQ(crcs.size(), 3u);
  EXPECT_EQ(crcs[0], Crc32Zlib(0, src.data(), 1000));
  EXPECT_EQ(crcs[1], 0u);
  EXPECT_EQ(crcs[2], Crc32Zlib(0, src.data() + 4096, src.size() - 4096));
  EXPECT_TRUE(std::equal(dst.begin() + 4096, dst.end(), src.begin() + 4096));
}

}  // namespace
}  // namespace nebulite

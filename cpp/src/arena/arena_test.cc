#include "nebulite/arena.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>

namespace nebulite {
namespace {

using std::chrono::milliseconds;

TEST(ArenaTest, ReservesAlignedBlocksAndReusesReleasedSpace) {
  auto arena = Arena::Create(8 << 20, /*prefault=*/true);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  Arena& a = **arena;
  EXPECT_GE(a.capacity(), 8u << 20);
  auto b1 = a.TryReserve(1);
  ASSERT_TRUE(b1.ok());
  EXPECT_EQ(b1->size, Arena::kAlignment);
  auto b2 = a.TryReserve(5000);
  ASSERT_TRUE(b2.ok());
  EXPECT_EQ(b2->offset % Arena::kAlignment, 0u);
  EXPECT_EQ(b2->size, 8192u);
  EXPECT_EQ(a.used(), 3 * Arena::kAlignment);
  // The memory is writable and shared through the fd.
  std::memset(a.base() + b2->offset, 0xAB, b2->size);
  a.Release(*b1);
  a.Release(*b2);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.largest_free(), a.capacity());  // coalesced back into one range
  a.WaitPrefaulted();
}

TEST(ArenaTest, GrowsOnlyWhenAskedAndReportsItsHighWaterMark) {
  auto arena = Arena::Create(8 << 20, /*prefault=*/false);
  ASSERT_TRUE(arena.ok());
  Arena& a = **arena;
  EXPECT_EQ(a.resident(), 0u);
  EXPECT_EQ(a.TryReserve(4096, /*grow=*/false).status().code(), StatusCode::kResourceExhausted);
  auto b1 = a.TryReserve(1 << 20);
  ASSERT_TRUE(b1.ok());
  EXPECT_EQ(a.resident(), 1u << 20);
  // Below the mark, released space is handed out again without growing.
  a.Release(*b1);
  auto b2 = a.TryReserve(512 << 10, /*grow=*/false);
  ASSERT_TRUE(b2.ok());
  EXPECT_EQ(b2->offset, 0u);
  EXPECT_FALSE(a.TryReserve(768 << 10, /*grow=*/false).ok());  // would cross the mark
  auto b3 = a.TryReserve(768 << 10);
  ASSERT_TRUE(b3.ok());
  EXPECT_EQ(a.resident(), (512u << 10) + (768u << 10));
  // The background pre-fault raises the mark over the whole capacity.
  auto pre = Arena::Create(8 << 20, /*prefault=*/true);
  ASSERT_TRUE(pre.ok());
  (*pre)->WaitPrefaulted();
  EXPECT_EQ((*pre)->resident(), (*pre)->capacity());
  EXPECT_TRUE((*pre)->TryReserve(4 << 20, /*grow=*/false).ok());
}

TEST(ArenaTest, RejectsRequestsLargerThanTheBudget) {
  auto arena = Arena::Create(4 << 20, false);
  ASSERT_TRUE(arena.ok());
  auto r = (*arena)->Reserve((*arena)->capacity() + 1, milliseconds(10));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_FALSE(Arena::Create(0, false).ok());
}

TEST(ArenaTest, FullArenaTimesOutThenBackPressureWaitsForRelease) {
  auto arena = Arena::Create(2 << 20, false);
  ASSERT_TRUE(arena.ok());
  Arena& a = **arena;
  auto all = a.TryReserve(a.capacity());
  ASSERT_TRUE(all.ok());
  auto r = a.Reserve(4096, milliseconds(30));
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  std::thread releaser([&] {
    std::this_thread::sleep_for(milliseconds(50));
    a.Release(*all);
  });
  auto w = a.Reserve(1 << 20, milliseconds(5000));
  releaser.join();
  ASSERT_TRUE(w.ok()) << w.status().ToString();
}

TEST(ArenaTest, MakeRoomIsCalledWhileWaiting) {
  auto arena = Arena::Create(2 << 20, false);
  ASSERT_TRUE(arena.ok());
  Arena& a = **arena;
  auto all = a.TryReserve(a.capacity());
  ASSERT_TRUE(all.ok());
  int calls = 0;
  auto r = a.Reserve(4096, milliseconds(5000), [&] {
    ++calls;
    a.Release(*all);
    return true;
  });
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(calls, 1);
}

TEST(ArenaTest, ConcurrentReserveReleaseKeepsAccounting) {
  auto arena = Arena::Create(16 << 20, false);
  ASSERT_TRUE(arena.ok());
  Arena& a = **arena;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        auto b = a.Reserve(4096 * (1 + (i + t) % 7), milliseconds(5000));
        if (!b.ok()) {
          ++failures;
          continue;
        }
        a.base()[b->offset] = static_cast<uint8_t>(i);
        a.Release(*b);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.largest_free(), a.capacity());
}

}  // namespace
}  // namespace nebulite

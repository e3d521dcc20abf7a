#include "pointer_map.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace nebulite::python {
namespace {

// Keys as the extension meets them: object addresses, 16-byte aligned, often close together.
const void* Key(uintptr_t i) { return reinterpret_cast<const void*>(0x10000 + 16 * i); }

TEST(PointerMapTest, FindsWhatWasPut) {
  PointerMap<int> m;
  EXPECT_EQ(m.Find(Key(1)), nullptr);
  auto [v, fresh] = m.TryEmplace(Key(1), 7);
  EXPECT_TRUE(fresh);
  EXPECT_EQ(*v, 7);
  auto [again, fresh_again] = m.TryEmplace(Key(1), 9);
  EXPECT_FALSE(fresh_again);
  EXPECT_EQ(*again, 7);  // the first value stays
  ASSERT_NE(m.Find(Key(1)), nullptr);
  EXPECT_EQ(*m.Find(Key(1)), 7);
  EXPECT_EQ(m.size(), 1u);
}

TEST(PointerMapTest, GrowsKeepingEveryEntry) {
  PointerMap<uint32_t> m;
  for (uint32_t i = 0; i < 10000; ++i) ASSERT_TRUE(m.TryEmplace(Key(i), i).second);
  EXPECT_EQ(m.size(), 10000u);
  for (uint32_t i = 0; i < 10000; ++i) {
    const uint32_t* v = m.Find(Key(i));
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(*v, i);
  }
  EXPECT_EQ(m.Find(Key(10000)), nullptr);
}

TEST(PointerMapTest, EraseUnlessKeepsWhatItIsTold) {
  PointerMap<int> m;
  m.TryEmplace(Key(1), 5);
  EXPECT_EQ(m.EraseUnless(Key(1), [](int v) { return v == 5; }), 0);
  EXPECT_NE(m.Find(Key(1)), nullptr);
  EXPECT_EQ(m.EraseUnless(Key(1), [](int v) { return v != 5; }), 5);
  EXPECT_EQ(m.Find(Key(1)), nullptr);
  EXPECT_EQ(m.size(), 0u);
  EXPECT_EQ(m.EraseUnless(Key(1), [](int) { return false; }), 0);  // absent: nothing
}

// Removals in the middle of runs of colliding keys, against std::map: every key left stays
// reachable (the entries after a removed one move back into its place).
TEST(PointerMapTest, RemovalsKeepTheRestReachable) {
  std::mt19937_64 rng(42);
  PointerMap<std::string> m;
  std::map<uintptr_t, std::string> model;
  for (int round = 0; round < 20000; ++round) {
    const uintptr_t k = rng() % 3000;
    if (rng() % 3 == 0) {
      const std::string gone = m.EraseUnless(Key(k), [](const std::string&) { return false; });
      auto it = model.find(k);
      EXPECT_EQ(gone, it == model.end() ? "" : it->second);
      if (it != model.end()) model.erase(it);
    } else {
      const bool fresh = m.TryEmplace(Key(k), std::to_string(round)).second;
      EXPECT_EQ(fresh, model.emplace(k, std::to_string(round)).second);
    }
    ASSERT_EQ(m.size(), model.size());
  }
  for (uintptr_t k = 0; k < 3000; ++k) {
    const std::string* v = m.Find(Key(k));
    auto it = model.find(k);
    if (it == model.end()) {
      EXPECT_EQ(v, nullptr) << k;
    } else {
      ASSERT_NE(v, nullptr) << k;
      EXPECT_EQ(*v, it->second);
    }
  }
}

TEST(PointerMapTest, TakeAllEmptiesIt) {
  PointerMap<int> m;
  for (int i = 0; i < 100; ++i) m.TryEmplace(Key(i), i);
  std::vector<int> all = m.TakeAll();
  EXPECT_EQ(all.size(), 100u);
  int sum = 0;
  for (int v : all) sum += v;
  EXPECT_EQ(sum, 99 * 100 / 2);
  EXPECT_EQ(m.size(), 0u);
  EXPECT_EQ(m.Find(Key(3)), nullptr);
  EXPECT_TRUE(m.TryEmplace(Key(3), 1).second);
}

}  // namespace
}  // namespace nebulite::python

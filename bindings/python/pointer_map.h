// A map keyed by object addresses for the extension's per-tensor lookups (the scan and the
// walk of a save, the registry of safe storages): open addressing with linear probing in one
// array, so that a lookup reads one cache line and an insertion allocates nothing but, now
// and then, a larger array (std::unordered_map allocates a node per entry).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace nebulite::python {

template <typename V>
class PointerMap {
 public:
  explicit PointerMap(size_t expected = 8) {
    size_t n = 16;
    while (n < 2 * expected) n *= 2;
    slots_.resize(n);
  }

  size_t size() const { return size_; }

  // The value of `key`, or null.
  V* Find(const void* key) {
    Slot& s = slots_[At(key)];
    return s.key == nullptr ? nullptr : &s.value;
  }
  const V* Find(const void* key) const { return const_cast<PointerMap*>(this)->Find(key); }

  // The value of `key` (made from `value` if the key was absent) and whether it was absent.
  // The pointer is valid until the next insertion or removal.
  std::pair<V*, bool> TryEmplace(const void* key, V value) {
    size_t i = At(key);
    if (slots_[i].key != nullptr) return {&slots_[i].value, false};
    if (2 * (size_ + 1) > slots_.size()) {
      Grow();
      i = At(key);
    }
    slots_[i] = {key, std::move(value)};
    ++size_;
    return {&slots_[i].value, true};
  }

  // Removes `key` if `keep(value)` is false; returns the value removed (default if none).
  template <typename Keep>
  V EraseUnless(const void* key, Keep&& keep) {
    size_t i = At(key);
    if (slots_[i].key == nullptr || keep(slots_[i].value)) return V{};
    V out = std::move(slots_[i].value);
    // The entries after it that would no longer be found move back into the gap.
    for (size_t j = Next(i); slots_[j].key != nullptr; j = Next(j)) {
      const size_t home = Home(slots_[j].key);
      const bool reachable = i <= j ? (i < home && home <= j) : (i < home || home <= j);
      if (reachable) continue;
      slots_[i] = std::move(slots_[j]);
      i = j;
    }
    slots_[i] = Slot{};
    --size_;
    return out;
  }

  // Every value, the map left empty.
  std::vector<V> TakeAll() {
    std::vector<V> out;
    out.reserve(size_);
    for (Slot& s : slots_)
      if (s.key != nullptr) out.push_back(std::move(s.value));
    slots_.assign(16, Slot{});
    size_ = 0;
    return out;
  }

 private:
  struct Slot {
    const void* key = nullptr;
    V value{};
  };

  size_t Home(const void* key) const {
    const uint64_t h = (reinterpret_cast<uintptr_t>(key) >> 4) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(h >> 32) & (slots_.size() - 1);
  }
  size_t Next(size_t i) const { return (i + 1) & (slots_.size() - 1); }
  // The key's slot, or the empty one where it would go.
  size_t At(const void* key) const {
    size_t i = Home(key);
    while (slots_[i].key != nullptr && slots_[i].key != key) i = Next(i);
    return i;
  }
  void Grow() {
    std::vector<Slot> old(2 * slots_.size());
    old.swap(slots_);
    for (Slot& s : old)
      if (s.key != nullptr) slots_[At(s.key)] = std::move(s);
  }

  std::vector<Slot> slots_;  // a power of two, at most half full
  size_t size_ = 0;
};

}  // namespace nebulite::python

// The registry of safe storages of asynchronous staging (nebulite._staging): the storages of
// optimizers' parameters and state, which may be copied after save() returns. Storages are
// known by identity: an entry is a weak reference to its storage, whose callback removes the
// entry when the storage's Python object is destroyed, before its memory (and so its address,
// the key here) can be taken by another object. The scan of every save and the optimizer's
// pre-hook of every step look storages up here, once per tensor: one cache line read per
// lookup (pointer_map.h), where a dict of ids made an int and read the dict's table, the
// stored int and the weak reference.
//
// Every member runs under the GIL. None holds a slot across a call into Python (which may run
// another thread, or a callback that removes an entry), so the registry needs no lock.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>

#include "pointer_map.h"

namespace nebulite::python {

class SafeStorages {
 public:
  // Where a safe storage's bytes are (kNone: not a safe storage).
  enum class Device : uint8_t { kNone = 0, kCpu = 1, kCuda = 2 };
  // A storage's device and, on a CUDA device, its index (-1 otherwise).
  struct Where {
    Device device = Device::kNone;
    int16_t index = -1;
  };

  SafeStorages() : table_(std::make_shared<Table>()) {}
  ~SafeStorages() { Clear(); }
  SafeStorages(const SafeStorages&) = delete;
  SafeStorages& operator=(const SafeStorages&) = delete;

  // Where `storage` is if it is registered, else {kNone, -1}.
  Where Find(PyObject* storage) const {
    const Entry* e = table_->Find(storage);
    return e == nullptr ? Where{} : e->where;
  }

  // Registers `storage` (a no-op if it is): a weak reference to it, whose callback drops the
  // entry. Raises what Python raised making the reference.
  void Add(PyObject* storage, Where where);

  // Drops every entry (their weak references with them).
  void Clear();

  size_t size() const { return table_->size(); }

 private:
  struct Entry {
    PyObject* ref = nullptr;  // the weak reference to the storage (owned)
    Where where;
  };
  // Keyed by the storage's address (not a reference to it).
  using Table = PointerMap<Entry>;

  // Kept by each weak reference's callback weakly: a callback that runs after the registry
  // went (someone else kept the reference) finds no table.
  std::shared_ptr<Table> table_;
};

// The registry behind a Python object (a TypeError if it is not one).
SafeStorages& SafeStoragesOf(nanobind::handle registry);

}  // namespace nebulite::python

// nebulite._core.scan: what an asynchronous save does on the caller's thread (see
// nebulite._staging). It records what to copy and nothing more: the containers are copied
// (so that the object pickled later is the one saved; so are instances of classes that
// pickle as object's default does, attributes and all), and for each tensor its storage and
// `_version`. Storages an optimizer manages (on the CPU or a CUDA device) are left to be
// copied later; the others, which forward may change before the next optimizer step, are
// copied here into one buffer (CPU storages only). The walk, the pickling and the staging
// run on the staging thread. Through the CPython API, a few attribute reads per tensor;
// torch is reached only through its Python objects.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attribute_names.h"
#include "pointer_map.h"
#include "safe_storages.h"
#include "status_binding.h"

namespace nb = nanobind;

namespace nebulite::python {
namespace {

// Raised inside the scan for an object it does not take: the save goes the synchronous way.
struct NotScannable {};

// A new reference, or NotScannable when Python raised (the error is cleared).
PyObject* Check(PyObject* r) {
  if (r == nullptr) {
    if (PyErr_ExceptionMatches(PyExc_MemoryError) ||
        PyErr_ExceptionMatches(PyExc_KeyboardInterrupt))
      throw nb::python_error();
    PyErr_Clear();
    throw NotScannable{};
  }
  return r;
}

void Ok(int rc) {
  if (rc != 0) throw nb::python_error();
}

class Scanner {
 public:
  Scanner(nb::handle tensor, nb::handle parameter, nb::handle ordered_dict, nb::handle atoms,
          nb::handle enum_type, nb::handle plain, const SafeStorages& safe, int max_depth,
          uint64_t max_copy_bytes)
      : tensor_(tensor.ptr()),
        parameter_(parameter.ptr()),
        ordered_dict_(ordered_dict.ptr()),
        atoms_(atoms.ptr()),
        enum_(reinterpret_cast<PyTypeObject*>(enum_type.ptr())),
        plain_(plain.ptr()),
        safe_(safe),
        max_depth_(max_depth),
        max_copy_bytes_(max_copy_bytes) {}

  nb::object Run(nb::handle obj) {
    nb::object frozen;
    try {
      frozen = Copy(obj.ptr(), 0);
    } catch (const NotScannable&) {
      return nb::none();
    }
    // The storages that may change before the next optimizer step, copied now.
    uint64_t total = 0;
    for (const Copied& c : copies_) total += Aligned(c.nbytes);
    nb::object snapshot =
        nb::steal(Check(PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(total))));
    char* base = PyByteArray_AS_STRING(snapshot.ptr());
    nb::list at;
    uint64_t offset = 0;
    for (const Copied& c : copies_) {
      if (c.nbytes > 0)
        std::memcpy(base + offset, reinterpret_cast<const void*>(c.address), c.nbytes);
      Ok(PyList_Append(at.ptr(), nb::make_tuple(c.storage, offset, c.nbytes).ptr()));
      offset += Aligned(c.nbytes);
    }
    nb::object which = nb::steal(Check(PyBytes_FromStringAndSize(
        reinterpret_cast<const char*>(which_.data()),
        static_cast<Py_ssize_t>(which_.size() * sizeof(uint32_t)))));
    nb::object safe = nb::steal(Check(PyBytes_FromStringAndSize(
        safe_flags_.data(), static_cast<Py_ssize_t>(safe_flags_.size()))));
    return nb::make_tuple(frozen, tensors_out_, versions_, which, storages_out_, safe, snapshot,
                          reinterpret_cast<uintptr_t>(base), at, storage_bytes_, layouts_,
                          cuda_devices_, skeleton_bytes_);
  }

 private:
  struct Copied {
    uint32_t storage;  // its index in storages_out_
    uintptr_t address;
    uint64_t nbytes;
  };

  static uint64_t Aligned(uint64_t n) { return (n + 63) & ~uint64_t{63}; }

  nb::object Attr(PyObject* x, PyObject* name) {
    return nb::steal(Check(PyObject_GetAttr(x, name)));
  }
  nb::object Call(PyObject* x, PyObject* name) {
    return nb::steal(Check(PyObject_CallMethodNoArgs(x, name)));
  }
  // True if `x` has attributes of its own (without making the empty __dict__ that reading
  // `__dict__` makes for an object that has none).
  bool HasAttributes(PyObject* x) {
#if PY_VERSION_HEX < 0x030D0000
    PyObject** dict = _PyObject_GetDictPtr(x);
    return dict != nullptr && *dict != nullptr &&
           (!PyDict_Check(*dict) || PyDict_GET_SIZE(*dict) > 0);
#else
    nb::object attrs = Attr(x, N().dict);
    return !PyDict_Check(attrs.ptr()) || PyDict_GET_SIZE(attrs.ptr()) > 0;
#endif
  }
  uint64_t Unsigned(const nb::object& o) {
    const unsigned long long v = PyLong_AsUnsignedLongLong(o.ptr());
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) Check(nullptr);
    return v;
  }

  void Tensor(PyObject* x) {
    const Names& n = N();
    // Attributes of its own are pickled with it (torch's reduction): not seen here.
    if (HasAttributes(x)) throw NotScannable{};
    nb::object s = Call(x, n.untyped_storage);
    auto [at, fresh] = index_.TryEmplace(s.ptr(), static_cast<uint32_t>(index_.size()));
    const uint32_t k = *at;
    if (fresh) {
      Ok(PyList_Append(storages_out_.ptr(), s.ptr()));  // keeps it alive: its address is its key
      // A safe storage's device is known. A safe CUDA storage is copied later, from its
      // device, behind an event that save() records on the device's current stream; any
      // other storage off the CPU takes the synchronous way.
      const SafeStorages::Where where = safe_.Find(s.ptr());
      const bool safe = where.device != SafeStorages::Device::kNone;
      if (where.device == SafeStorages::Device::kCuda) {
        if (where.index < 0 || where.index >= 64) throw NotScannable{};
        cuda_devices_ |= uint64_t{1} << where.index;
      }
      if (!safe && Attr(x, n.is_cpu).ptr() != Py_True) throw NotScannable{};
      const uint64_t nbytes = Unsigned(Call(s.ptr(), n.nbytes));
      storage_bytes_ += nbytes;
      safe_flags_.push_back(safe ? 1 : 0);
      if (!safe) {
        copy_bytes_ += nbytes;
        if (copy_bytes_ > max_copy_bytes_) throw NotScannable{};
        const uint64_t address = nbytes ? Unsigned(Call(s.ptr(), n.data_ptr)) : 0;
        copies_.push_back({k, static_cast<uintptr_t>(address), nbytes});
      }
    }
    const bool copied = safe_flags_[k] == 0;  // this storage's bytes are copied now
    Ok(PyList_Append(tensors_out_.ptr(), x));
    Ok(PyList_Append(versions_.ptr(), Attr(x, n.version).ptr()));
    which_.push_back(k);
    // The bytes of a copied storage are the ones at save(), its tensors' layout must be too.
    if (copied)
      Ok(PyList_Append(layouts_.ptr(), nb::make_tuple(nb::handle(x), Attr(x, n.shape),
                                                      Call(x, n.stride), Call(x, n.storage_offset))
                                           .ptr()));
  }

  // `x` with every container copied; tensors and immutable values are the same objects.
  // Counts, from above, what `x` adds to the pickled skeleton (kAtomBytes per value and
  // container, kTensorBytes per tensor, and the UTF-8 bytes of strings and bytes objects).
  nb::object Copy(PyObject* x, int depth) {
    PyTypeObject* t = Py_TYPE(x);
    PyObject* type = reinterpret_cast<PyObject*>(t);
    skeleton_bytes_ += kAtomBytes;
    if (type == tensor_ || type == parameter_) {
      if (tensors_.TryEmplace(x, true).second) {
        skeleton_bytes_ += kTensorBytes;
        Tensor(x);
      }
      return nb::borrow(x);
    }
    if (t == &PyUnicode_Type) {  // at most 4 bytes of UTF-8 per code point, 2 for Latin-1
      skeleton_bytes_ += static_cast<uint64_t>(PyUnicode_GET_LENGTH(x)) *
                         (PyUnicode_KIND(x) == PyUnicode_1BYTE_KIND ? 2 : 4);
      return nb::borrow(x);
    }
    if (t == &PyBytes_Type) {
      skeleton_bytes_ += static_cast<uint64_t>(PyBytes_GET_SIZE(x));
      return nb::borrow(x);
    }
    if (t == &PyLong_Type) {  // a large int pickles as its bytes
      int overflow = 0;
      PyLong_AsLongLongAndOverflow(x, &overflow);
      if (overflow != 0) skeleton_bytes_ += (Unsigned(Call(x, N().bit_length)) + 7) / 8;
      return nb::borrow(x);
    }
    if (t == &PyBool_Type || x == Py_None || t == &PyFloat_Type || t == &PyComplex_Type)
      return nb::borrow(x);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(atoms_); ++i)
      if (type == PyTuple_GET_ITEM(atoms_, i)) return nb::borrow(x);
    // An enum member pickles as its class and value (DeepSpeed's ZeroStageEnum, say).
    if (PyType_IsSubtype(t, enum_)) {
      skeleton_bytes_ += kObjectBytes;
      return nb::borrow(x);
    }
    const bool is_dict = t == &PyDict_Type, is_odict = type == ordered_dict_;
    const bool is_list = t == &PyList_Type, is_tuple = t == &PyTuple_Type;
    const bool is_set = t == &PySet_Type || t == &PyFrozenSet_Type;
    const bool is_dict_like = is_dict || is_odict;
    if (depth >= max_depth_) throw NotScannable{};
    if (!(is_dict_like || is_list || is_tuple || is_set) && !Plain(t)) throw NotScannable{};
    if (PyObject* const* known = copies_of_.Find(x)) return nb::borrow(*known);
    if (is_set) return CopySet(x, depth);
    if (!(is_dict_like || is_list || is_tuple)) return CopyObject(x, depth);
    if (is_tuple) {
      // Immutable: shared as it is unless an item is a container that needs its copy.
      const Py_ssize_t size = PyTuple_GET_SIZE(x);
      std::vector<nb::object> items;
      items.reserve(static_cast<size_t>(size));
      bool same = true;
      for (Py_ssize_t i = 0; i < size; ++i) {
        items.push_back(Copy(PyTuple_GET_ITEM(x, i), depth + 1));
        same = same && items.back().ptr() == PyTuple_GET_ITEM(x, i);
      }
      nb::object out = nb::borrow(x);
      if (!same) {
        out = nb::steal(Check(PyTuple_New(size)));
        for (Py_ssize_t i = 0; i < size; ++i)
          PyTuple_SET_ITEM(out.ptr(), i, items[static_cast<size_t>(i)].release().ptr());
      }
      Remember(x, out);
      return out;
    }
    // Lists and dicts are copied whole first (one allocation, no rehashing), then the items
    // that are containers are replaced by their copies, in place.
    if (is_list) {
      nb::object out = nb::steal(Check(PyList_GetSlice(x, 0, PY_SSIZE_T_MAX)));
      Remember(x, out);
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(out.ptr()); ++i) {
        PyObject* item = PyList_GET_ITEM(out.ptr(), i);
        nb::object copied = Copy(item, depth + 1);
        if (copied.ptr() != item) Ok(PyList_SetItem(out.ptr(), i, copied.release().ptr()));
      }
      return out;
    }
    // An OrderedDict's copy keeps its own order; its attributes (a state_dict's
    // `_metadata`) are copied below.
    nb::object out =
        nb::steal(Check(is_dict ? PyDict_Copy(x) : PyObject_CallMethodNoArgs(x, N().copy)));
    Remember(x, out);
    // Keys are hashable, so immutable: kept as they are (scanned, though). Replacing the
    // value of a key while iterating is allowed: the set of keys does not change.
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(out.ptr(), &pos, &key, &value)) {
      nb::object k = nb::borrow(key), v = nb::borrow(value);
      Copy(key, depth + 1);
      nb::object copied = Copy(value, depth + 1);
      if (copied.ptr() != value)
        Ok(is_dict ? PyDict_SetItem(out.ptr(), key, copied.ptr())
                   : PyObject_SetItem(out.ptr(), key, copied.ptr()));
    }
    if (is_dict) return out;
    nb::object attrs = Attr(x, N().dict);
    if (PyDict_Check(attrs.ptr()) && PyDict_GET_SIZE(attrs.ptr()) > 0) {
      nb::object copied = Copy(attrs.ptr(), depth + 1);
      Py_ssize_t at = 0;
      PyObject *name, *attr;
      while (PyDict_Next(copied.ptr(), &at, &name, &attr))
        Ok(PyObject_SetAttr(out.ptr(), name, attr));
    }
    return out;
  }

  // A set is copied, a frozenset kept; their items are hashable, so never containers that
  // are copied (tensors among them are scanned).
  nb::object CopySet(PyObject* x, int depth) {
    nb::object items = nb::steal(Check(PyObject_GetIter(x)));
    while (PyObject* next = PyIter_Next(items.ptr())) {
      nb::object item = nb::steal(next);
      if (Copy(item.ptr(), depth + 1).ptr() != item.ptr()) throw NotScannable{};
    }
    if (PyErr_Occurred()) Check(nullptr);
    nb::object out =
        Py_TYPE(x) == &PySet_Type ? nb::steal(Check(PySet_New(x))) : nb::borrow(x);
    Remember(x, out);
    return out;
  }

  // An instance of a class that pickles as object's default does (see `plain_`): a new
  // instance (`cls.__new__(cls)`) given a copy of the attributes, as unpickling builds it.
  nb::object CopyObject(PyObject* x, int depth) {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(x));
    nb::object attrs = nb::steal(Check(PyObject_GenericGetDict(x, nullptr)));
    if (!PyDict_CheckExact(attrs.ptr())) throw NotScannable{};
    nb::object out = nb::steal(Check(PyObject_CallMethodOneArg(type, N().new_, type)));
    if (out.ptr() == x || Py_TYPE(out.ptr()) != Py_TYPE(x)) throw NotScannable{};  // a singleton
    Remember(x, out);
    skeleton_bytes_ += kObjectBytes;
    nb::object copied = Copy(attrs.ptr(), depth + 1);
    nb::object into = nb::steal(Check(PyObject_GenericGetDict(out.ptr(), nullptr)));
    Ok(PyDict_Update(into.ptr(), copied.ptr()));
    return out;
  }

  // True if instances of `t` pickle as object's default does (asked of `plain_` once per
  // type and scan).
  bool Plain(PyTypeObject* t) {
    PyObject* type = reinterpret_cast<PyObject*>(t);
    if (const bool* known = plain_types_.Find(type)) return *known;
    nb::object answer = nb::steal(Check(PyObject_CallOneArg(plain_, type)));
    const bool plain = answer.ptr() == Py_True;
    plain_types_.TryEmplace(type, plain);
    return plain;
  }

  void Remember(PyObject* x, const nb::object& copy) {
    copies_of_.TryEmplace(x, copy.ptr());
    alive_.push_back(nb::borrow(x));  // its address stays its own until the scan ends
    alive_.push_back(copy);
  }

  PyObject* const tensor_;
  PyObject* const parameter_;
  PyObject* const ordered_dict_;
  PyObject* const atoms_;
  PyTypeObject* const enum_;
  PyObject* const plain_;  // cls -> True if its instances pickle as object's default does
  const SafeStorages& safe_;
  const int max_depth_;
  const uint64_t max_copy_bytes_;
  // What a value or container adds to the skeleton at most, and a tensor besides (its
  // rebuild call: storage key, dtype, shape, strides, offset, requires_grad).
  static constexpr uint64_t kAtomBytes = 24;
  static constexpr uint64_t kTensorBytes = 1024;
  static constexpr uint64_t kObjectBytes = 512;  // a class's module and name, the calls
  uint64_t copy_bytes_ = 0;
  uint64_t storage_bytes_ = 0;   // of every storage met
  uint64_t skeleton_bytes_ = 0;  // the pickled skeleton's size, from above
  uint64_t cuda_devices_ = 0;   // bit i: a safe storage on CUDA device i was met
  // Flat, so that the caller's thread makes few objects per tensor; nebulite._staging
  // builds the maps it needs from them on the staging thread.
  nb::list tensors_out_;          // each tensor met, once
  nb::list versions_;             // its _version
  std::vector<uint32_t> which_;   // its storage: an index in storages_out_
  nb::list storages_out_;         // each storage met, once
  std::string safe_flags_;        // per storage: 1 if safe (copied later), 0 if copied now
  nb::list layouts_;  // [(tensor, shape, stride, offset)] of tensors on copied storages
  PointerMap<uint32_t> index_;  // storage -> its index
  std::vector<Copied> copies_;
  PointerMap<bool> tensors_;  // met already
  PointerMap<PyObject*> copies_of_;  // container -> its copy
  PointerMap<bool> plain_types_;     // type -> Plain()
  std::vector<nb::object> alive_;
};

}  // namespace

void RegisterScan(nb::module_& m) {
  m.def(
      "scan",
      [](nb::handle obj, nb::handle tensor, nb::handle parameter, nb::handle ordered_dict,
         nb::tuple atoms, nb::type_object enum_type, nb::callable plain, nb::handle safe,
         int max_depth, uint64_t max_copy_bytes) {
        return Scanner(tensor, parameter, ordered_dict, atoms, enum_type, plain,
                       SafeStoragesOf(safe), max_depth, max_copy_bytes)
            .Run(obj);
      },
      nb::arg("obj").none(), nb::arg("tensor"), nb::arg("parameter"), nb::arg("ordered_dict"),
      nb::arg("atoms"), nb::arg("enum_type"), nb::arg("plain"), nb::arg("safe"),
      nb::arg("max_depth"), nb::arg("max_copy_bytes"),
      "None if `obj` is not made of dicts, OrderedDicts, lists, tuples, sets, frozensets, "
      "instances of classes for which plain(cls) is True, immutable values (`atoms` and "
      "members of `enum_type` among them) and tensors on the CPU or on storages of a CUDA "
      "device that "
      "`safe` (a SafeStorages) holds, or if the storages outside `safe` hold more than "
      "max_copy_bytes; else (copy of "
      "obj's containers, [each tensor], [its _version], its storage's index as uint32 "
      "bytes, [each storage], per storage b'\\x01' if safe else b'\\x00', bytearray with the "
      "copied storages' bytes, its address, [(storage index, offset in it, nbytes)], bytes "
      "of all the storages, [(tensor, shape, stride, offset)] of the tensors on the copied "
      "storages, a mask of the CUDA devices of the safe storages met: bit i for device i, "
      "the size of the pickled skeleton from above): "
      "see nebulite._staging.scan.");
}

}  // namespace nebulite::python

// nebulite._core.scan: what an asynchronous save does on the caller's thread (see
// nebulite._staging). It records what to copy and nothing more: the containers are copied
// (so that the object pickled later is the one saved), and for each tensor its storage and
// `_version`. Storages an optimizer manages are left to be copied later; the others, which
// forward may change before the next optimizer step, are copied here into one buffer. The
// walk, the pickling and the staging run on the staging thread. Through the CPython API, a
// few attribute reads per tensor; torch is reached only through its Python objects.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "attribute_names.h"
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
          nb::handle safe, int max_depth, uint64_t max_copy_bytes)
      : tensor_(tensor.ptr()),
        parameter_(parameter.ptr()),
        ordered_dict_(ordered_dict.ptr()),
        atoms_(atoms.ptr()),
        safe_(safe.ptr()),
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
    nb::dict at;
    uint64_t offset = 0;
    for (const Copied& c : copies_) {
      if (c.nbytes > 0)
        std::memcpy(base + offset, reinterpret_cast<const void*>(c.address), c.nbytes);
      Ok(PyDict_SetItem(at.ptr(), c.id.ptr(), nb::make_tuple(offset, c.nbytes).ptr()));
      offset += Aligned(c.nbytes);
    }
    return nb::make_tuple(frozen, views_, storages_, deferred_, snapshot,
                          reinterpret_cast<uintptr_t>(base), at, storage_bytes_, layouts_);
  }

 private:
  struct Copied {
    nb::object id;
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
  // True if `ref` (borrowed, may be null) is a weak reference to `target`.
  static bool Refers(PyObject* ref, PyObject* target) {
    if (ref == nullptr) {
      if (PyErr_Occurred()) throw nb::python_error();
      return false;
    }
    if (!PyWeakref_Check(ref)) return false;
#if PY_VERSION_HEX >= 0x030D0000
    PyObject* obj = nullptr;
    if (PyWeakref_GetRef(ref, &obj) < 0) throw nb::python_error();
    Py_XDECREF(obj);  // only compared: `target` keeps it alive if it is the same
    return obj == target;
#else
    return PyWeakref_GET_OBJECT(ref) == target;
#endif
  }
  uint64_t Unsigned(const nb::object& o) {
    const unsigned long long v = PyLong_AsUnsignedLongLong(o.ptr());
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) Check(nullptr);
    return v;
  }

  void Tensor(PyObject* x) {
    const Names& n = N();
    if (Attr(x, n.is_cpu).ptr() != Py_True) throw NotScannable{};  // a device's: its own path
    // Attributes of its own are pickled with it (torch's reduction): not seen here.
    nb::object attrs = Attr(x, n.dict);
    if (!PyDict_Check(attrs.ptr()) || PyDict_GET_SIZE(attrs.ptr()) > 0) throw NotScannable{};
    nb::object s = Call(x, n.untyped_storage);
    nb::object id = nb::steal(Check(PyLong_FromVoidPtr(s.ptr())));
    PyObject* views = PyDict_GetItemWithError(views_.ptr(), id.ptr());
    bool copied;  // this storage's bytes are copied now
    if (views == nullptr) {
      if (PyErr_Occurred()) throw nb::python_error();
      nb::object fresh = nb::steal(Check(PyList_New(0)));
      Ok(PyDict_SetItem(views_.ptr(), id.ptr(), fresh.ptr()));
      Ok(PyDict_SetItem(storages_.ptr(), id.ptr(), s.ptr()));
      views = fresh.ptr();
      // Safe storages are known by identity: an entry of `safe` under the storage's id
      // whose weak reference is to this very storage.
      const bool safe = Refers(PyDict_GetItemWithError(safe_, id.ptr()), s.ptr());
      const uint64_t nbytes = Unsigned(Call(s.ptr(), n.nbytes));
      storage_bytes_ += nbytes;
      copied = !safe;
      if (safe) {
        Ok(PySet_Add(deferred_.ptr(), id.ptr()));
      } else {
        copy_bytes_ += nbytes;
        if (copy_bytes_ > max_copy_bytes_) throw NotScannable{};
        const uint64_t address = nbytes ? Unsigned(Call(s.ptr(), n.data_ptr)) : 0;
        copies_.push_back({id, static_cast<uintptr_t>(address), nbytes});
      }
    } else {
      const int safe = PySet_Contains(deferred_.ptr(), id.ptr());
      if (safe < 0) throw nb::python_error();
      copied = !safe;
    }
    Ok(PyList_Append(views, nb::make_tuple(nb::handle(x), Attr(x, n.version)).ptr()));
    // The bytes of a copied storage are the ones at save(), its tensors' layout must be too.
    if (copied)
      Ok(PyList_Append(layouts_.ptr(), nb::make_tuple(nb::handle(x), Attr(x, n.shape),
                                                      Call(x, n.stride), Call(x, n.storage_offset))
                                           .ptr()));
  }

  // `x` with every container copied; tensors and immutable values are the same objects.
  nb::object Copy(PyObject* x, int depth) {
    PyTypeObject* t = Py_TYPE(x);
    PyObject* type = reinterpret_cast<PyObject*>(t);
    if (type == tensor_ || type == parameter_) {
      if (tensors_.insert(x).second) Tensor(x);
      return nb::borrow(x);
    }
    if (t == &PyUnicode_Type || t == &PyLong_Type || t == &PyBool_Type || x == Py_None ||
        t == &PyBytes_Type || t == &PyFloat_Type || t == &PyComplex_Type)
      return nb::borrow(x);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(atoms_); ++i)
      if (type == PyTuple_GET_ITEM(atoms_, i)) return nb::borrow(x);
    const bool is_dict = t == &PyDict_Type, is_odict = type == ordered_dict_;
    const bool is_list = t == &PyList_Type, is_tuple = t == &PyTuple_Type;
    if (!(is_dict || is_odict || is_list || is_tuple) || depth >= max_depth_) throw NotScannable{};
    auto known = copies_of_.find(x);
    if (known != copies_of_.end()) return nb::borrow(known->second);
    if (is_tuple) {
      const Py_ssize_t size = PyTuple_GET_SIZE(x);
      nb::object out = nb::steal(Check(PyTuple_New(size)));
      for (Py_ssize_t i = 0; i < size; ++i)
        PyTuple_SET_ITEM(out.ptr(), i, Copy(PyTuple_GET_ITEM(x, i), depth + 1).release().ptr());
      Remember(x, out);
      return out;
    }
    if (is_list) {
      nb::object out = nb::steal(Check(PyList_New(0)));
      Remember(x, out);
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(x); ++i) {
        nb::object item = nb::borrow(PyList_GET_ITEM(x, i));
        Ok(PyList_Append(out.ptr(), Copy(item.ptr(), depth + 1).ptr()));
      }
      return out;
    }
    nb::object out = nb::steal(Check(is_dict ? PyDict_New() : PyObject_CallNoArgs(type)));
    Remember(x, out);
    if (is_dict) {
      Py_ssize_t pos = 0;
      PyObject *k, *v;
      while (PyDict_Next(x, &pos, &k, &v)) {
        nb::object key = nb::borrow(k), value = nb::borrow(v);
        Ok(PyDict_SetItem(out.ptr(), Copy(key.ptr(), depth + 1).ptr(),
                          Copy(value.ptr(), depth + 1).ptr()));
      }
      return out;
    }
    // An OrderedDict: its own order, and its attributes (a state_dict's `_metadata`).
    nb::object items = Call(x, N().items);
    for (nb::handle kv : items) {
      nb::object pair = nb::borrow(kv);
      Ok(PyObject_SetItem(out.ptr(), Copy(PyTuple_GET_ITEM(pair.ptr(), 0), depth + 1).ptr(),
                          Copy(PyTuple_GET_ITEM(pair.ptr(), 1), depth + 1).ptr()));
    }
    nb::object attrs = Attr(x, N().dict);
    if (PyDict_Check(attrs.ptr()) && PyDict_GET_SIZE(attrs.ptr()) > 0) {
      nb::object copied = Copy(attrs.ptr(), depth + 1);
      Py_ssize_t pos = 0;
      PyObject *k, *v;
      while (PyDict_Next(copied.ptr(), &pos, &k, &v)) Ok(PyObject_SetAttr(out.ptr(), k, v));
    }
    return out;
  }

  void Remember(PyObject* x, const nb::object& copy) {
    copies_of_.emplace(x, copy.ptr());
    alive_.push_back(nb::borrow(x));  // its address stays its own until the scan ends
    alive_.push_back(copy);
  }

  PyObject* const tensor_;
  PyObject* const parameter_;
  PyObject* const ordered_dict_;
  PyObject* const atoms_;
  PyObject* const safe_;
  const int max_depth_;
  const uint64_t max_copy_bytes_;
  uint64_t copy_bytes_ = 0;
  uint64_t storage_bytes_ = 0;  // of every storage met
  nb::dict views_;     // id(storage) -> [(tensor, _version)]
  nb::dict storages_;  // id(storage) -> storage
  nb::set deferred_;   // id(storage) of the safe ones
  nb::list layouts_;   // [(tensor, shape, stride, offset)] of tensors on copied storages
  std::vector<Copied> copies_;
  std::unordered_set<PyObject*> tensors_;  // met already
  std::unordered_map<PyObject*, PyObject*> copies_of_;
  std::vector<nb::object> alive_;
};

}  // namespace

void RegisterScan(nb::module_& m) {
  m.def(
      "scan",
      [](nb::handle obj, nb::handle tensor, nb::handle parameter, nb::handle ordered_dict,
         nb::tuple atoms, nb::dict safe, int max_depth, uint64_t max_copy_bytes) {
        return Scanner(tensor, parameter, ordered_dict, atoms, safe, max_depth, max_copy_bytes)
            .Run(obj);
      },
      nb::arg("obj").none(), nb::arg("tensor"), nb::arg("parameter"), nb::arg("ordered_dict"),
      nb::arg("atoms"), nb::arg("safe"), nb::arg("max_depth"), nb::arg("max_copy_bytes"),
      "None if `obj` is not made of dicts, OrderedDicts, lists, tuples, immutable values "
      "(`atoms` among them) and plain CPU tensors, or if the storages outside `safe` "
      "({id(storage): weak reference to it}) hold more than max_copy_bytes; else (copy of "
      "obj's containers, {id(storage): [(tensor, _version)]}, {id(storage): storage}, "
      "{id(storage) in safe}, "
      "bytearray with the other storages' bytes, its address, {id(storage): (offset in it, "
      "nbytes)}, bytes of all the storages, [(tensor, shape, stride, offset)] of the tensors "
      "on the copied storages): see "
      "nebulite._staging.scan.");
}

}  // namespace nebulite::python

// Weak references as the registry of safe storages holds them (nebulite._staging): an entry
// under a storage's id counts only if its reference is to that very storage.
#pragma once

#include <nanobind/nanobind.h>

namespace nebulite::python {

// True if `ref` (borrowed, may be null: a failed lookup) is a weak reference to `target`.
inline bool Refers(PyObject* ref, PyObject* target) {
  if (ref == nullptr) {
    if (PyErr_Occurred()) throw nanobind::python_error();
    return false;
  }
  if (!PyWeakref_Check(ref)) return false;
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  if (PyWeakref_GetRef(ref, &obj) < 0) throw nanobind::python_error();
  Py_XDECREF(obj);  // only compared: `target` keeps it alive if it is the same
  return obj == target;
#else
  return PyWeakref_GET_OBJECT(ref) == target;
#endif
}

// True if `safe` ({id(storage): weak reference to it}) holds `storage`.
inline bool Registered(PyObject* safe, PyObject* storage) {
  PyObject* id = PyLong_FromVoidPtr(storage);
  if (id == nullptr) throw nanobind::python_error();
  PyObject* ref = PyDict_GetItemWithError(safe, id);  // borrowed
  Py_DECREF(id);
  return Refers(ref, storage);
}

}  // namespace nebulite::python

// Reading Python objects through the CPython API, a Python error raised as nb::python_error:
// what the walk (walk_binding.cc) and the optimizer pre-hook (safe_storages_binding.cc) read.
#pragma once

#include <nanobind/nanobind.h>

namespace nebulite::python {

// x.name
inline nanobind::object Attr(PyObject* x, PyObject* name) {
  PyObject* r = PyObject_GetAttr(x, name);
  if (r == nullptr) throw nanobind::python_error();
  return nanobind::steal(r);
}

// x.name()
inline nanobind::object Call(PyObject* x, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(x, name);
  if (r == nullptr) throw nanobind::python_error();
  return nanobind::steal(r);
}

// bool(o)
inline bool Truthy(const nanobind::object& o) {
  int t = PyObject_IsTrue(o.ptr());
  if (t < 0) throw nanobind::python_error();
  return t != 0;
}

}  // namespace nebulite::python

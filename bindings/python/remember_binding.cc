// nebulite._core.unregistered_storages: what the optimizer step pre-hook of asynchronous
// staging (nebulite._staging) reads on every step, before the step: the storages of the
// optimizer's parameters and tensor state that the registry of safe storages does not hold
// yet. It runs on every step of a training loop, checkpointing or not, so it runs here,
// through the CPython API, at one attribute read per tensor whose storage is known (the
// storage) and a few for the others; torch is reached only through its Python objects.
#include <nanobind/nanobind.h>

#include "attribute_names.h"
#include "python_calls.h"
#include "status_binding.h"
#include "weak_refs.h"

namespace nb = nanobind;

namespace nebulite::python {
namespace {

class Finder {
 public:
  Finder(nb::handle tensor, nb::handle safe, nb::tuple device_flags)
      : tensor_(tensor.ptr()), safe_(safe.ptr()), device_flags_(std::move(device_flags)) {}

  nb::list Run(nb::handle param_groups, nb::handle state) {
    const Names& n = N();
    ForEach(param_groups.ptr(), [&](PyObject* group) {
      nb::object params = nb::steal(PyObject_GetItem(group, n.params));
      if (!params.is_valid()) throw nb::python_error();
      ForEach(params.ptr(), [&](PyObject* p) { Tensor(p, false); });
    });
    nb::object values = PyDict_Check(state.ptr()) ? nb::borrow(state) : Call(state.ptr(), n.values);
    ForEach(values.ptr(), [&](PyObject* per_param) {
      if (!PyDict_Check(per_param)) return;
      Py_ssize_t pos = 0;
      PyObject *key, *value;
      while (PyDict_Next(per_param, &pos, &key, &value)) Tensor(value, true);
    });
    return out_;
  }

 private:
  // Calls f on each item of an iterable (a dict's values for a dict).
  template <typename F>
  static void ForEach(PyObject* items, F&& f) {
    if (PyDict_Check(items)) {
      Py_ssize_t pos = 0;
      PyObject *key, *value;
      while (PyDict_Next(items, &pos, &key, &value)) {
        nb::object held = nb::borrow(value);
        f(value);
      }
      return;
    }
    if (PyList_CheckExact(items) || PyTuple_CheckExact(items)) {
      for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); ++i) {
        nb::object held = nb::borrow(PySequence_Fast_GET_ITEM(items, i));
        f(held.ptr());
      }
      return;
    }
    nb::object it = nb::steal(PyObject_GetIter(items));
    if (!it.is_valid()) throw nb::python_error();
    while (PyObject* item = PyIter_Next(it.ptr())) {
      nb::object held = nb::steal(item);
      f(item);
    }
    if (PyErr_Occurred()) throw nb::python_error();
  }

  void Tensor(PyObject* x, bool state) {
    const int is_tensor = PyObject_IsInstance(x, tensor_);
    if (is_tensor < 0) throw nb::python_error();
    if (!is_tensor) return;
    const Names& n = N();
    PyObject* s = PyObject_CallMethodNoArgs(x, n.untyped_storage);
    if (s == nullptr) {
      // A tensor without a storage of its own (a sparse one): nothing to defer.
      if (PyErr_ExceptionMatches(PyExc_MemoryError) ||
          PyErr_ExceptionMatches(PyExc_KeyboardInterrupt))
        throw nb::python_error();
      PyErr_Clear();
      return;
    }
    nb::object storage = nb::steal(s);
    if (Registered(safe_, s)) return;  // the common case, from the second step on
    if (!OnDevice(x)) return;
    if (state && !Truthy(Call(x, n.numel))) return;  // an empty tensor
    if (PyList_Append(out_.ptr(), s) != 0) throw nb::python_error();
  }

  // True if one of the device flags (`is_cpu`, ...) of `x` is set.
  bool OnDevice(PyObject* x) {
    for (nb::handle flag : device_flags_)
      if (Attr(x, flag.ptr()).ptr() == Py_True) return true;
    return false;
  }

  PyObject* const tensor_;
  PyObject* const safe_;
  const nb::tuple device_flags_;
  nb::list out_;
};

}  // namespace

void RegisterRemember(nb::module_& m) {
  m.def(
      "unregistered_storages",
      [](nb::handle param_groups, nb::handle state, nb::handle tensor, nb::dict safe,
         nb::tuple device_flags) {
        return Finder(tensor, safe, std::move(device_flags)).Run(param_groups, state);
      },
      nb::arg("param_groups"), nb::arg("state"), nb::arg("tensor"), nb::arg("safe"),
      nb::arg("device_flags"),
      "The storages that `safe` ({id(storage): weak reference to it}) does not hold, of the "
      "tensors (instances of `tensor`) among each group's 'params' in `param_groups` and among "
      "the values of each dict in `state` (a dict of dicts: an optimizer's state), leaving out "
      "tensors without a storage, tensors none of whose `device_flags` (attribute names such "
      "as 'is_cpu') is True, and empty tensors of the state. A storage may come more than "
      "once.");
}

}  // namespace nebulite::python

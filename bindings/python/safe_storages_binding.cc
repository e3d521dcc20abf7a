// nebulite._core.SafeStorages: the registry of safe storages (safe_storages.h) and how it
// learns them: `remember` is what the optimizer step pre-hook of asynchronous staging
// (nebulite._staging) runs on every step, before the step: it registers the storages of the
// optimizer's parameters and tensor state that the registry does not hold yet. It runs on
// every step of a training loop, checkpointing or not, so it runs here, through the CPython
// API, at one attribute read and one lookup per tensor whose storage is known (the storage)
// and a few for the others; torch is reached only through its Python objects.
#include "safe_storages.h"

#include <nanobind/nanobind.h>

#include <utility>

#include "attribute_names.h"
#include "python_calls.h"
#include "status_binding.h"

namespace nb = nanobind;

namespace nebulite::python {

void SafeStorages::Add(PyObject* storage, Where where) {
  if (Find(storage).device != Device::kNone) return;
  std::weak_ptr<Table> table = table_;
  nb::object forget = nb::cpp_function([table, storage](nb::handle ref) {
    std::shared_ptr<Table> t = table.lock();
    if (t == nullptr) return;
    // Unless the entry is another reference's already (the registry was cleared since).
    Entry gone = t->EraseUnless(storage, [&](const Entry& e) { return e.ref != ref.ptr(); });
    Py_XDECREF(gone.ref);
  });
  PyObject* ref = PyWeakref_NewRef(storage, forget.ptr());
  if (ref == nullptr) throw nb::python_error();
  // Making the reference may have run Python (a collection, whose callbacks changed the table;
  // another thread, which may have registered this storage): the first reference stays.
  if (!table_->TryEmplace(storage, Entry{ref, where}).second) Py_DECREF(ref);
}

void SafeStorages::Clear() {
  // Taken out first: a reference's last release runs no callback, but may run Python.
  for (const Entry& e : table_->TakeAll()) Py_DECREF(e.ref);
}

SafeStorages& SafeStoragesOf(nb::handle registry) { return nb::cast<SafeStorages&>(registry); }

namespace {

class Finder {
 public:
  Finder(SafeStorages& safe, nb::handle tensor) : safe_(safe), tensor_(tensor.ptr()) {}

  void Run(nb::handle param_groups, nb::handle state) {
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
      while (PyDict_Next(per_param, &pos, &key, &value)) {
        nb::object held = nb::borrow(value);
        Tensor(value, true);
      }
    });
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
    // Known: the common case, from the second step on.
    if (safe_.Find(s).device != SafeStorages::Device::kNone) return;
    SafeStorages::Where where;
    if (Attr(x, n.is_cpu).ptr() == Py_True) {
      where.device = SafeStorages::Device::kCpu;
    } else if (Attr(x, n.is_cuda).ptr() == Py_True) {
      where.device = SafeStorages::Device::kCuda;
      const long index = PyLong_AsLong(Call(x, n.get_device).ptr());
      if (index == -1 && PyErr_Occurred()) throw nb::python_error();
      where.index = static_cast<int16_t>(index);
    } else {
      return;  // another device's: copied before save() returns
    }
    if (state && !Truthy(Call(x, n.numel))) return;  // an empty tensor
    safe_.Add(s, where);
  }

  SafeStorages& safe_;
  PyObject* const tensor_;
};

}  // namespace

void RegisterSafeStorages(nb::module_& m) {
  nb::class_<SafeStorages>(
      m, "SafeStorages",
      "The storages that asynchronous staging may copy after save() returns (see "
      "nebulite._staging), known by identity: each entry leaves when its storage is freed.")
      .def(nb::init<>())
      .def(
          "remember",
          [](SafeStorages& self, nb::handle param_groups, nb::handle state, nb::handle tensor) {
            Finder(self, tensor).Run(param_groups, state);
          },
          nb::arg("param_groups"), nb::arg("state"), nb::arg("tensor"),
          "Registers the storages not registered yet of the tensors (instances of `tensor`) "
          "among each group's 'params' in `param_groups` and among the values of each dict in "
          "`state` (a dict of dicts: an optimizer's state), leaving out tensors without a "
          "storage, tensors neither on the CPU nor on a CUDA device, and empty tensors of the "
          "state.")
      .def(
          "__contains__",
          [](const SafeStorages& self, nb::handle storage) {
            return self.Find(storage.ptr()).device != SafeStorages::Device::kNone;
          },
          nb::arg("storage").none())
      .def("__len__", &SafeStorages::size)
      .def("clear", &SafeStorages::Clear, "Drops every entry.");
}

}  // namespace nebulite::python

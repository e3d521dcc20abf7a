// nebulite._core.walk: the one walk of a saved object (nebulite._plan documents what it
// finds and why). It is the per-tensor work of a save (on the caller's thread, or on the
// staging thread for an asynchronous save, see scan_binding.cc), so it runs here, through the
// CPython API, at a few attribute reads per tensor; torch is reached only through its Python
// objects, never linked.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attribute_names.h"
#include "pointer_map.h"
#include "python_calls.h"
#include "status_binding.h"

namespace nb = nanobind;

namespace nebulite::python {
namespace {

class Walker {
 public:
  Walker(nb::handle tensor, nb::handle parameter, nb::handle strided, nb::handle ordered_dict,
         int max_depth)
      : tensor_(tensor.ptr()),
        parameter_(parameter.ptr()),
        strided_(strided.ptr()),
        ordered_dict_(ordered_dict.ptr()),
        max_depth_(max_depth) {}

  nb::tuple Run(nb::handle obj) {
    Visit(obj.ptr(), 0);
    nb::object key = keyed_ ? nb::steal(PyList_AsTuple(out_.ptr())) : nb::none();
    if (!key.is_valid()) throw nb::python_error();
    return nb::make_tuple(key, storage_list_, views_);
  }

 private:
  void Put(nb::handle x) {
    if (keyed_ && PyList_Append(out_.ptr(), x.ptr()) != 0) throw nb::python_error();
  }

  // True if `x` was met already: its reference goes into the key.
  bool Again(PyObject* x) {
    auto [at, fresh] = seen_.TryEmplace(x, static_cast<int64_t>(seen_.size()));
    if (!fresh) {
      const int64_t order = *at;
      Put(nb::make_tuple(nb::handle(N().again), order));
      return true;
    }
    alive_.push_back(nb::borrow(x));  // its address stays its own until the walk ends
    return false;
  }

  void VisitTensor(PyObject* x, PyTypeObject* t) {
    if (Again(x)) return;
    const Names& n = N();
    if (Attr(x, n.layout).ptr() != strided_ || Truthy(Attr(x, n.is_meta))) {
      keyed_ = false;
      return;
    }
    nb::object s = Call(x, n.untyped_storage);
    PyObject* found = PyDict_GetItemWithError(storages_.ptr(), s.ptr());
    if (found == nullptr && PyErr_Occurred()) throw nb::python_error();
    int64_t j;
    nb::object views;
    nb::object id = nb::steal(PyLong_FromVoidPtr(s.ptr()));
    if (found == nullptr) {
      j = static_cast<int64_t>(sizes_.size());
      if (PyDict_SetItem(storages_.ptr(), s.ptr(), nb::int_(j).ptr()) != 0)
        throw nb::python_error();
      storage_list_.append(s);
      sizes_.push_back(Call(s.ptr(), n.nbytes));
      views = nb::steal(PyList_New(0));
      if (PyDict_SetItem(views_.ptr(), id.ptr(), views.ptr()) != 0) throw nb::python_error();
    } else {
      j = PyLong_AsLongLong(found);
      PyObject* known = PyDict_GetItemWithError(views_.ptr(), id.ptr());
      if (known == nullptr) {
        if (PyErr_Occurred()) throw nb::python_error();
        throw nb::type_error("a storage compares equal to another one: it has no key");
      }
      views = nb::borrow(known);
    }
    nb::object version = Attr(x, n.version);
    if (PyList_Append(views.ptr(), nb::make_tuple(nb::handle(x), version).ptr()) != 0)
      throw nb::python_error();
    if (!keyed_) return;  // the key is lost already: only storages and views are wanted
    const bool plain = reinterpret_cast<PyObject*>(t) == tensor_ ||
                       reinterpret_cast<PyObject*>(t) == parameter_;
    const bool cpu = plain && Truthy(Attr(x, n.is_cpu));
    if (!plain || !(cpu || Truthy(Attr(x, n.is_cuda))) || Truthy(Attr(x, n.dict)) ||
        Truthy(Attr(x, n.backward_hooks)) || Truthy(Attr(x, n.is_quantized)) ||
        Truthy(Call(x, n.is_conj)) || Truthy(Call(x, n.is_neg))) {
      keyed_ = false;
      return;
    }
    nb::handle type(reinterpret_cast<PyObject*>(t));
    const nb::object& size = sizes_[static_cast<size_t>(j)];
    if (cpu) {
      Put(nb::make_tuple(type, Attr(x, n.dtype), Attr(x, n.shape), Call(x, n.stride),
                         Call(x, n.storage_offset), Attr(x, n.requires_grad), j, size));
    } else {  // a CUDA tensor's key names its device
      Put(nb::make_tuple(type, Attr(x, n.device), Attr(x, n.dtype), Attr(x, n.shape),
                         Call(x, n.stride), Call(x, n.storage_offset), Attr(x, n.requires_grad),
                         j, size));
    }
  }

  void Visit(PyObject* x, int depth) {
    PyTypeObject* t = Py_TYPE(x);
    PyObject* type = reinterpret_cast<PyObject*>(t);
    if (type == tensor_ || type == parameter_) return VisitTensor(x, t);
    if (t == &PyUnicode_Type || t == &PyLong_Type || t == &PyBool_Type || x == Py_None ||
        t == &PyBytes_Type) {
      Put(type);
      Put(x);
      return;
    }
    if (t == &PyFloat_Type) {
      Put(type);
      Put(Call(x, N().hex));  // -0.0 and 0.0 pickle differently; NaN never equals itself
      return;
    }
    const bool is_dict = t == &PyDict_Type, is_odict = type == ordered_dict_;
    if ((is_dict || is_odict || t == &PyList_Type || t == &PyTuple_Type) && depth < max_depth_) {
      if (Again(x)) return;
      Put(type);
      Put(nb::int_(PyObject_Length(x)));
      if (is_dict) {
        // Strong references: a tensor subclass's attributes may run Python code.
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (PyDict_Next(x, &pos, &k, &v)) {
          nb::object key = nb::borrow(k), value = nb::borrow(v);
          Visit(key.ptr(), depth + 1);
          Visit(value.ptr(), depth + 1);
        }
      } else if (is_odict) {  // its own order (move_to_end), which the dict's is not
        nb::object items = Call(x, N().items);
        for (nb::handle kv : items) {
          nb::object pair = nb::borrow(kv);
          Visit(PyTuple_GET_ITEM(pair.ptr(), 0), depth + 1);
          Visit(PyTuple_GET_ITEM(pair.ptr(), 1), depth + 1);
        }
      } else if (t == &PyList_Type) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(x); ++i) {
          nb::object item = nb::borrow(PyList_GET_ITEM(x, i));
          Visit(item.ptr(), depth + 1);
        }
      } else {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(x); ++i)
          Visit(PyTuple_GET_ITEM(x, i), depth + 1);
      }
      return;
    }
    const int sub = PyObject_IsInstance(x, tensor_);
    if (sub < 0) throw nb::python_error();
    if (sub) return VisitTensor(x, t);
    keyed_ = false;  // anything else: its own reduction decides what is pickled
  }

  PyObject* const tensor_;
  PyObject* const parameter_;
  PyObject* const strided_;
  PyObject* const ordered_dict_;
  const int max_depth_;
  bool keyed_ = true;
  nb::list out_;
  nb::dict storages_;  // storage -> its order
  nb::list storage_list_;
  std::vector<nb::object> sizes_;  // of each storage, as ints
  nb::dict views_;                  // id(storage) -> [(tensor, _version)]
  PointerMap<int64_t> seen_;  // object met -> its order
  std::vector<nb::object> alive_;
};

}  // namespace

void RegisterWalk(nb::module_& m) {
  m.def(
      "walk",
      [](nb::handle obj, nb::handle tensor, nb::handle parameter, nb::handle strided,
         nb::handle ordered_dict, int max_depth) {
        return Walker(tensor, parameter, strided, ordered_dict, max_depth).Run(obj);
      },
      nb::arg("obj").none(), nb::arg("tensor"), nb::arg("parameter"), nb::arg("strided"),
      nb::arg("ordered_dict"), nb::arg("max_depth"),
      "(key or None, storages in the order met, {id(storage): [(tensor, _version)]}) of `obj`: "
      "see nebulite._plan.walk.");
}

}  // namespace nebulite::python

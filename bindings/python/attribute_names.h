// The attribute names the extension reads of torch's Python objects (nebulite._core.walk,
// nebulite._core.scan and nebulite._core.SafeStorages.remember), interned once, under the GIL.
#pragma once

#include <Python.h>

namespace nebulite::python {

struct Names {
  PyObject* layout = PyUnicode_InternFromString("layout");
  PyObject* is_meta = PyUnicode_InternFromString("is_meta");
  PyObject* untyped_storage = PyUnicode_InternFromString("untyped_storage");
  PyObject* nbytes = PyUnicode_InternFromString("nbytes");
  PyObject* version = PyUnicode_InternFromString("_version");
  PyObject* is_cpu = PyUnicode_InternFromString("is_cpu");
  PyObject* is_cuda = PyUnicode_InternFromString("is_cuda");
  PyObject* device = PyUnicode_InternFromString("device");
  PyObject* dict = PyUnicode_InternFromString("__dict__");
  PyObject* backward_hooks = PyUnicode_InternFromString("_backward_hooks");
  PyObject* is_quantized = PyUnicode_InternFromString("is_quantized");
  PyObject* is_conj = PyUnicode_InternFromString("is_conj");
  PyObject* is_neg = PyUnicode_InternFromString("is_neg");
  PyObject* dtype = PyUnicode_InternFromString("dtype");
  PyObject* shape = PyUnicode_InternFromString("shape");
  PyObject* stride = PyUnicode_InternFromString("stride");
  PyObject* storage_offset = PyUnicode_InternFromString("storage_offset");
  PyObject* requires_grad = PyUnicode_InternFromString("requires_grad");
  PyObject* hex = PyUnicode_InternFromString("hex");
  PyObject* items = PyUnicode_InternFromString("items");
  PyObject* copy = PyUnicode_InternFromString("copy");
  PyObject* again = PyUnicode_InternFromString("again");
  PyObject* data_ptr = PyUnicode_InternFromString("data_ptr");
  PyObject* params = PyUnicode_InternFromString("params");
  PyObject* values = PyUnicode_InternFromString("values");
  PyObject* numel = PyUnicode_InternFromString("numel");
  PyObject* get_device = PyUnicode_InternFromString("get_device");
  PyObject* bit_length = PyUnicode_InternFromString("bit_length");
  PyObject* new_ = PyUnicode_InternFromString("__new__");
};

inline const Names& N() {
  static const Names* names = new Names();  // never freed: outlives the interpreter's use
  return *names;
}

}  // namespace nebulite::python

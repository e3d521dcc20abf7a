#include "status_binding.h"

#include <nanobind/stl/string.h>

namespace nb = nanobind;

namespace nebulite::python {
namespace {

const char* ExceptionName(StatusCode code) {
  switch (code) {
    case StatusCode::kInvalidArgument:
      return "InvalidArgumentError";
    case StatusCode::kNotFound:
      return "NotFoundError";
    case StatusCode::kCorruption:
      return "CorruptCheckpointError";
    case StatusCode::kNoSpace:
      return "StorageFullError";
    case StatusCode::kResourceExhausted:
      return "MemoryBudgetError";
    case StatusCode::kFailedPrecondition:
      return "FailedPreconditionError";
    case StatusCode::kUnsupportedVersion:
      return "UnsupportedVersionError";
    case StatusCode::kPermissionDenied:
      return "StoragePermissionError";
    case StatusCode::kIOError:
      return "StorageError";
    case StatusCode::kStoreInUse:
      return "StoreInUseError";
    default:
      return "NebuliteError";
  }
}

}  // namespace

void ThrowIfError(const Status& st) {
  if (st.ok()) return;
  nb::object errors = nb::module_::import_("nebulite.errors");
  nb::object cls = errors.attr(ExceptionName(st.code()));
  // Messages may quote untrusted bytes: never let decoding them fail.
  const std::string& msg = st.message();
  nb::object text = nb::steal(
      PyUnicode_DecodeUTF8(msg.data(), static_cast<Py_ssize_t>(msg.size()), "backslashreplace"));
  PyErr_SetObject(cls.ptr(), text.ptr());
  throw nb::python_error();
}

void RegisterStatus(nb::module_& m) {
  m.def("status_code_name",
        [](int code) { return std::string(StatusCodeName(static_cast<StatusCode>(code))); });
}

}  // namespace nebulite::python

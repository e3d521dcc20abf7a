// Object stores from Python: an ObjectClient whose operations call a client of
// nebulite.stores (obstore or google-cloud-storage underneath), and the one place that
// turns a store's root (a path or a URL) into a Storage.
//
// The core calls the client from its own threads: each call takes the GIL for as long as
// it takes to call into Python (the clients release it while bytes move), hands the
// bytes over as memoryviews of the core's memory (no copy), and copies what a get returns
// into the caller's buffer with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "nebulite/object_store.h"
#include "store_open.h"

namespace nb = nanobind;

namespace nebulite::python {
namespace {

// The Status for the Python exception being handled: the client's typed errors map to
// codes, anything else is an IOError with the client's message.
Status FromPython(nb::python_error& e, const std::string& what) {
  std::string message;
  try {
    message = nb::cast<std::string>(nb::str(e.value()));
  } catch (...) {
    message = "unknown error";
  }
  message = what + ": " + message;
  if (e.matches(PyExc_FileNotFoundError)) return Status::NotFound(message);
  if (e.matches(PyExc_FileExistsError)) return Status::AlreadyExists(message);
  if (e.matches(PyExc_PermissionError)) return Status::PermissionDenied(message);
  if (e.matches(PyExc_ValueError)) return Status::InvalidArgument(message);
  return Status::IOError(message);
}

// A read-only memoryview of `p` (the caller keeps the bytes alive during the call).
nb::object View(const ByteSpan& p) {
  static char empty = 0;
  char* data = p.size ? static_cast<char*>(const_cast<void*>(p.data)) : &empty;
  PyObject* mv = PyMemoryView_FromMemory(data, static_cast<Py_ssize_t>(p.size), PyBUF_READ);
  if (mv == nullptr) throw nb::python_error();
  return nb::steal(mv);
}

bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

class PythonObjectClient final : public ObjectClient {
 public:
  explicit PythonObjectClient(nb::object client)
      : client_(std::move(client)), url_(nb::cast<std::string>(client_.attr("url"))) {}

  ~PythonObjectClient() override {
    if (!Py_IsInitialized() || Finalizing()) {
      (void)client_.release();  // the interpreter is going: nothing to give back to
      return;
    }
    nb::gil_scoped_acquire gil;
    client_.reset();
  }

  std::string Describe() const override { return url_; }

  Status Put(const std::string& key, const std::vector<ByteSpan>& data, bool if_absent) override {
    nb::gil_scoped_acquire gil;
    try {
      nb::list views;
      for (const ByteSpan& p : data) views.append(View(p));
      Status st;
      try {
        client_.attr("put")(key, views, if_absent);
      } catch (nb::python_error& e) {
        st = FromPython(e, "writing " + Where(key));
      }
      // The memory is the core's again: a client that kept a view of it is a bug.
      for (nb::handle v : views) v.attr("release")();
      return st;
    } catch (nb::python_error& e) {
      return Status::Internal(FromPython(e, "writing " + Where(key)).message());
    }
  }

  Result<size_t> Get(const std::string& key, uint64_t offset, size_t n, void* dst,
                     const std::string& etag) override {
    nb::gil_scoped_acquire gil;
    try {
      nb::object got = client_.attr("get")(key, offset, n,
                                           etag.empty() ? nb::none() : nb::cast(etag));
      Py_buffer view;
      if (PyObject_GetBuffer(got.ptr(), &view, PyBUF_SIMPLE) != 0) throw nb::python_error();
      const size_t len = static_cast<size_t>(view.len);
      if (len > n) {
        PyBuffer_Release(&view);
        return Status::IOError("reading " + Where(key) + ": the store returned " +
                               std::to_string(len) + " bytes for " + std::to_string(n) +
                               " asked");
      }
      {
        nb::gil_scoped_release release;
        std::memcpy(dst, view.buf, len);
      }
      PyBuffer_Release(&view);
      return len;
    } catch (nb::python_error& e) {
      return FromPython(e, "reading " + Where(key));
    } catch (std::exception& e) {
      return Status::IOError("reading " + Where(key) + ": " + e.what());
    }
  }

  Result<ObjectInfo> Head(const std::string& key) override {
    nb::gil_scoped_acquire gil;
    try {
      nb::tuple t = nb::cast<nb::tuple>(client_.attr("head")(key));
      return ObjectInfo{nb::cast<uint64_t>(t[0]), nb::cast<int64_t>(t[1]),
                        nb::cast<std::string>(t[2])};
    } catch (nb::python_error& e) {
      return FromPython(e, "looking at " + Where(key));
    } catch (std::exception& e) {
      return Status::IOError("looking at " + Where(key) + ": " + e.what());
    }
  }

  Result<ObjectListing> List(const std::string& prefix, bool recursive) override {
    nb::gil_scoped_acquire gil;
    try {
      nb::tuple t = nb::cast<nb::tuple>(client_.attr("list")(prefix, recursive));
      ObjectListing out;
      for (nb::handle o : t[0]) {
        nb::tuple e = nb::cast<nb::tuple>(o);
        out.objects.emplace_back(nb::cast<std::string>(e[0]),
                                 ObjectInfo{nb::cast<uint64_t>(e[1]), nb::cast<int64_t>(e[2]), ""});
      }
      for (nb::handle p : t[1]) out.prefixes.push_back(nb::cast<std::string>(p));
      return out;
    } catch (nb::python_error& e) {
      return FromPython(e, "listing " + Where(prefix));
    } catch (std::exception& e) {
      return Status::IOError("listing " + Where(prefix) + ": " + e.what());
    }
  }

  Status Copy(const std::string& from, const std::string& to) override {
    return Call("copying " + Where(from) + " to '" + to + "'", "copy", from, to);
  }

  Status Delete(const std::string& key) override {
    return Call("deleting " + Where(key), "delete", key);
  }

 private:
  std::string Where(const std::string& key) const { return "'" + key + "' in " + url_; }

  template <typename... Args>
  Status Call(const std::string& what, const char* method, const Args&... args) {
    nb::gil_scoped_acquire gil;
    try {
      client_.attr(method)(args...);
      return Status::OK();
    } catch (nb::python_error& e) {
      return FromPython(e, what);
    }
  }

  nb::object client_;
  const std::string url_;
};

}  // namespace

bool IsStoreUrl(const std::string& root) {
  const size_t colon = root.find("://");
  return colon != std::string::npos && colon > 0 && root.compare(0, colon, "file") != 0;
}

Result<std::shared_ptr<Storage>> OpenStoreAt(const std::string& root,
                                             const PosixOptions& options) {
  if (!IsStoreUrl(root)) {
    NEBULITE_ASSIGN_OR_RETURN(std::unique_ptr<Storage> s, OpenPosixStorage(root, options));
    return std::shared_ptr<Storage>(std::move(s));
  }
  try {
    nb::object client = nb::module_::import_("nebulite.stores").attr("open_client")(root);
    return std::shared_ptr<Storage>(OpenObjectStorage(
        std::make_shared<PythonObjectClient>(std::move(client)), options.read_only));
  } catch (nb::python_error& e) {
    if (e.matches(PyExc_ValueError)) throw;  // a bad URL: the caller's error, as raised
    return FromPython(e, "opening " + root);
  }
}

}  // namespace nebulite::python

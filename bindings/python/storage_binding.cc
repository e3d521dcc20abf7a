// Read-side access to a store: catalog, manifests, data files.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "nebulite/commit.h"
#include "nebulite/copy_engine.h"
#include "nebulite/engine.h"
#include "nebulite/format.h"
#include "nebulite/storage.h"
#include "nebulite/stream_writer.h"
#include "status_binding.h"

namespace nb = nanobind;

namespace nebulite::python {
namespace {

// One open store per root, for the life of the process.
Storage* StoreFor(const std::string& root) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Storage>>* stores =
      new std::map<std::string, std::unique_ptr<Storage>>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = stores->find(root);
  if (it != stores->end()) return it->second.get();
  auto s = OpenPosixStorage(root, /*use_direct_io=*/false);
  ThrowIfError(s.status());
  Storage* p = s->get();
  (*stores)[root] = std::move(s).value();
  return p;
}

nb::dict CommitToDict(const CommitRecord& c) {
  nb::dict d;
  d["tag"] = c.tag;
  d["version"] = c.version;
  d["seq"] = c.seq;
  d["time_unix_ns"] = c.time_unix_ns;
  d["world_size"] = c.world_size;
  return d;
}

}  // namespace

void RegisterStorage(nb::module_& m) {
  m.def("read_catalog", [](const std::string& root) {
    Result<Catalog> c = Status::Internal("unset");
    {
      nb::gil_scoped_release release;
      c = ReadCatalog(StoreFor(root));
    }
    Catalog cat = ValueOrThrow(std::move(c));
    nb::list entries;
    for (const auto& e : cat.entries) entries.append(CommitToDict(e.commit));
    return nb::make_tuple(entries, cat.warnings);
  });

  m.def("read_manifest", [](const std::string& root, const std::string& tag,
                            const std::string& version, uint32_t rank) {
    Manifest mf = ValueOrThrow(ReadManifest(StoreFor(root), tag, version, rank));
    nb::list files;
    for (const auto& f : mf.files) files.append(nb::make_tuple(f.name, f.size, f.crc32));
    nb::dict d;
    d["tag"] = mf.tag;
    d["version"] = mf.version;
    d["rank"] = mf.rank;
    d["world_size"] = mf.world_size;
    d["files"] = files;
    return d;
  });

  m.def("data_file_path",
        [](const std::string& tag, const std::string& version, uint32_t rank,
           const std::string& name) { return DataFilePath(tag, version, rank, name); });
  m.def("validate_component", [](const std::string& c, const std::string& what) {
    ThrowIfError(ValidatePathComponent(c, what.c_str()));
  });

  m.def("verify_data_file", [](const std::string& root, const std::string& path,
                               const std::string& name, uint64_t size, uint32_t crc) {
    Status st;
    {
      nb::gil_scoped_release release;
      st = VerifyDataFile(StoreFor(root), path, ManifestFile{name, size, crc});
    }
    ThrowIfError(st);
  });

  m.def(
      "read_data_file",
      [](const std::string& root, const std::string& path, const std::string& name, uint64_t size,
         uint32_t crc, const std::vector<std::tuple<uint64_t, uint64_t, uintptr_t>>& spans,
         int threads) {
        // Reads a whole data file, each (offset, size, address) span into its buffer (address
        // 0: checksummed only), and verifies its size and CRC in the same pass. Returns the
        // CRC-32 of each span.
        std::vector<FileSpan> v;
        v.reserve(spans.size());
        for (const auto& [offset, n, dst] : spans)
          v.push_back({offset, n, reinterpret_cast<void*>(dst)});
        std::vector<uint32_t> crcs;
        Status st;
        {
          nb::gil_scoped_release release;
          st = ReadDataFile(StoreFor(root), path, ManifestFile{name, size, crc}, v, threads, &crcs);
        }
        ThrowIfError(st);
        return crcs;
      },
      nb::arg("root"), nb::arg("path"), nb::arg("name"), nb::arg("size"), nb::arg("crc"),
      nb::arg("spans"), nb::arg("threads") = 4);

  m.def(
      "stream_object",
      [](const std::string& root, const std::string& tag, const std::string& version, uint32_t rank,
         const std::string& name,
         const std::vector<std::tuple<std::string, uintptr_t, uint64_t, bool>>& records,
         uint64_t window) {
        // Writes a data file too large for the memory budget straight to the store, through
        // a window of `window` bytes of this process's memory.
        std::vector<SourceRecord> src;
        std::vector<format::RecordSpec> specs;
        for (const auto& [n, ptr, size, deferred] : records) {
          src.push_back({n, reinterpret_cast<const void*>(ptr), size, false});
          specs.push_back({n, size});
        }
        auto layout = ValueOrThrow(format::ArchiveLayout::Plan(specs));
        window = std::max<uint64_t>(4096, window / 4096 * 4096);
        Result<ManifestFile> r = Status::Internal("unset");
        {
          nb::gil_scoped_release release;
          void* buf = nullptr;
          if (posix_memalign(&buf, 4096, window) != 0) {
            r = Status::ResourceExhausted("cannot allocate the streaming window");
          } else {
            CopyEngine copy(0);
            r = StreamToFile(StoreFor(root), DataFilePath(tag, version, rank, name), name, layout,
                             src, static_cast<uint8_t*>(buf), window, copy);
            free(buf);
          }
        }
        ManifestFile f = ValueOrThrow(std::move(r));
        return nb::make_tuple(f.size, f.crc32);
      },
      nb::arg("root"), nb::arg("tag"), nb::arg("version"), nb::arg("rank"), nb::arg("name"),
      nb::arg("records"), nb::arg("window") = 64ull << 20);

  m.def("apply_retention", [](const std::string& root, uint32_t keep) {
    return ValueOrThrow(ApplyRetention(StoreFor(root), keep));
  });

  nb::class_<StoredArchive>(m, "StoredArchive")
      .def_static("open",
                  [](const std::string& root, const std::string& path) {
                    Result<std::unique_ptr<StoredArchive>> a = Status::Internal("unset");
                    {
                      nb::gil_scoped_release release;
                      a = StoredArchive::Open(StoreFor(root), path);
                    }
                    return ValueOrThrow(std::move(a));
                  })
      .def("records",
           [](const StoredArchive& a) {
             std::vector<std::tuple<std::string, uint64_t, uint64_t, uint32_t>> out;
             for (const auto& r : a.index().records())
               out.emplace_back(r.name, r.data_offset, r.size, r.crc32);
             return out;
           })
      .def_prop_ro("prefix", [](const StoredArchive& a) { return a.index().prefix(); })
      .def("read",
           [](const StoredArchive& a, const std::string& name) {
             const format::RecordEntry* e = a.index().Find(name);
             if (!e) ThrowIfError(Status::NotFound(a.path() + ": no record '" + name + "'"));
             std::string buf(e->size, '\0');
             Status st;
             {
               nb::gil_scoped_release release;
               st = a.ReadInto(*e, buf.data(), 1);
             }
             ThrowIfError(st);
             return nb::bytes(buf.data(), buf.size());
           })
      .def("read_into",
           [](const StoredArchive& a, const std::string& name, uintptr_t dst, int threads) {
             const format::RecordEntry* e = a.index().Find(name);
             if (!e) ThrowIfError(Status::NotFound(a.path() + ": no record '" + name + "'"));
             Status st;
             {
               nb::gil_scoped_release release;
               st = a.ReadInto(*e, reinterpret_cast<void*>(dst), threads);
             }
             ThrowIfError(st);
           });
}

}  // namespace nebulite::python

// Access to a store from Python: the catalog, manifests and data files (through a
// read-only store, so that a process can read a store it cannot write), and the run locks
// and dead-run clean-up and the writer lease (through a writable one). Every store is opened with
// the GIL held: an error raised while it is released would crash the interpreter.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "nebulite/commit.h"
#include "nebulite/copy_engine.h"
#include "nebulite/data_file_writer.h"
#include "nebulite/engine.h"
#include "nebulite/format.h"
#include "nebulite/lease.h"
#include "nebulite/runs.h"
#include "nebulite/storage.h"
#include "nebulite/stored_archive.h"
#include "status_binding.h"
#include "store_open.h"

namespace nb = nanobind;

namespace nebulite::python {
namespace {

// Modes of the files each root's writable store creates (set_file_mode). Call with the GIL held.
std::map<std::string, uint32_t>& FileModes() {
  static auto* modes = new std::map<std::string, uint32_t>();
  return *modes;
}

// One open store per root, mode and file mode, for the life of the process. Call with the
// GIL held. The store is opened outside the lock: opening an object store calls Python,
// which may let another thread run.
Storage* StoreFor(const std::string& root, bool writable = false) {
  static std::mutex mu;
  using Key = std::tuple<std::string, bool, uint32_t>;
  static auto* stores = new std::map<Key, std::shared_ptr<Storage>>();
  auto mode = FileModes().find(root);
  const uint32_t file_mode = writable && mode != FileModes().end() ? mode->second : 0;
  Key key{root, writable, file_mode};
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = stores->find(key);
    if (it != stores->end()) return it->second.get();
  }
  PosixOptions options;
  options.direct_io = false;
  options.read_only = !writable;
  options.file_mode = file_mode;
  std::shared_ptr<Storage> s = ValueOrThrow(OpenStoreAt(root, options));
  std::lock_guard<std::mutex> lock(mu);
  return stores->emplace(key, std::move(s)).first->second.get();
}

// A run's lock, held until released (or the object is collected).
struct RunLock {
  std::unique_ptr<StoreLock> lock;
};

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
    Storage* store = StoreFor(root);
    Result<Catalog> c = Status::Internal("unset");
    {
      nb::gil_scoped_release release;
      c = ReadCatalog(store);
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
  m.def("commit_marker_path", [](const std::string& tag, const std::string& version) {
    return CommitMarkerPath(tag, version);
  });
  m.def("validate_component", [](const std::string& c, const std::string& what) {
    ThrowIfError(ValidatePathComponent(c, what.c_str()));
  });

  m.def("verify_data_file", [](const std::string& root, const std::string& path,
                               const std::string& name, uint64_t size, uint32_t crc) {
    Storage* store = StoreFor(root);
    Status st;
    {
      nb::gil_scoped_release release;
      st = VerifyDataFile(store, path, ManifestFile{name, size, crc});
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
        Storage* store = StoreFor(root);
        Status st;
        {
          nb::gil_scoped_release release;
          st = ReadDataFile(store, path, ManifestFile{name, size, crc}, v, threads, &crcs);
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
        Storage* store = StoreFor(root, /*writable=*/true);
        Result<ManifestFile> r = Status::Internal("unset");
        {
          nb::gil_scoped_release release;
          void* buf = nullptr;
          if (posix_memalign(&buf, 4096, window) != 0) {
            r = Status::ResourceExhausted("cannot allocate the streaming window");
          } else {
            CopyEngine copy(0);
            DataFileWriter writer(store, &copy);
            r = writer.WriteStreamed({tag, version, rank, name}, layout, src,
                                     static_cast<uint8_t*>(buf), window, copy);
            free(buf);
          }
        }
        ManifestFile f = ValueOrThrow(std::move(r));
        return nb::make_tuple(f.size, f.crc32);
      },
      nb::arg("root"), nb::arg("tag"), nb::arg("version"), nb::arg("rank"), nb::arg("name"),
      nb::arg("records"), nb::arg("window") = 64ull << 20);

  m.def("validate_tag", [](const std::string& tag) { ThrowIfError(ValidateTag(tag)); });
  m.def(
      "set_file_mode",
      [](const std::string& root, uint32_t mode) {
        // What this process creates in `root` from now on gets `mode` (PosixOptions::file_mode).
        ThrowIfError(ValidateFileMode(mode));
        FileModes()[root] = mode;
      },
      nb::arg("root"), nb::arg("mode"));
  m.def(
      "retire_version",
      [](const std::string& root, const std::string& tag, const std::string& version) {
        // Deletes a committed version as retention does (marker first, durably).
        Storage* store = StoreFor(root, /*writable=*/true);
        Status st;
        {
          nb::gil_scoped_release release;
          st = RetireVersion(store, tag, version);
        }
        ThrowIfError(st);
      },
      nb::arg("root"), nb::arg("tag"), nb::arg("version"));
  m.def("newest_claimed_seq", [](const std::string& root) {
    // The newest commit number claimed in the store (0 if none).
    Storage* store = StoreFor(root);
    uint64_t newest = 0;
    Result<std::vector<std::string>> names = Status::Internal("unset");
    {
      nb::gil_scoped_release release;
      names = store->List(".nebulite/seq");
    }
    if (names.ok()) {
      for (const std::string& n : *names) {
        if (n.size() == 20 && n.find_first_not_of("0123456789") == std::string::npos)
          newest = std::max<uint64_t>(newest, std::stoull(n));
      }
    }
    return newest;
  });
  m.def("version_name", [](const std::string& run, uint64_t counter) {
    ThrowIfError(ValidateRunId(run));
    return VersionName(run, counter);
  });
  m.def("parse_version_name", [](const std::string& version) -> nb::object {
    std::string run;
    uint64_t counter;
    if (!ParseVersionName(version, &run, &counter)) return nb::none();
    return nb::make_tuple(run, counter);
  });
  m.def(
      "highest_version_counter",
      [](const std::string& root, const std::string& run, bool committed_only) {
        Storage* store = StoreFor(root);
        Result<uint64_t> r = Status::Internal("unset");
        {
          nb::gil_scoped_release release;
          r = HighestVersionCounter(store, run, committed_only);
        }
        return ValueOrThrow(std::move(r));
      },
      nb::arg("root"), nb::arg("run"), nb::arg("committed_only") = false);

  nb::class_<RunLock>(m, "RunLock")
      .def("release", [](RunLock& l) { l.lock.reset(); })
      .def_prop_ro("held", [](const RunLock& l) { return l.lock != nullptr; });
  m.def(
      "hold_run",
      [](const std::string& root, const std::string& run) {
        // Marks `run` alive in the store while the returned lock is held; None when the
        // run cannot be held right now (a clean-up is deciding about it).
        Storage* store = StoreFor(root, /*writable=*/true);
        auto lock = ValueOrThrow(HoldRun(store, run));
        if (!lock) return nb::object(nb::none());
        auto* out = new RunLock{std::move(lock)};
        return nb::cast(out, nb::rv_policy::take_ownership);
      },
      nb::arg("root"), nb::arg("run"));
  m.def("run_is_alive", [](const std::string& root, const std::string& run) {
    Storage* store = StoreFor(root, /*writable=*/true);
    return ValueOrThrow(RunIsAlive(store, run));
  });
  m.def(
      "remove_dead_runs",
      [](const std::string& root, const std::string& live_run, double grace_seconds, bool dry_run) {
        // Removes uncommitted versions of runs that died (see nebulite/runs.h); with
        // `dry_run`, only says which.
        Storage* store = StoreFor(root, /*writable=*/true);
        Result<CleanupResult> r = Status::Internal("unset");
        {
          nb::gil_scoped_release release;
          int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
          r = RemoveDeadRunsVersions(store, live_run, grace_seconds, now, dry_run);
        }
        CleanupResult c = ValueOrThrow(std::move(r));
        return nb::make_tuple(c.removed, c.warnings);
      },
      nb::arg("root"), nb::arg("live_run"), nb::arg("grace_seconds"), nb::arg("dry_run") = false);

  // Plain reads of a store, for tools that look at it (the command line): names in a
  // directory, whether a path exists, a small file whole, and a file by ranges.
  m.def("list_dir", [](const std::string& root, const std::string& dir) {
    Storage* store = StoreFor(root);
    Result<std::vector<std::string>> names = Status::Internal("unset");
    {
      nb::gil_scoped_release release;
      names = store->List(dir);
    }
    return ValueOrThrow(std::move(names));
  });
  m.def("path_exists", [](const std::string& root, const std::string& path) {
    return ValueOrThrow(StoreFor(root)->Exists(path));
  });
  m.def("read_store_file",
        [](const std::string& root, const std::string& path, uint64_t max_bytes) {
          Storage* store = StoreFor(root);
          Result<std::string> r = Status::Internal("unset");
          {
            nb::gil_scoped_release release;
            r = store->ReadFile(path, max_bytes);
          }
          std::string data = ValueOrThrow(std::move(r));
          return nb::bytes(data.data(), data.size());
        });
  nb::class_<ReadableFile>(m, "StoreFile")
      .def_prop_ro("size", &ReadableFile::size)
      .def("read", [](ReadableFile& f, uint64_t offset, size_t n) {
        std::string buf(n, '\0');
        Result<size_t> got = Status::Internal("unset");
        {
          nb::gil_scoped_release release;
          got = f.ReadAt(offset, n, buf.data());
        }
        buf.resize(ValueOrThrow(std::move(got)));
        return nb::bytes(buf.data(), buf.size());
      });
  m.def("open_store_file", [](const std::string& root, const std::string& path) {
    Storage* store = StoreFor(root);
    Result<std::unique_ptr<ReadableFile>> f = Status::Internal("unset");
    {
      nb::gil_scoped_release release;
      f = store->NewReadableFile(path);
    }
    return ValueOrThrow(std::move(f));
  });

  nb::class_<StoredArchive>(m, "StoredArchive")
      .def_static("open",
                  [](const std::string& root, const std::string& path) {
                    Storage* store = StoreFor(root);
                    Result<std::unique_ptr<StoredArchive>> a = Status::Internal("unset");
                    {
                      nb::gil_scoped_release release;
                      a = StoredArchive::Open(store, path);
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

  // The writer lease (nebulite/lease.h): held by a job's rank 0 while it writes.
  nb::class_<LeaseKeeper>(m, "LeaseKeeper")
      .def("renew",
           [](LeaseKeeper& k) {
             Status st;
             {
               nb::gil_scoped_release release;
               st = k.Renew();
             }
             ThrowIfError(st);
           })
      .def("check", [](LeaseKeeper& k) { ThrowIfError(k.status()); })
      .def("take_warnings", [](LeaseKeeper& k) { return k.TakeWarnings(); })
      .def("release", [](LeaseKeeper& k) {
        nb::gil_scoped_release release;
        k.Release();
      });
  m.def(
      "acquire_lease",
      [](const std::string& root, const std::string& run, const std::string& host, uint32_t pid,
         uint32_t ttl_seconds, double renew_seconds) {
        Storage* store = StoreFor(root, /*writable=*/true);
        Result<std::unique_ptr<LeaseKeeper>> r = Status::Internal("unset");
        {
          nb::gil_scoped_release release;
          r = LeaseKeeper::Acquire(store, Lease{run, host, pid, 0, ttl_seconds}, renew_seconds);
        }
        return ValueOrThrow(std::move(r));
      },
      nb::arg("root"), nb::arg("run"), nb::arg("host"), nb::arg("pid"), nb::arg("ttl_seconds"),
      nb::arg("renew_seconds"));
}

}  // namespace nebulite::python

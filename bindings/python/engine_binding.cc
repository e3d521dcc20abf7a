// Engine, ObjectLease and the in-memory copy helpers.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "nebulite/copy_engine.h"
#include "nebulite/crc32.h"
#include "nebulite/engine.h"
#include "status_binding.h"
#include "store_open.h"

namespace nb = nanobind;

namespace nebulite::python {
namespace {

using RecordArg =
    std::tuple<std::string, uintptr_t, uint64_t, bool>;  // name, address, size, deferred

// The copy pool for loads, one per process: a forked child gets a fresh one, as the
// parent's threads do not exist there (the old pool is left alone, never destroyed).
CopyEngine& LoadCopier() {
  static std::mutex mu;
  static CopyEngine* engine = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (engine == nullptr || owner != getpid()) {
    engine = new CopyEngine(0);
    owner = getpid();
  }
  return *engine;
}

// A wait in seconds as the engine takes it: the engine turns it into a clock duration,
// which a NaN, or more than about 292 years, overflows; a longer wait never ends anyway.
double WaitSeconds(double seconds, const char* what) {
  if (std::isnan(seconds)) ThrowIfError(Status::InvalidArgument(std::string(what) + " is NaN"));
  return std::min(seconds, 1e9);
}

const RecordRef& FindRef(const ObjectLease& lease, const std::string& name) {
  for (const auto& r : lease.records())
    if (r.name == name) return r;
  ThrowIfError(Status::NotFound("record '" + name + "' is not in the object"));
  __builtin_unreachable();
}

nb::dict VersionToDict(const VersionInfo& v) {
  nb::dict d;
  d["tag"] = v.tag;
  d["version"] = v.version;
  d["seq"] = v.seq;
  d["time_unix_ns"] = v.commit_unix_ns;
  d["in_memory"] = v.in_memory;
  d["loadable"] = v.loadable;
  nb::list streamed;
  for (const ManifestFile& f : v.streamed) streamed.append(nb::make_tuple(f.name, f.size, f.crc32));
  d["streamed"] = streamed;
  d["persist_requested"] = v.persist_requested;
  d["persisted"] = v.persisted;
  d["failed"] = v.failed;
  d["store_committed"] = v.store_committed;
  d["names"] = v.names;
  return d;
}

}  // namespace

void RegisterEngine(nb::module_& m) {
  m.def("default_memory_bytes", &DefaultMemoryBytes);

  m.def(
      "copy_bytes",
      [](uintptr_t dst, uintptr_t src, uint64_t n) {
        nb::gil_scoped_release release;
        LoadCopier().Copy({{reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n}});
      },
      "Copies n bytes with every core (GIL released).");

  m.def(
      "stream_copy",
      [](uintptr_t dst, uintptr_t src, uint64_t n) {
        nb::gil_scoped_release release;
        StreamCopy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
      },
      "Copies n bytes on the calling thread with non-temporal stores (GIL released).");

  m.def(
      "copy_many",
      [](const std::vector<std::tuple<uintptr_t, uintptr_t, uint64_t>>& spans, bool crc) {
        std::vector<CopySpan> v;
        v.reserve(spans.size());
        for (const auto& [dst, src, n] : spans)
          v.push_back({reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n});
        std::vector<uint32_t> crcs;
        {
          nb::gil_scoped_release release;
          if (crc) {
            LoadCopier().CopyWithCrc(v, &crcs);
          } else {
            LoadCopier().Copy(v);
          }
        }
        return crcs;
      },
      nb::arg("spans"), nb::arg("crc") = false,
      "Copies many (dst, src, n) spans at once with every core (GIL released); with crc=True "
      "returns each span's CRC-32, computed in the same pass.");

  m.def(
      "crc32",
      [](uintptr_t address, uint64_t n, int threads) {
        nb::gil_scoped_release release;
        return Crc32Parallel(reinterpret_cast<const void*>(address), n, threads);
      },
      nb::arg("address"), nb::arg("n"), nb::arg("threads") = 1,
      "The CRC-32 of n bytes at address, computed by `threads` threads (GIL released): for "
      "bytes that landed by a copy nebulite did not make (a device-to-host DMA).");

  nb::class_<ObjectLease>(m, "ObjectLease")
      .def_prop_ro("address",
                   [](const ObjectLease& l) { return reinterpret_cast<uintptr_t>(l.data()); })
      .def("records",
           [](const ObjectLease& l) {
             std::vector<std::tuple<std::string, uint64_t, uint64_t>> out;
             for (const auto& r : l.records()) out.emplace_back(r.name, r.offset, r.size);
             return out;
           })
      .def("read",
           [](const ObjectLease& l, const std::string& name) {
             const RecordRef& r = FindRef(l, name);
             return nb::bytes(reinterpret_cast<const char*>(l.data() + r.offset), r.size);
           })
      .def("copy_to", [](const ObjectLease& l, const std::string& name, uintptr_t dst) {
        const RecordRef& r = FindRef(l, name);
        nb::gil_scoped_release release;
        LoadCopier().Copy({{reinterpret_cast<void*>(dst), l.data() + r.offset, r.size}});
      });

  nb::class_<Arena>(m, "Arena")
      .def_static(
          "create",
          [](uint64_t capacity, bool prefault, bool shared) {
            Result<std::unique_ptr<Arena>> a = Status::Internal("unset");
            {
              nb::gil_scoped_release release;
              a = Arena::Create(capacity, prefault, shared);
            }
            return std::shared_ptr<Arena>(ValueOrThrow(std::move(a)));
          },
          nb::arg("capacity"), nb::arg("prefault") = false, nb::arg("shared") = true)
      .def_prop_ro("fd", &Arena::fd)
      .def_prop_ro("capacity", &Arena::capacity)
      .def_prop_ro("used", &Arena::used)
      .def_prop_ro("resident", &Arena::resident)
      .def_prop_ro("address", [](const Arena& a) { return reinterpret_cast<uintptr_t>(a.base()); })
      .def("wait_prefaulted", [](Arena& a) {
        nb::gil_scoped_release release;
        a.WaitPrefaulted();
      });

  nb::class_<Engine>(m, "Engine")
      .def_static(
          "open",
          [](const std::string& persist_root, uint32_t rank, uint32_t world_size,
             uint64_t memory_bytes, bool prefault, int copy_threads, int io_threads, bool direct_io,
             uint32_t retention, double commit_timeout, double reserve_timeout, bool write_history,
             std::shared_ptr<Arena> arena, uint32_t file_mode, uintptr_t error_count) {
            EngineOptions o;
            o.persist_root = persist_root;
            o.rank = rank;
            o.world_size = world_size;
            o.memory_bytes = memory_bytes;
            o.prefault = prefault;
            o.copy_threads = copy_threads;
            o.io_threads = io_threads;
            o.direct_io = direct_io;
            o.file_mode = file_mode;
            o.retention = retention;
            o.commit_timeout_seconds = WaitSeconds(commit_timeout, "commit_timeout");
            o.reserve_timeout_seconds = WaitSeconds(reserve_timeout, "reserve_timeout");
            o.write_history = write_history;
            o.arena = std::move(arena);
            o.error_count = reinterpret_cast<uint64_t*>(error_count);
            if (IsStoreUrl(persist_root)) {
              o.storage_override = ValueOrThrow(OpenStoreAt(persist_root, PosixOptions{}));
            }
            Result<std::unique_ptr<Engine>> e = Status::Internal("unset");
            {
              nb::gil_scoped_release release;
              e = Engine::Open(o);
            }
            return ValueOrThrow(std::move(e));
          },
          nb::arg("persist_root"), nb::arg("rank") = 0, nb::arg("world_size") = 1,
          nb::arg("memory_bytes") = 0, nb::arg("prefault") = false, nb::arg("copy_threads") = 0,
          nb::arg("io_threads") = 0, nb::arg("direct_io") = true, nb::arg("retention") = 0,
          nb::arg("commit_timeout") = 600.0, nb::arg("reserve_timeout") = 600.0,
          nb::arg("write_history") = true, nb::arg("arena") = nb::none(), nb::arg("file_mode") = 0,
          nb::arg("error_count") = 0,
          "error_count: the address of an 8-byte counter to which the engine adds 1 for "
          "each error it reports (see EngineOptions::error_count); 0 for none")
      .def(
          "stage",
          [](Engine& e, const std::string& tag, const std::string& version, const std::string& name,
             const std::vector<RecordArg>& records, bool persist_now) {
            std::vector<SourceRecord> src;
            src.reserve(records.size());
            for (const auto& [n, ptr, size, deferred] : records)
              src.push_back({n, reinterpret_cast<const void*>(ptr), size, deferred});
            Result<StageInfo> r = Status::Internal("unset");
            {
              nb::gil_scoped_release release;
              r = e.Stage(tag, version, name, src, persist_now);
            }
            StageInfo info = ValueOrThrow(std::move(r));
            return std::make_tuple(info.bytes, info.blocking_seconds, info.streamed, info.deferred);
          },
          nb::arg("tag"), nb::arg("version"), nb::arg("name"), nb::arg("records"),
          nb::arg("persist_now") = false)
      .def(
          "reserve",
          [](Engine& e, const std::string& tag, const std::string& version, const std::string& name,
             const std::vector<std::tuple<std::string, uint64_t>>& records, bool wait) {
            std::vector<format::RecordSpec> specs;
            for (const auto& [n, size] : records) specs.push_back({n, size});
            Result<Reservation> r = Status::Internal("unset");
            {
              nb::gil_scoped_release release;
              r = e.Reserve(tag, version, name, specs, wait);
            }
            Reservation res = ValueOrThrow(std::move(r));
            std::vector<std::tuple<std::string, uint64_t, uint64_t>> out;
            for (const auto& ref : res.records) out.emplace_back(ref.name, ref.offset, ref.size);
            return std::make_tuple(res.arena_offset, res.bytes, out);
          },
          nb::arg("tag"), nb::arg("version"), nb::arg("name"), nb::arg("records"),
          nb::arg("wait") = true)
      .def("seal",
           [](Engine& e, const std::string& tag, const std::string& version,
              const std::string& name, bool persist_now, const std::vector<uint32_t>& crcs) {
             ThrowIfError(e.Seal(tag, version, name, persist_now, crcs));
           })
      .def("rename_version",
           [](Engine& e, const std::string& tag, const std::string& from, const std::string& to) {
             Status st;
             {
               nb::gil_scoped_release release;
               st = e.RenameVersion(tag, from, to);
             }
             ThrowIfError(st);
           })
      .def("discard", [](Engine& e, const std::string& tag, const std::string& version,
                         const std::string& name) { ThrowIfError(e.Discard(tag, version, name)); })
      .def("adopt",
           [](Engine& e, const std::string& tag, const std::string& version,
              const std::string& name, uint64_t size, uint32_t crc) {
             Status st;
             {
               nb::gil_scoped_release release;
               st = e.Adopt(tag, version, ManifestFile{name, size, crc});
             }
             ThrowIfError(st);
           })
      .def("must_persist", &Engine::MustPersist)
      .def("wait_staged",
           [](Engine& e) {
             nb::gil_scoped_release release;
             e.WaitStaged();
           })
      .def("commit",
           [](Engine& e, const std::string& tag, const std::string& version, uint64_t seq,
              bool persist) {
             Status st;
             {
               nb::gil_scoped_release release;
               st = e.Commit(tag, version, seq, persist);
             }
             ThrowIfError(st);
           })
      .def("persist", [](Engine& e, const std::string& tag,
                         const std::string& version) { ThrowIfError(e.Persist(tag, version)); })
      .def("flush",
           [](Engine& e, double timeout) {
             timeout = WaitSeconds(timeout, "timeout");
             Status st;
             {
               nb::gil_scoped_release release;
               st = e.Flush(timeout);
             }
             ThrowIfError(st);
           })
      .def("flush_version",
           [](Engine& e, const std::string& tag, const std::string& version, double timeout) {
             timeout = WaitSeconds(timeout, "timeout");
             Status st;
             {
               nb::gil_scoped_release release;
               st = e.FlushVersion(tag, version, timeout);
             }
             ThrowIfError(st);
           })
      .def("abandon",
           [](Engine& e, const std::string& tag, const std::string& version) {
             nb::gil_scoped_release release;
             e.Abandon(tag, version);
           })
      .def("give_up_commit",
           [](Engine& e, const std::string& tag, const std::string& version) {
             Result<bool> r = Status::Internal("unset");
             {
               nb::gil_scoped_release release;
               r = e.GiveUpCommit(tag, version);
             }
             return ValueOrThrow(std::move(r));
           })
      .def("newest_seq", &Engine::NewestSeq)
      .def("versions",
           [](Engine& e) {
             nb::list out;
             for (const auto& v : e.Versions()) out.append(VersionToDict(v));
             return out;
           })
      .def("pin",
           [](Engine& e, const std::string& tag, const std::string& version,
              const std::string& name) {
             // Pin() waits for a deferred copy still landing: other threads must run meanwhile.
             Result<std::shared_ptr<ObjectLease>> r = Status::Internal("unset");
             {
               nb::gil_scoped_release release;
               r = e.Pin(tag, version, name);
             }
             return ValueOrThrow(std::move(r));
           })
      .def("take_errors",
           [](Engine& e) {
             std::vector<std::tuple<std::string, std::string>> out;
             for (const auto& s : e.TakeErrors())
               out.emplace_back(StatusCodeName(s.code()), s.message());
             return out;
           })
      .def("history",
           [](Engine& e) {
             nb::list out;
             for (const auto& r : e.History()) {
               nb::dict d;
               d["tag"] = r.tag;
               d["version"] = r.version;
               d["name"] = r.name;
               d["rank"] = r.rank;
               d["bytes"] = r.bytes;
               d["blocking_seconds"] = r.blocking_seconds;
               d["persist_seconds"] = r.persist_seconds;
               d["tier"] = r.tier;
               d["outcome"] = r.outcome;
               d["time_unix_ns"] = r.time_unix_ns;
               out.append(d);
             }
             return out;
           })
      .def_prop_ro("memory_capacity", &Engine::memory_capacity)
      .def_prop_ro("arena_address",
                   [](const Engine& e) { return reinterpret_cast<uintptr_t>(e.arena().base()); })
      .def_prop_ro("memory_used", &Engine::memory_used)
      .def_prop_ro("memory_resident", &Engine::memory_resident)
      .def_prop_ro("memory_reclaimable",
                   [](const Engine& e) {
                     nb::gil_scoped_release release;  // it takes the engine's lock
                     return e.memory_reclaimable();
                   })
      .def("wait_prefaulted",
           [](Engine& e) {
             nb::gil_scoped_release release;
             e.WaitPrefaulted();
           })
      .def("close", [](Engine& e, double timeout) {
        timeout = WaitSeconds(timeout, "timeout");
        Status st;
        {
          nb::gil_scoped_release release;
          st = e.Close(timeout);
        }
        ThrowIfError(st);
      });
}

}  // namespace nebulite::python

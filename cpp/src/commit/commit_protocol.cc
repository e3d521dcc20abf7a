// The commit protocol: where each piece of a version lives, and the order in which
// the pieces become durable (docs/format.md is normative).
//
//   1. each rank: data files written under TempDataFilePath(), Sync()ed and renamed to
//      DataFilePath() (the caller): a file at its final name is always complete;
//   2. each rank: WriteManifest(): SyncDir of the rank directory (the data files'
//      entries), the version directory, the tag directory and the root (the
//      directories' own entries), then the manifest via WriteFileAtomic (temp, fsync,
//      rename, fsync directory);
//   3. the coordinator: WriteCommitMarker() once every manifest is present: it reads
//      and checks them all, checks that every file they name exists with its size,
//      records their CRCs, and writes COMMITTED the same way, last, under a sequence
//      number claimed right before (ClaimCommitSeq). The coordinator's own manifest is
//      checked from its memory, not read back (its files were complete before it).
// A crash before step 3 completes leaves no marker, so the version stays invisible.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "nebulite/commit.h"
#include "nebulite/crc32.h"

namespace nebulite {
namespace {

constexpr uint64_t kVerifyChunkBytes = 8ull << 20;
constexpr uint64_t kReadPieceBytes = 16ull << 20;  // unit of work of ReadDataFile
constexpr char kSeqDir[] = ".nebulite/seq";

Status ValidateIds(const std::string& tag, const std::string& version) {
  NEBULITE_RETURN_IF_ERROR(ValidateTag(tag));
  return ValidateVersionName(version);
}

Status ValidateStoreName(const std::string& name, const char* what) {
  NEBULITE_RETURN_IF_ERROR(ValidatePathComponent(name, what));
  if (name[0] == '.') {
    return Status::InvalidArgument(std::string(what) + " '" + name +
                                   "' starts with '.': such names are reserved for the "
                                   "store's own files");
  }
  return Status::OK();
}

// "%020llu": claims sort by name in numeric order.
std::string SeqName(uint64_t seq) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%020llu", static_cast<unsigned long long>(seq));
  return buf;
}

bool ParseSeqName(const std::string& name, uint64_t* seq) {
  if (name.size() != 20) return false;
  uint64_t v = 0;
  for (char c : name) {
    if (c < '0' || c > '9') return false;
    if (v > (UINT64_MAX - 9) / 10) return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  *seq = v;
  return true;
}

// The unit of work of ReadDataFile for a file of `size` bytes read by `threads` threads:
// kReadPieceBytes. On an object store each piece is a request, and a load has made two
// more to open the file (its index at the end, its headers at the start, through the
// small-read blocks): a file of 8 pieces or more is read in the largest multiple of
// `threads` pieces that is at least two fewer, a little larger. The load then makes no
// more requests than a direct ranged read of the same payload, and every thread reads as
// many bytes as every other (a last wave of fewer pieces would leave threads idle, which
// costs a bandwidth-bound store what it saves a request-bound one).
uint64_t ReadPieceBytes(const Storage& storage, uint64_t size, int threads) {
  const uint64_t whole = size / kReadPieceBytes;
  const uint64_t t = static_cast<uint64_t>(std::max(1, threads));
  if (!storage.is_object_store() || whole < 8 || whole - 2 < t) return kReadPieceBytes;
  const uint64_t count = (whole - 2) / t * t;
  const uint64_t bytes = (size + count - 1) / count;
  return (bytes + 4095) / 4096 * 4096;
}

// Checks that every file `m` names exists as a regular file of its size.
Status CheckFilesExist(Storage* storage, const Manifest& m) {
  for (const ManifestFile& f : m.files) {
    NEBULITE_RETURN_IF_ERROR(
        CheckDataFilePresent(storage, DataFilePath(m.tag, m.version, m.rank, f.name), f).status());
  }
  return Status::OK();
}

}  // namespace

Result<FileInfo> CheckDataFilePresent(Storage* storage, const std::string& path,
                                      const ManifestFile& f) {
  Result<FileInfo> info = storage->StatFile(path);
  if (!info.ok()) {
    if (info.status().code() == StatusCode::kNotFound) {
      return Status::Corruption("data file '" + path + "' is missing");
    }
    return info.status();
  }
  if (info->type != FileType::kFile) {
    return Status::Corruption("data file '" + path + "' is not a regular file");
  }
  if (info->size != f.size) {
    return Status::Corruption("data file '" + path + "' has " + std::to_string(info->size) +
                              " bytes, its manifest says " + std::to_string(f.size));
  }
  return info;
}

Status ValidateTag(const std::string& tag) {
  NEBULITE_RETURN_IF_ERROR(ValidateStoreName(tag, "tag"));
  if (tag == kHistoryFile) {
    return Status::InvalidArgument("tag '" + tag + "' is the name of the store's history file");
  }
  return Status::OK();
}
Status ValidateVersionName(const std::string& version) {
  return ValidateStoreName(version, "version");
}

std::string RankDir(const std::string& tag, const std::string& version, uint32_t rank) {
  return VersionDir(tag, version) + "/rank" + std::to_string(rank);
}

std::string TempDataFilePath(const std::string& tag, const std::string& version, uint32_t rank,
                             const std::string& name) {
  // Unique per name, and a valid path component even for a 255-byte name.
  char crc[16];
  std::snprintf(crc, sizeof(crc), "%08x", Crc32(0, name.data(), name.size()));
  return RankDir(tag, version, rank) + "/." + name.substr(0, 180) + "." + crc + ".partial";
}

std::string VersionDir(const std::string& tag, const std::string& version) {
  return tag + "/" + version;
}

std::string DataFilePath(const std::string& tag, const std::string& version, uint32_t rank,
                         const std::string& name) {
  return RankDir(tag, version, rank) + "/" + name;
}

std::string ManifestPath(const std::string& tag, const std::string& version, uint32_t rank) {
  return VersionDir(tag, version) + "/rank" + std::to_string(rank) + ".manifest";
}

std::string CommitMarkerPath(const std::string& tag, const std::string& version) {
  return VersionDir(tag, version) + "/COMMITTED";
}

Status WriteManifest(Storage* storage, const Manifest& m) {
  NEBULITE_RETURN_IF_ERROR(ValidateIds(m.tag, m.version));
  if (m.world_size == 0 || m.rank >= m.world_size) {
    return Status::InvalidArgument("manifest rank " + std::to_string(m.rank) +
                                   " is not below world_size " + std::to_string(m.world_size));
  }
  for (const ManifestFile& f : m.files) {
    NEBULITE_RETURN_IF_ERROR(ValidatePathComponent(f.name, "file name"));
  }
  // Make every directory entry on the way to the data files durable before the manifest
  // that names them exists. A rank without files still gets its (empty) directory.
  const std::string rank_dir = RankDir(m.tag, m.version, m.rank);
  NEBULITE_RETURN_IF_ERROR(storage->CreateDirs(rank_dir));
  NEBULITE_RETURN_IF_ERROR(storage->SyncDir(rank_dir));
  NEBULITE_RETURN_IF_ERROR(storage->SyncDir(VersionDir(m.tag, m.version)));
  NEBULITE_RETURN_IF_ERROR(storage->SyncDir(m.tag));
  NEBULITE_RETURN_IF_ERROR(storage->SyncDir(""));
  return storage->WriteFileAtomic(ManifestPath(m.tag, m.version, m.rank), EncodeManifest(m));
}

Result<Manifest> ReadManifest(Storage* storage, const std::string& tag, const std::string& version,
                              uint32_t rank) {
  NEBULITE_RETURN_IF_ERROR(ValidateIds(tag, version));
  const std::string path = ManifestPath(tag, version, rank);
  Result<std::string> text = storage->ReadFile(path, kMaxManifestBytes);
  if (!text.ok() && text.status().code() == StatusCode::kInvalidArgument) {
    // A directory, a FIFO or a device where the manifest should be: the version is damaged.
    return Status::Corruption(text.status().message());
  }
  if (!text.ok()) return text.status();
  Result<Manifest> m = DecodeManifest(*text);
  if (!m.ok()) return m.status().WithContext(path);
  if (m->tag != tag || m->version != version || m->rank != rank) {
    return Status::Corruption(path + ": manifest is for tag '" + m->tag + "' version '" +
                              m->version + "' rank " + std::to_string(m->rank));
  }
  return m;
}

Result<bool> AllManifestsPresent(Storage* storage, const std::string& tag,
                                 const std::string& version, uint32_t world_size) {
  NEBULITE_RETURN_IF_ERROR(ValidateIds(tag, version));
  for (uint32_t r = 0; r < world_size; ++r) {
    NEBULITE_ASSIGN_OR_RETURN(bool exists, storage->FileExists(ManifestPath(tag, version, r)));
    if (!exists) return false;
  }
  return true;
}

namespace {

// The highest claim in `names` (false if there is none).
bool NewestClaim(const std::vector<std::string>& names, uint64_t* newest) {
  bool any = false;
  for (const std::string& n : names) {
    uint64_t v;
    if (ParseSeqName(n, &v)) {
      *newest = any ? std::max(*newest, v) : v;
      any = true;
    }
  }
  return any;
}

}  // namespace

// A claim is an exclusive create of .nebulite/seq/<n>. Claims older than the newest are
// deleted, so a claimant whose listing was stale could create a number used before; but the
// newest claim is never deleted and a deleted one is always below it, so such a claimant sees
// a higher claim when it lists again after creating its own, and claims again above it.
Result<uint64_t> ClaimCommitSeq(Storage* storage, uint64_t at_least) {
  NEBULITE_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->List(kSeqDir));
  uint64_t newest = 0;
  if (!NewestClaim(names, &newest)) {  // a store written before claims existed
    NEBULITE_ASSIGN_OR_RETURN(Catalog catalog, ReadCatalog(storage));
    for (const CatalogEntry& e : catalog.entries) newest = std::max(newest, e.commit.seq);
  }
  uint64_t seq = std::max(newest + 1, std::max<uint64_t>(at_least, 1));
  for (int attempt = 0;; ++attempt) {
    if (attempt == 1000) {
      return Status::IOError("could not claim a commit number in " + std::to_string(attempt) +
                             " attempts (too many writers at once?)");
    }
    Status st = storage->CreateFileExclusive(JoinPath(kSeqDir, SeqName(seq)), "");
    if (!st.ok() && st.code() != StatusCode::kAlreadyExists) {
      return st.WithContext("claiming commit number " + std::to_string(seq));
    }
    NEBULITE_ASSIGN_OR_RETURN(names, storage->List(kSeqDir));
    uint64_t highest = 0;
    NewestClaim(names, &highest);
    if (st.ok() && highest <= seq) break;  // ours, and the newest
    seq = std::max(seq, highest) + 1;
  }
  // Only the newest claim matters; older ones go (best effort: another writer may be
  // removing them too).
  for (const std::string& n : names) {
    uint64_t v;
    if (ParseSeqName(n, &v) && v < seq) (void)storage->Delete(JoinPath(kSeqDir, n));
  }
  return seq;
}

Status WriteCommitMarker(Storage* storage, const CommitRecord& c,
                         const std::map<uint32_t, std::string>& written) {
  NEBULITE_RETURN_IF_ERROR(ValidateIds(c.tag, c.version));
  if (c.world_size == 0) return Status::InvalidArgument("commit world_size must be at least 1");
  if (!c.manifest_crc32.empty() && c.manifest_crc32.size() != c.world_size) {
    return Status::InvalidArgument(
        "commit record lists " + std::to_string(c.manifest_crc32.size()) +
        " manifest checksums for world_size " + std::to_string(c.world_size));
  }
  CommitRecord record = c;
  record.manifest_crc32.clear();
  for (uint32_t r = 0; r < c.world_size; ++r) {
    const std::string path = ManifestPath(c.tag, c.version, r);
    const auto mine = written.find(r);
    Result<std::string> text =
        mine != written.end() ? mine->second : storage->ReadFile(path, kMaxManifestBytes);
    if (!text.ok()) {
      if (text.status().code() == StatusCode::kNotFound) {
        return Status::FailedPrecondition("cannot commit: manifest '" + path + "' is missing");
      }
      return text.status().WithContext("cannot commit");
    }
    Result<Manifest> m = DecodeManifest(*text);
    if (!m.ok()) return m.status().WithContext("cannot commit: " + path);
    if (m->tag != c.tag || m->version != c.version || m->rank != r ||
        m->world_size != c.world_size) {
      return Status::Corruption("cannot commit: " + path + " is for tag '" + m->tag +
                                "' version '" + m->version + "' rank " + std::to_string(m->rank) +
                                " of world_size " + std::to_string(m->world_size));
    }
    const uint32_t crc = Crc32(0, text->data(), text->size());
    if (!c.manifest_crc32.empty() && c.manifest_crc32[r] != crc) {
      return Status::Corruption("cannot commit: " + path +
                                " does not match the checksum the coordinator expects");
    }
    // A marker must never vouch for a file that is not there.
    if (mine == written.end()) {
      NEBULITE_RETURN_IF_ERROR(CheckFilesExist(storage, *m).WithContext("cannot commit"));
    }
    record.manifest_crc32.push_back(crc);
  }
  const std::string marker = CommitMarkerPath(c.tag, c.version);
  const std::string encoded = EncodeCommitRecord(record);
  if (!storage->is_object_store()) return storage->WriteFileAtomic(marker, encoded);
  // On an object store the marker is a create-only put (If-None-Match: *), so that a marker,
  // once written, is never replaced. One that exists already with these very bytes is this
  // write's own, answered after a retry of a put that had succeeded.
  Status created = storage->CreateFileExclusive(marker, encoded);
  if (created.code() != StatusCode::kAlreadyExists) return created;
  Result<std::string> existing = storage->ReadFile(marker, encoded.size() + 1);
  if (existing.ok() && *existing == encoded) return Status::OK();
  return Status::AlreadyExists("cannot commit: '" + marker +
                               "' exists already and was not written by this commit");
}

namespace {

// Opens a data file for a check against its manifest entry: Corruption if it is missing,
// not a regular file, or not of the manifest's size.
Result<std::unique_ptr<ReadableFile>> OpenDataFile(Storage* storage, const std::string& path,
                                                   const ManifestFile& f) {
  Result<std::unique_ptr<ReadableFile>> file = storage->NewReadableFile(path);
  if (!file.ok()) {
    if (file.status().code() == StatusCode::kNotFound) {
      return Status::Corruption("data file '" + path + "' is missing");
    }
    if (file.status().code() == StatusCode::kInvalidArgument) {
      return Status::Corruption("data file '" + path + "': " + file.status().message());
    }
    return file.status();
  }
  if ((*file)->size() != f.size) {
    return Status::Corruption("data file '" + path + "' has " + std::to_string((*file)->size()) +
                              " bytes, its manifest says " + std::to_string(f.size));
  }
  return file;
}

}  // namespace

Status VerifyDataFile(Storage* storage, const std::string& path, const ManifestFile& f) {
  NEBULITE_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenDataFile(storage, path, f));
  std::string buffer(static_cast<size_t>(std::min<uint64_t>(f.size, kVerifyChunkBytes)), '\0');
  uint32_t crc = 0;
  uint64_t offset = 0;
  while (offset < f.size) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(f.size - offset, buffer.size()));
    NEBULITE_ASSIGN_OR_RETURN(size_t got, file->ReadAt(offset, want, buffer.data()));
    if (got != want) {
      return Status::Corruption("data file '" + path + "' shrank while being verified");
    }
    crc = Crc32(crc, buffer.data(), got);
    offset += got;
  }
  if (crc != f.crc32) {
    return Status::Corruption("data file '" + path + "' fails its CRC-32 check");
  }
  return Status::OK();
}

Status ReadDataFile(Storage* storage, const std::string& path, const ManifestFile& f,
                    const std::vector<FileSpan>& spans, int threads,
                    std::vector<uint32_t>* span_crcs) {
  uint64_t expect = 0;
  for (const FileSpan& s : spans) {
    if (s.offset != expect) {
      return Status::InvalidArgument("spans of '" + path + "' do not tile it: a span starts at " +
                                     std::to_string(s.offset) + ", expected " +
                                     std::to_string(expect));
    }
    expect += s.size;
  }
  if (expect != f.size) {
    return Status::InvalidArgument("spans of '" + path + "' cover " + std::to_string(expect) +
                                   " bytes, its manifest says " + std::to_string(f.size));
  }
  NEBULITE_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, OpenDataFile(storage, path, f));
  // Units of work of at most `piece` bytes, in file order.
  const uint64_t piece = ReadPieceBytes(*storage, f.size, threads);
  std::vector<FileSpan> pieces;
  std::vector<size_t> span_of;  // the span each piece belongs to
  for (size_t k = 0; k < spans.size(); ++k) {
    const FileSpan& s = spans[k];
    for (uint64_t off = 0; off < s.size; off += piece) {
      uint64_t n = std::min(piece, s.size - off);
      pieces.push_back({s.offset + off, n, s.dst ? static_cast<uint8_t*>(s.dst) + off : nullptr});
      span_of.push_back(k);
    }
  }
  std::vector<uint32_t> crcs(pieces.size(), 0);
  std::vector<Status> status(pieces.size());
  auto work = [&](size_t i) {
    const FileSpan& p = pieces[i];
    std::string scratch;
    void* dst = p.dst;
    if (dst == nullptr) {
      scratch.resize(p.size);
      dst = scratch.data();
    }
    Result<size_t> got = file->ReadAt(p.offset, p.size, dst);
    if (!got.ok()) {
      status[i] = got.status();
    } else if (*got != p.size) {
      status[i] = Status::Corruption("data file '" + path + "' shrank while being read");
    } else {
      crcs[i] = Crc32(0, dst, p.size);
    }
  };
  const int t = std::max(1, std::min<int>(threads, static_cast<int>(pieces.size())));
  if (t == 1) {
    for (size_t i = 0; i < pieces.size(); ++i) work(i);
  } else {
    std::vector<std::thread> pool;
    std::atomic<size_t> next{0};
    for (int k = 0; k < t; ++k)
      pool.emplace_back([&] {
        for (size_t i; (i = next.fetch_add(1)) < pieces.size();) work(i);
      });
    for (auto& th : pool) th.join();
  }
  uint32_t crc = 0;
  if (span_crcs) span_crcs->assign(spans.size(), 0);
  for (size_t i = 0; i < pieces.size(); ++i) {
    NEBULITE_RETURN_IF_ERROR(status[i]);
    crc = Crc32Combine(crc, crcs[i], pieces[i].size);
    if (span_crcs) {
      uint32_t& c = (*span_crcs)[span_of[i]];
      c = Crc32Combine(c, crcs[i], pieces[i].size);
    }
  }
  if (crc != f.crc32) {
    return Status::Corruption("data file '" + path + "' fails its CRC-32 check");
  }
  return Status::OK();
}

}  // namespace nebulite

// The catalog of committed versions, their checks, and retention.
//
// A version is committed iff <tag>/<version>/COMMITTED exists and decodes; the catalog
// looks at nothing else. Retention removes a version's marker first and makes that
// durable before deleting any file, so a crash in the middle leaves the version either
// committed and intact or invisible, never committed and torn. It counts only versions
// that pass their check, so a damaged version never makes it delete an intact one.
#include <algorithm>
#include <chrono>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "nebulite/commit.h"

namespace nebulite {

Result<Catalog> ReadCatalog(Storage* storage) {
  Catalog catalog;
  NEBULITE_ASSIGN_OR_RETURN(std::vector<std::string> tags, storage->List(""));
  for (const std::string& tag : tags) {
    // Temporary files, the store's own entries and foreign entries are not tags.
    if (!ValidateTag(tag).ok()) continue;
    Result<std::vector<std::string>> versions = storage->List(tag);
    if (!versions.ok()) {  // e.g. lost+found, or a directory of another user
      catalog.warnings.push_back("skipping '" + tag + "': " + versions.status().ToString());
      continue;
    }
    for (const std::string& version : *versions) {
      if (!ValidateVersionName(version).ok()) continue;
      const std::string marker = CommitMarkerPath(tag, version);
      Result<FileInfo> info = storage->StatFile(marker);
      if (!info.ok()) {
        if (info.status().code() == StatusCode::kNotFound) continue;  // not committed
        catalog.warnings.push_back("skipping " + marker + ": " + info.status().ToString());
        continue;
      }
      if (info->type != FileType::kFile) {
        catalog.warnings.push_back("skipping " + marker + ": it is not a regular file");
        continue;
      }
      Result<std::string> text = storage->ReadFile(marker, kMaxManifestBytes);
      if (!text.ok()) {
        if (text.status().code() == StatusCode::kNotFound) continue;  // deleted meanwhile
        catalog.warnings.push_back("skipping " + marker + ": " + text.status().ToString());
        continue;
      }
      Result<CommitRecord> record = DecodeCommitRecord(*text);
      if (!record.ok()) {
        catalog.warnings.push_back("skipping " + marker + ": " + record.status().ToString());
        continue;
      }
      if (record->tag != tag || record->version != version) {
        catalog.warnings.push_back("skipping " + marker + ": it names tag '" + record->tag +
                                   "' version '" + record->version + "'");
        continue;
      }
      catalog.entries.push_back(CatalogEntry{std::move(record).value(), info->mtime_ns});
    }
  }
  std::sort(catalog.entries.begin(), catalog.entries.end(),
            [](const CatalogEntry& a, const CatalogEntry& b) {
              return std::tie(a.commit.seq, a.commit.tag, a.commit.version) <
                     std::tie(b.commit.seq, b.commit.tag, b.commit.version);
            });
  return catalog;
}

Status VersionChecker::Check(const CatalogEntry& entry) {
  const CommitRecord& c = entry.commit;
  for (uint32_t r = 0; r < c.world_size; ++r) {
    NEBULITE_ASSIGN_OR_RETURN(Manifest m, ReadManifest(storage_, c.tag, c.version, r));
    if (m.world_size != c.world_size) {
      return Status::Corruption(ManifestPath(c.tag, c.version, r) + " is for world size " +
                                std::to_string(m.world_size));
    }
    for (const ManifestFile& f : m.files) {
      const std::string path = DataFilePath(c.tag, c.version, r, f.name);
      NEBULITE_ASSIGN_OR_RETURN(FileInfo info, CheckDataFilePresent(storage_, path, f));
      // Every file is complete before its manifest, and every manifest before the marker:
      // a file changed later was changed by someone else. Read it. Filesystems keep times
      // in coarse ticks, so a file of the marker's own tick is read too (once: see below).
      // Object stores stamp an object when its upload completed, to the second: there a
      // file of the marker's second is one written for it (reading it back would double
      // every commit's traffic), and only a later one was changed.
      if (info.mtime_ns < entry.marker_mtime_ns ||
          (storage_->is_object_store() && info.mtime_ns == entry.marker_mtime_ns)) {
        continue;
      }
      const auto key = std::make_tuple(path, info.size, info.mtime_ns);
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = files_.find(key);
        if (it != files_.end()) {
          if (it->second) continue;
          return Status::Corruption("data file '" + path + "' fails its CRC-32 check");
        }
      }
      Status st = VerifyDataFile(storage_, path, f);
      // Damage is remembered; so is a file found intact, but only once its mtime is well in
      // the past: a change within the same tick would keep the key the same.
      const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
      if (st.code() == StatusCode::kCorruption || (st.ok() && now - info.mtime_ns > 2000000000)) {
        std::lock_guard<std::mutex> lock(mu_);
        files_[key] = st.ok();
      }
      NEBULITE_RETURN_IF_ERROR(st);
    }
  }
  return Status::OK();
}

Result<RetentionResult> ApplyRetention(Storage* storage, uint32_t keep, VersionChecker* checker,
                                       const std::string& protect_tag,
                                       const std::string& protect_version) {
  if (keep < 1) return Status::InvalidArgument("retention must keep at least one version");
  NEBULITE_ASSIGN_OR_RETURN(Catalog catalog, ReadCatalog(storage));
  RetentionResult result;
  // Newest first: find the keep-th version that passes its check.
  size_t intact = 0, oldest_kept = catalog.entries.size();
  for (size_t i = catalog.entries.size(); i-- > 0 && intact < keep;) {
    const CatalogEntry& e = catalog.entries[i];
    const bool just_committed =
        e.commit.tag == protect_tag && e.commit.version == protect_version;
    Status st = just_committed ? Status::OK() : checker->Check(e);
    if (st.ok()) {
      ++intact;
      oldest_kept = i;
    } else {
      result.warnings.push_back("checkpoint '" + e.commit.tag + "' (" + e.commit.version +
                                ") does not count as kept: " + st.ToString());
    }
  }
  if (intact < keep) return result;  // fewer intact versions than wanted: delete nothing
  for (size_t i = 0; i < oldest_kept; ++i) {
    const std::string& tag = catalog.entries[i].commit.tag;
    const std::string& version = catalog.entries[i].commit.version;
    if (tag == protect_tag && version == protect_version) continue;
    Status st = RetireVersion(storage, tag, version);
    if (st.code() == StatusCode::kInvalidArgument) {
      // Not nebulite's to delete (reached through a symbolic link, say): nothing was changed.
      result.warnings.push_back("checkpoint '" + tag + "' (" + version +
                                ") is kept: " + st.ToString());
      continue;
    }
    NEBULITE_RETURN_IF_ERROR(st);
    result.deleted.emplace_back(tag, version);
  }
  return result;
}

Status RetireVersion(Storage* storage, const std::string& tag, const std::string& version) {
  NEBULITE_RETURN_IF_ERROR(ValidateTag(tag));
  NEBULITE_RETURN_IF_ERROR(ValidateVersionName(version));
  const std::string dir = VersionDir(tag, version);
  // 1. Uncommit, durably: from here on no reader will pick this version.
  NEBULITE_RETURN_IF_ERROR(storage->Delete(CommitMarkerPath(tag, version)));
  NEBULITE_RETURN_IF_ERROR(storage->SyncDir(dir));
  // 2. Only then remove the files.
  NEBULITE_RETURN_IF_ERROR(storage->DeleteRecursively(dir));
  NEBULITE_RETURN_IF_ERROR(storage->SyncDir(tag));
  // 3. Drop the tag's directory if it holds nothing; a save of this tag that is creating a
  //    version in it at the same instant keeps it (the removal fails when not empty).
  NEBULITE_ASSIGN_OR_RETURN(bool removed, storage->RemoveDirIfEmpty(tag));
  if (removed) NEBULITE_RETURN_IF_ERROR(storage->SyncDir(""));
  return Status::OK();
}

}  // namespace nebulite

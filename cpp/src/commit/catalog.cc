// The catalog of committed versions, and retention.
//
// A version is committed iff <tag>/<version>/COMMITTED exists and decodes; the catalog
// looks at nothing else. Retention removes a version's marker first and makes that
// durable before deleting any file, so a crash in the middle leaves the version either
// committed and intact or invisible, never committed and torn.
#include <algorithm>
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
    // Temporary files and foreign entries are not tags.
    if (tag.empty() || tag[0] == '.' || !ValidatePathComponent(tag, "tag").ok()) continue;
    NEBULITE_ASSIGN_OR_RETURN(std::vector<std::string> versions, storage->List(tag));
    for (const std::string& version : versions) {
      if (version.empty() || version[0] == '.' || !ValidatePathComponent(version, "version").ok()) {
        continue;
      }
      const std::string marker = CommitMarkerPath(tag, version);
      NEBULITE_ASSIGN_OR_RETURN(bool committed, storage->Exists(marker));
      if (!committed) continue;  // in progress, abandoned, or being deleted
      Result<std::string> text = storage->ReadFile(marker, kMaxManifestBytes);
      if (!text.ok()) {
        if (text.status().code() == StatusCode::kNotFound) continue;  // deleted meanwhile
        if (text.status().code() == StatusCode::kCorruption) {        // over the size bound
          catalog.warnings.push_back("skipping " + marker + ": " + text.status().ToString());
          continue;
        }
        return text.status();
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
      catalog.entries.push_back(CatalogEntry{std::move(record).value()});
    }
  }
  std::sort(catalog.entries.begin(), catalog.entries.end(),
            [](const CatalogEntry& a, const CatalogEntry& b) {
              return std::tie(a.commit.seq, a.commit.tag, a.commit.version) <
                     std::tie(b.commit.seq, b.commit.tag, b.commit.version);
            });
  return catalog;
}

Result<std::vector<std::pair<std::string, std::string>>> ApplyRetention(Storage* storage,
                                                                        uint32_t keep) {
  if (keep < 1) return Status::InvalidArgument("retention must keep at least one version");
  NEBULITE_ASSIGN_OR_RETURN(Catalog catalog, ReadCatalog(storage));
  std::vector<std::pair<std::string, std::string>> deleted;
  if (catalog.entries.size() <= keep) return deleted;
  const size_t doomed = catalog.entries.size() - keep;
  for (size_t i = 0; i < doomed; ++i) {
    const std::string& tag = catalog.entries[i].commit.tag;
    const std::string& version = catalog.entries[i].commit.version;
    const std::string dir = VersionDir(tag, version);
    // 1. Uncommit, durably: from here on no reader will pick this version.
    NEBULITE_RETURN_IF_ERROR(storage->Delete(CommitMarkerPath(tag, version)));
    NEBULITE_RETURN_IF_ERROR(storage->SyncDir(dir));
    // 2. Only then remove the files.
    NEBULITE_RETURN_IF_ERROR(storage->DeleteRecursively(dir));
    NEBULITE_RETURN_IF_ERROR(storage->SyncDir(tag));
    deleted.emplace_back(tag, version);
    // 3. Drop the tag's directory once it holds nothing. A save of this tag that starts
    //    between List and the delete could lose its first files (Storage has no
    //    "remove if empty"); the window is a few microseconds on posix.
    NEBULITE_ASSIGN_OR_RETURN(std::vector<std::string> left, storage->List(tag));
    if (left.empty()) {
      NEBULITE_RETURN_IF_ERROR(storage->DeleteRecursively(tag));
      NEBULITE_RETURN_IF_ERROR(storage->SyncDir(""));
    }
  }
  return deleted;
}

}  // namespace nebulite

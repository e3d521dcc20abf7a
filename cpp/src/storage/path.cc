// Path helpers shared by every driver (validation of components, joining) and the
// non-virtual conveniences of Storage.
#include <memory>
#include <string>
#include <vector>

#include "base/utf8.h"
#include "nebulite/storage.h"
#include "storage/path_internal.h"

namespace nebulite {

Status ValidatePathComponent(const std::string& component, const char* what) {
  auto bad = [&](const char* why) {
    return Status::InvalidArgument(std::string(what) + " '" + component + "' " + why);
  };
  if (component.empty()) return bad("is empty");
  if (component.size() > 255) return bad("is longer than 255 bytes");
  if (component == "." || component == "..") return bad("is not a valid path component");
  for (unsigned char c : component) {
    if (c == '/' || c == '\\') return bad("contains a path separator");
    if (c < 0x20 || c == 0x7F) return bad("contains a NUL or control byte");
  }
  if (!IsValidUtf8(component)) return bad("is not valid UTF-8");
  return Status::OK();
}

std::string JoinPath(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  if (b.empty()) return a;
  return a + "/" + b;
}

std::string ParentDir(const std::string& path) {
  size_t pos = path.rfind('/');
  if (pos == std::string::npos) return "";
  return path.substr(0, pos);
}

std::string BaseName(const std::string& path) {
  size_t pos = path.rfind('/');
  return pos == std::string::npos ? path : path.substr(pos + 1);
}

Result<uint64_t> Storage::FileSize(const std::string& path) {
  NEBULITE_ASSIGN_OR_RETURN(FileInfo info, Stat(path));
  if (info.type == FileType::kDirectory) {
    return Status::InvalidArgument("'" + path + "' is a directory");
  }
  if (info.type != FileType::kFile) {
    return Status::InvalidArgument("'" + path + "' is not a regular file");
  }
  return info.size;
}

Result<bool> Storage::FileExists(const std::string& path) {
  Result<FileInfo> info = StatFile(path);
  if (info.ok()) return true;
  if (info.status().code() == StatusCode::kNotFound) return false;
  return info.status();
}

Status Storage::WriteWholeFile(const std::string& path, const std::vector<ByteSpan>& pieces) {
  NEBULITE_RETURN_IF_ERROR(internal::ValidateRelativePath(path, "path", false));
  const std::string name = BaseName(path);
  const std::string temp = JoinPath(ParentDir(path), "." + name.substr(0, 200) + ".whole.partial");
  uint64_t size = 0;
  for (const ByteSpan& p : pieces) size += p.size;
  NEBULITE_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, NewWritableFile(temp, size));
  Status st;
  uint64_t offset = 0;
  for (const ByteSpan& p : pieces) {
    if (st.ok() && p.size > 0) st = file->WriteAt(offset, p.data, p.size);
    offset += p.size;
  }
  if (st.ok()) st = file->Sync();
  Status closed = file->Close();
  if (st.ok()) st = closed;
  if (st.ok()) st = Rename(temp, path);
  if (st.ok()) st = SyncDir(ParentDir(path));
  if (!st.ok()) (void)Delete(temp);
  return st;
}

}  // namespace nebulite

namespace nebulite::internal {

Status ValidateRelativePath(const std::string& path, const char* what, bool allow_root) {
  if (path.empty()) {
    if (allow_root) return Status::OK();
    return Status::InvalidArgument(std::string(what) + " is empty");
  }
  size_t start = 0;
  while (true) {
    size_t slash = path.find('/', start);
    std::string component =
        path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    Status st = ValidatePathComponent(component, "path component");
    if (!st.ok()) {
      return Status::InvalidArgument(std::string(what) + " '" + path +
                                     "' is invalid: " + st.message());
    }
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return Status::OK();
}

}  // namespace nebulite::internal

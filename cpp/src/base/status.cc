#include "nebulite/status.h"

#include <cerrno>
#include <cstring>

namespace nebulite {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kCorruption:
      return "Corruption";
    case StatusCode::kIOError:
      return "IOError";
    case StatusCode::kNoSpace:
      return "NoSpace";
    case StatusCode::kResourceExhausted:
      return "ResourceExhausted";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kUnsupportedVersion:
      return "UnsupportedVersion";
    case StatusCode::kPermissionDenied:
      return "PermissionDenied";
    case StatusCode::kAlreadyExists:
      return "AlreadyExists";
    case StatusCode::kCancelled:
      return "Cancelled";
    case StatusCode::kInternal:
      return "Internal";
    case StatusCode::kStoreInUse:
      return "StoreInUse";
  }
  return "Unknown";
}

Status Status::FromErrno(int err, const std::string& context) {
  std::string msg = context + ": " + std::strerror(err);
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return NoSpace(std::move(msg));
    case EACCES:
    case EPERM:
    case EROFS:
      return PermissionDenied(std::move(msg));
    case ENOENT:
      return NotFound(std::move(msg));
    case EEXIST:
      return AlreadyExists(std::move(msg));
    default:
      return IOError(std::move(msg));
  }
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

Status Status::WithContext(const std::string& context) const {
  if (ok()) return *this;
  return Status(code_, context + ": " + message_);
}

}  // namespace nebulite

// Status and Result<T>: how every fallible call in the core reports errors.
//
// A Status is either OK or carries a code and a message. `Corruption` (the bytes
// we read are not what was written) is distinct from `IOError` (the operating
// system refused), which is the distinction a checkpoint loader needs.
// Both types are cheap to move and are [[nodiscard]]: ignoring one is a bug.
// Thread-safety: values; no shared state.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>

namespace nebulite {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,
  kNotFound = 2,
  kCorruption = 3,
  kIOError = 4,
  kNoSpace = 5,             // the persistent store is full (ENOSPC, EDQUOT)
  kResourceExhausted = 6,   // the memory budget cannot hold the request
  kFailedPrecondition = 7,  // e.g. saving before init, a closed engine
  kUnsupportedVersion = 8,  // a format version this build cannot read
  kPermissionDenied = 9,
  kAlreadyExists = 10,
  kCancelled = 11,
  kInternal = 12,
  kStoreInUse = 13,  // another job holds the store's writer lease
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string m) {
    return {StatusCode::kInvalidArgument, std::move(m)};
  }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status Corruption(std::string m) { return {StatusCode::kCorruption, std::move(m)}; }
  static Status IOError(std::string m) { return {StatusCode::kIOError, std::move(m)}; }
  static Status NoSpace(std::string m) { return {StatusCode::kNoSpace, std::move(m)}; }
  static Status ResourceExhausted(std::string m) {
    return {StatusCode::kResourceExhausted, std::move(m)};
  }
  static Status FailedPrecondition(std::string m) {
    return {StatusCode::kFailedPrecondition, std::move(m)};
  }
  static Status UnsupportedVersion(std::string m) {
    return {StatusCode::kUnsupportedVersion, std::move(m)};
  }
  static Status PermissionDenied(std::string m) {
    return {StatusCode::kPermissionDenied, std::move(m)};
  }
  static Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
  static Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  static Status StoreInUse(std::string m) { return {StatusCode::kStoreInUse, std::move(m)}; }

  // Builds an IOError (or NoSpace / PermissionDenied / NotFound) from errno.
  static Status FromErrno(int err, const std::string& context);

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

  // Returns a copy whose message is prefixed with `context: `.
  Status WithContext(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Result<T> holds either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    assert(!status_.ok() && "Result constructed from an OK status without a value");
    if (status_.ok()) status_ = Status::Internal("Result from OK status without value");
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & {
    assert(ok());
    return *value_;
  }
  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace nebulite

#define NEBULITE_CONCAT_INNER(a, b) a##b
#define NEBULITE_CONCAT(a, b) NEBULITE_CONCAT_INNER(a, b)

// Returns the status from the enclosing function if it is not OK.
#define NEBULITE_RETURN_IF_ERROR(expr) \
  do {                                 \
    ::nebulite::Status _st = (expr);   \
    if (!_st.ok()) return _st;         \
  } while (0)

// `NEBULITE_ASSIGN_OR_RETURN(auto x, F())` binds the value or returns the error.
#define NEBULITE_ASSIGN_OR_RETURN(lhs, expr) \
  NEBULITE_ASSIGN_OR_RETURN_IMPL(NEBULITE_CONCAT(_res_, __LINE__), lhs, expr)
#define NEBULITE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  lhs = std::move(tmp).value()

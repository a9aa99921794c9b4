// Status and StatusOr<T>: the one error model of kvferry.
//
// Every fallible call returns a Status or a StatusOr<T>. Codes are few and mean something to the
// caller (what to do next), the message says what and why, naming the offending values. Foreign
// errors (errno, cudaError_t, ucs_status_t, MPI codes) are converted once, at the backend edge.
// No exception crosses the library boundary. Status is a value type; thread-compatible.
#pragma once

#include <cassert>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,    // the caller passed something wrong; retrying the same call fails again
  kNotFound = 2,           // an id, key or file that does not exist
  kUnavailable = 3,        // a backend, device or peer can't be used now (maybe later)
  kDeadlineExceeded = 4,   // a wait ran past its deadline
  kDataLoss = 5,           // bytes are corrupt or missing (checksum, truncated file)
  kCancelled = 6,          // the operation was cancelled by a caller
  kInternal = 7,           // a broken invariant or an unexpected foreign error
  kResourceExhausted = 8,  // out of memory, disk space, slots
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return {StatusCode::kInvalidArgument, std::move(msg)};
  }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status Unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg)}; }
  static Status DeadlineExceeded(std::string msg) {
    return {StatusCode::kDeadlineExceeded, std::move(msg)};
  }
  static Status DataLoss(std::string msg) { return {StatusCode::kDataLoss, std::move(msg)}; }
  static Status Cancelled(std::string msg) { return {StatusCode::kCancelled, std::move(msg)}; }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }
  static Status ResourceExhausted(std::string msg) {
    return {StatusCode::kResourceExhausted, std::move(msg)};
  }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  std::string_view message() const {
    return rep_ ? std::string_view(rep_->message) : std::string_view();
  }
  // "INVALID_ARGUMENT: tp=3 does not divide kv_heads=8", or "OK".
  std::string ToString() const;
  // A copy with "context: " put in front of the message; OK stays OK.
  Status WithContext(std::string_view context) const;

  Status(const Status& o) : rep_(o.rep_ ? std::make_unique<Rep>(*o.rep_) : nullptr) {}
  Status& operator=(const Status& o) {
    rep_ = o.rep_ ? std::make_unique<Rep>(*o.rep_) : nullptr;
    return *this;
  }
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  std::unique_ptr<Rep> rep_;  // null when OK: an OK status costs one pointer
};

// StatusOr<T> holds a T or a non-OK Status.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    assert(!status_.ok() && "StatusOr built from an OK Status");
    if (status_.ok()) status_ = Status::Internal("StatusOr built from an OK Status");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

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
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace kvferry
#pragma GCC visibility pop

// Early return on error. Plain statements, no hidden control flow beyond the return.
#define KVF_CONCAT_INNER(a, b) a##b
#define KVF_CONCAT(a, b) KVF_CONCAT_INNER(a, b)
#define KVF_RETURN_IF_ERROR(expr)       \
  do {                                  \
    ::kvferry::Status _kvf_st = (expr); \
    if (!_kvf_st.ok()) return _kvf_st;  \
  } while (0)
#define KVF_ASSIGN_OR_RETURN(lhs, expr) \
  KVF_ASSIGN_OR_RETURN_IMPL(KVF_CONCAT(_kvf_or_, __LINE__), lhs, expr)
#define KVF_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return std::move(tmp).status();  \
  lhs = std::move(tmp).value()

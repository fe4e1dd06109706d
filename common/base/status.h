// Status and Result<T>: the one error model at every module boundary (docs/design.md §3).
//
// A Status is either ok or carries a code and a message written for a person: what failed
// and why ("config: router.http.port: 70000 is out of range [1, 65535]"). kInProgress is not an
// error: non-blocking calls (transfers, polls) return it while work is still under way.
// Both types are plain values, cheap to move, and safe to pass between threads.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "common/base/enum_names.h"

namespace pd {

enum class StatusCode {
  kOk = 0,
  kInProgress,       // not an error: the operation has not finished yet
  kInvalidArgument,  // the caller passed something malformed or out of range
  kNotFound,         // a file, tensor, key, peer or request that does not exist
  kAlreadyExists,
  kOutOfRange,
  kResourceExhausted,  // no free blocks, queue full, frame too large
  kFailedPrecondition,
  kUnavailable,  // a peer or device that cannot be reached (retry may succeed)
  kDeadlineExceeded,
  kCancelled,
  kUnimplemented,  // an architecture, transport or feature not supported here
  kDataLoss,       // truncated or corrupt data
  kInternal,
};

inline constexpr EnumNames<StatusCode, 14> kStatusCodeNames{{
    {StatusCode::kOk, "OK"},
    {StatusCode::kInProgress, "IN_PROGRESS"},
    {StatusCode::kInvalidArgument, "INVALID_ARGUMENT"},
    {StatusCode::kNotFound, "NOT_FOUND"},
    {StatusCode::kAlreadyExists, "ALREADY_EXISTS"},
    {StatusCode::kOutOfRange, "OUT_OF_RANGE"},
    {StatusCode::kResourceExhausted, "RESOURCE_EXHAUSTED"},
    {StatusCode::kFailedPrecondition, "FAILED_PRECONDITION"},
    {StatusCode::kUnavailable, "UNAVAILABLE"},
    {StatusCode::kDeadlineExceeded, "DEADLINE_EXCEEDED"},
    {StatusCode::kCancelled, "CANCELLED"},
    {StatusCode::kUnimplemented, "UNIMPLEMENTED"},
    {StatusCode::kDataLoss, "DATA_LOSS"},
    {StatusCode::kInternal, "INTERNAL"},
}};
inline const char* statusCodeName(StatusCode code) { return enumName(kStatusCodeNames, code, "UNKNOWN"); }

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }

  bool isOk() const { return code_ == StatusCode::kOk; }
  bool inProgress() const { return code_ == StatusCode::kInProgress; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "NOT_FOUND: model.safetensors: no such file"
  std::string toString() const;

  // Returns a copy whose message is prefixed with context ("loading model: ...").
  Status withContext(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status notFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status outOfRange(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status resourceExhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status failedPrecondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status deadlineExceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
inline Status cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status dataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status internalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// Result<T> holds a T or a non-ok Status. Accessing value() of an error is a programming
// error (asserted), so callers check ok() first or use PD_ASSIGN_OR_RETURN.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    assert(!std::get<Status>(v_).isOk() && "Result built from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & {
    assert(ok());
    return std::get<T>(v_);
  }
  const T& value() const& {
    assert(ok());
    return std::get<T>(v_);
  }
  T&& value() && {
    assert(ok());
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace pd

#define PD_CONCAT_INNER(a, b) a##b
#define PD_CONCAT(a, b) PD_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function if `expr` is not ok.
#define PD_RETURN_IF_ERROR(expr)               \
  do {                                         \
    ::pd::Status pd_status_ = (expr);          \
    if (!pd_status_.isOk()) return pd_status_; \
  } while (0)

// `PD_ASSIGN_OR_RETURN(auto x, makeX());` declares x from a Result or returns its Status.
#define PD_ASSIGN_OR_RETURN(lhs, expr) PD_ASSIGN_OR_RETURN_IMPL(PD_CONCAT(pd_result_, __LINE__), lhs, expr)
#define PD_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()

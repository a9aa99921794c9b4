// Checked integer arithmetic for sizes that come from shapes, handles and messages.
//
// Why: a size derived from a peer's bytes (a handle's pool_blocks, a FETCH's chunk_bytes) or from
// user input (a CLI --layers) must never overflow into a small or negative number that then sizes
// an allocation or an offset. Every such product or sum goes through these helpers, which report
// overflow instead of wrapping (signed overflow is undefined behaviour in C++), and every size
// that is about to size an allocation is first compared with a local bound (CheckAtMost), so a
// peer cannot make a process allocate more than its own pool and staging budget.
//
// Errors are kInvalidArgument and name the field, its value and the bound, e.g.
//   "handle pool_blocks=1099511627776 exceeds 2^40 ..." / "layers*kv_heads*... overflows int64".
//
// Pure functions, thread-safe.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <type_traits>

#include "kvferry/status.h"

namespace kvferry {

template <typename T>
requires std::is_integral_v<T>
constexpr std::optional<T> CheckedAdd(T a, T b) {
  T r{};
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

template <typename T>
requires std::is_integral_v<T>
constexpr std::optional<T> CheckedSub(T a, T b) {
  T r{};
  if (__builtin_sub_overflow(a, b, &r)) return std::nullopt;
  return r;
}

template <typename T>
requires std::is_integral_v<T>
constexpr std::optional<T> CheckedMul(T a, T b) {
  T r{};
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// The product of all factors as int64, or nullopt when any partial product overflows.
constexpr std::optional<int64_t> CheckedProduct(std::initializer_list<int64_t> factors) {
  int64_t r = 1;
  for (int64_t f : factors) {
    if (__builtin_mul_overflow(r, f, &r)) return std::nullopt;
  }
  return r;
}

// Status-returning forms: `what` names the computation ("pool_blocks*block_bytes").
inline StatusOr<int64_t> CheckedMul(int64_t a, int64_t b, std::string_view what) {
  if (auto r = CheckedMul(a, b)) return *r;
  return Status::InvalidArgument(fmt::format("{}: {} * {} overflows int64", what, a, b));
}
inline StatusOr<int64_t> CheckedAdd(int64_t a, int64_t b, std::string_view what) {
  if (auto r = CheckedAdd(a, b)) return *r;
  return Status::InvalidArgument(fmt::format("{}: {} + {} overflows int64", what, a, b));
}

// `field`=value must be in [lo, hi]; the error names the field, the value and the bound (and
// `bound_what`, what the bound is: "this rank's pool", "the configured staging").
inline Status CheckInRange(std::string_view field, int64_t value, int64_t lo, int64_t hi,
                           std::string_view bound_what = {}) {
  if (value >= lo && value <= hi) return Status::Ok();
  if (value < lo) {
    return Status::InvalidArgument(fmt::format("{}={} is below the minimum {}{}{}", field, value,
                                               lo, bound_what.empty() ? "" : " of ", bound_what));
  }
  return Status::InvalidArgument(fmt::format("{}={} exceeds {}{}{}", field, value, hi,
                                             bound_what.empty() ? "" : ", ", bound_what));
}
inline Status CheckAtMost(std::string_view field, int64_t value, int64_t hi,
                          std::string_view bound_what = {}) {
  if (value <= hi) return Status::Ok();
  return CheckInRange(field, value, INT64_MIN, hi, bound_what);
}

}  // namespace kvferry

// How the wire describes a message once. Each message and record has one Fields(io, value)
// function template that names its fields in wire order; run with a FieldWriter it encodes, with a
// FieldReader it decodes. Encoding and decoding thus can't drift apart: a field added, moved or
// resized changes both. The reader checks as it goes what the writer takes on trust: lengths and
// counts against their limits and the bytes left (before anything is allocated), and whatever a
// Fields function asks with Check (flags, modes, enums); the first error wins and names its field.
//
// A value the wire holds in another form (flags made of several bools, an enum as a byte) is a
// local computed from the value and passed to io, then given back with Set: the writer computes
// and writes it (Set does nothing), the reader reads it, checks it and sets the fields from it.
// Both are thin wrappers of base/wire.h; thread-compatible.
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "base/wire.h"

namespace kvferry::wire {

// What a count-prefixed list or byte string may hold.
struct Limit {
  uint32_t max = 0;      // the most elements
  size_t min_bytes = 0;  // the fewest bytes one element takes on the wire
  bool empty_ok = true;
};

class FieldWriter {
 public:
  static constexpr bool kReads = false;
  explicit FieldWriter(WireWriter& w) : w_(w) {}

  void U8(uint8_t v, const char*) { w_.U8(v); }
  void U16(uint16_t v, const char*) { w_.U16(v); }
  void U32(uint32_t v, const char*) { w_.U32(v); }
  void U64(uint64_t v, const char*) { w_.U64(v); }
  void I32(int32_t v, const char*) { w_.I32(v); }
  void I64(int64_t v, const char*) { w_.I64(v); }
  void Str(const std::string& s, const char*, size_t /*max*/) { w_.Str(s); }
  template <size_t N>
  void Fixed(const std::array<uint8_t, N>& a, const char*) {
    for (uint8_t b : a) w_.U8(b);
  }
  void Blob(const std::vector<std::byte>& b, const char*, Limit) { w_.Bytes(b); }
  // A u32 count, then each element as `each(io, element)` writes it.
  template <typename T, typename Each>
  void List(const std::vector<T>& v, const char*, Limit, Each each) {
    w_.U32(static_cast<uint32_t>(v.size()));
    for (const T& e : v) each(*this, e);
  }
  template <typename T, typename V>
  void Set(const T&, V) {}
  template <typename Why>
  void Check(bool, Why&&) {}
  bool ok() const { return true; }

 private:
  WireWriter& w_;
};

class FieldReader {
 public:
  static constexpr bool kReads = true;
  explicit FieldReader(WireReader& r) : r_(r) {}

  void U8(uint8_t& v, const char* field) { v = r_.U8(field); }
  void U16(uint16_t& v, const char* field) { v = r_.U16(field); }
  void U32(uint32_t& v, const char* field) { v = r_.U32(field); }
  void U64(uint64_t& v, const char* field) { v = r_.U64(field); }
  void I32(int32_t& v, const char* field) { v = r_.I32(field); }
  void I64(int64_t& v, const char* field) { v = r_.I64(field); }
  void Str(std::string& s, const char* field, size_t max) { s = r_.Str(field, max); }
  template <size_t N>
  void Fixed(std::array<uint8_t, N>& a, const char* field) {
    for (uint8_t& b : a) b = r_.U8(field);
  }
  void Blob(std::vector<std::byte>& b, const char* field, Limit limit) {
    b.assign(Count(field, limit), std::byte{0});
    for (std::byte& x : b) x = std::byte{r_.U8(field)};
  }
  template <typename T, typename Each>
  void List(std::vector<T>& v, const char* field, Limit limit, Each each) {
    const uint32_t n = Count(field, limit);
    v.clear();
    for (uint32_t i = 0; i < n && r_.ok(); ++i) each(*this, v.emplace_back());
  }
  template <typename T, typename V>
  void Set(T& field, V v) {
    field = static_cast<T>(v);
  }
  // Fails the read with why() unless `good` (only the first error counts).
  template <typename Why>
  void Check(bool good, Why&& why) {
    if (r_.ok() && !good) r_.Fail(why());
  }
  bool ok() const { return r_.ok(); }

 private:
  // A u32 count within `limit` and the bytes left, or 0 with the reader failed.
  uint32_t Count(const char* field, Limit limit) {
    const uint32_t n = r_.U32(field);
    if (!r_.ok()) return 0;
    if (n > limit.max) {
      r_.Fail(fmt::format("{} count {} exceeds the limit {}", field, n, limit.max));
    } else if (n * limit.min_bytes > r_.remaining()) {
      r_.Fail(fmt::format("{}: {} of at least {} bytes each exceed the {} bytes left", field, n,
                          limit.min_bytes, r_.remaining()));
    } else if (n == 0 && !limit.empty_ok) {
      r_.Fail(fmt::format("{} is empty", field));
    }
    return r_.ok() ? n : 0;
  }
  WireReader& r_;
};

// The type Fields takes its value as: const for the writer, mutable for the reader.
template <typename Io, typename T>
using Ref = std::conditional_t<Io::kReads, T&, const T&>;

}  // namespace kvferry::wire

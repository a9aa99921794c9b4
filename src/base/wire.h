// Explicit little-endian encoding for wire and file formats: never a memcpy of a struct.
// WireWriter appends; WireReader reads with bounds checks and reports the first error with the
// field it was reading. Both are value types, thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/status.h"

namespace kvferry {

class WireWriter {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<std::byte>(v)); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void I32(int32_t v) { Le(static_cast<uint32_t>(v), 4); }
  void I64(int64_t v) { Le(static_cast<uint64_t>(v), 8); }
  void Bytes(std::span<const std::byte> b) {
    U32(static_cast<uint32_t>(b.size()));
    out_.insert(out_.end(), b.begin(), b.end());
  }
  void Str(std::string_view s) { Bytes(std::as_bytes(std::span(s.data(), s.size()))); }
  size_t size() const { return out_.size(); }
  std::vector<std::byte>& buffer() { return out_; }
  std::vector<std::byte> Take() { return std::move(out_); }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<std::byte>(v >> (8 * i)));
  }
  std::vector<std::byte> out_;
};

class WireReader {
 public:
  explicit WireReader(std::span<const std::byte> in) : in_(in) {}

  uint8_t U8(const char* field) { return static_cast<uint8_t>(Le(1, field)); }
  uint16_t U16(const char* field) { return static_cast<uint16_t>(Le(2, field)); }
  uint32_t U32(const char* field) { return static_cast<uint32_t>(Le(4, field)); }
  uint64_t U64(const char* field) { return Le(8, field); }
  int32_t I32(const char* field) { return static_cast<int32_t>(Le(4, field)); }
  int64_t I64(const char* field) { return static_cast<int64_t>(Le(8, field)); }
  // A length-prefixed string of at most `max` bytes.
  std::string Str(const char* field, size_t max);
  // A count that must be at most `max` (guards allocations sized from the wire).
  uint32_t Count(const char* field, uint32_t max);

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  size_t position() const { return pos_; }
  size_t remaining() const { return in_.size() - pos_; }
  // Fails the reader (first error wins).
  void Fail(std::string message);

 private:
  uint64_t Le(int n, const char* field);
  std::span<const std::byte> in_;
  size_t pos_ = 0;
  Status status_;
};

}  // namespace kvferry

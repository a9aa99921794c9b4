#include "base/wire.h"

#include <fmt/format.h>

namespace kvferry {

void WireReader::Fail(std::string message) {
  if (status_.ok()) status_ = Status::InvalidArgument(std::move(message));
}

uint64_t WireReader::Le(int n, const char* field) {
  if (!status_.ok()) return 0;
  if (remaining() < static_cast<size_t>(n)) {
    Fail(fmt::format("truncated at byte {} reading {} ({} bytes needed, {} left)", pos_, field, n,
                     remaining()));
    return 0;
  }
  uint64_t v = 0;
  for (int i = 0; i < n; ++i)
    v |= static_cast<uint64_t>(std::to_integer<uint8_t>(in_[pos_ + i])) << (8 * i);
  pos_ += n;
  return v;
}

std::string WireReader::Str(const char* field, size_t max) {
  uint32_t n = U32(field);
  if (!status_.ok()) return {};
  if (n > max) {
    Fail(fmt::format("{} is {} bytes long; at most {} allowed", field, n, max));
    return {};
  }
  if (remaining() < n) {
    Fail(fmt::format("truncated at byte {} reading {} ({} bytes needed, {} left)", pos_, field, n,
                     remaining()));
    return {};
  }
  std::string s(reinterpret_cast<const char*>(in_.data() + pos_), n);
  pos_ += n;
  return s;
}

uint32_t WireReader::Count(const char* field, uint32_t max) {
  uint32_t n = U32(field);
  if (status_.ok() && n > max) {
    Fail(fmt::format("{} count {} exceeds the limit {}", field, n, max));
    return 0;
  }
  return n;
}

}  // namespace kvferry

#include "transport/ucx_address.h"

namespace kvferry {
namespace {

constexpr std::string_view kScheme = "ucx1:";

uint32_t Fnv1a(const uint8_t* p, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 16777619u;
  return h;
}

void PutU32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
}  // namespace

uint32_t LoadU32Le(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

std::string EncodeUcxAddress(const void* addr, size_t len) {
  std::vector<uint8_t> raw;
  PutU32(raw, static_cast<uint32_t>(len));
  const auto* p = static_cast<const uint8_t*>(addr);
  raw.insert(raw.end(), p, p + len);
  PutU32(raw, Fnv1a(p, len));
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(kScheme);
  for (uint8_t b : raw) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

StatusOr<std::vector<uint8_t>> DecodeUcxAddress(std::string_view text) {
  auto bad = [&](std::string_view why) {
    std::string shown(text.substr(0, 48));
    return Status::InvalidArgument("not a ucx address ('" + shown +
                                   (text.size() > 48 ? "...'" : "'") + "): " + std::string(why));
  };
  if (text.substr(0, kScheme.size()) != kScheme) return bad("missing 'ucx1:' prefix");
  std::string_view hex = text.substr(kScheme.size());
  if (hex.size() % 2 != 0 || hex.size() < 16) return bad("bad length");
  std::vector<uint8_t> raw(hex.size() / 2);
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < raw.size(); ++i) {
    int hi = nib(hex[2 * i]), lo = nib(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return bad("not lowercase hex");
    raw[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  const uint32_t n = LoadU32Le(raw.data());
  if (size_t{n} + 8 != raw.size()) return bad("length field does not match");
  if (Fnv1a(raw.data() + 4, n) != LoadU32Le(raw.data() + 4 + n)) return bad("checksum mismatch");
  return std::vector<uint8_t>(raw.begin() + 4, raw.begin() + 4 + n);
}

std::string EncodeUcxWorkerAddresses(const UcxWorkerAddresses& a) {
  std::vector<uint8_t> raw;
  PutU32(raw, static_cast<uint32_t>(a.control.size()));
  raw.insert(raw.end(), a.control.begin(), a.control.end());
  raw.insert(raw.end(), a.data.begin(), a.data.end());
  return EncodeUcxAddress(raw.data(), raw.size());
}

StatusOr<UcxWorkerAddresses> DecodeUcxWorkerAddresses(std::string_view text) {
  KVF_ASSIGN_OR_RETURN(std::vector<uint8_t> raw, DecodeUcxAddress(text));
  const size_t c = raw.size() >= 4 ? LoadU32Le(raw.data()) : 0;
  if (raw.size() < 4 || c == 0 || c >= raw.size() - 4) {
    return Status::InvalidArgument("not a ucx transport address: " + std::to_string(raw.size()) +
                                   " payload bytes, control worker address of " +
                                   std::to_string(c));
  }
  UcxWorkerAddresses a;
  a.control.assign(raw.begin() + 4, raw.begin() + 4 + static_cast<std::ptrdiff_t>(c));
  a.data.assign(raw.begin() + 4 + static_cast<std::ptrdiff_t>(c), raw.end());
  return a;
}

}  // namespace kvferry

#include "transport/nixl_wire.h"

#include <fmt/format.h>

#include <cstring>

#include "base/wire.h"

namespace kvferry::nixl_detail {
namespace {

constexpr std::string_view kAddressPrefix = "nixl1:";
constexpr char kKeyMagic[4] = {'N', 'X', 'K', '1'};
constexpr char kKeyMagicV2[4] = {'N', 'X', 'K', '2'};
constexpr size_t kMaxName = 256;
constexpr uint32_t kMaxMetadata = 1 << 24;

// A length-prefixed byte run of at most `max` bytes.
std::vector<std::byte> ReadBlob(WireReader& r, std::span<const std::byte> in, const char* field,
                                uint32_t max) {
  const uint32_t n = r.U32(field);
  if (!r.ok()) return {};
  if (n > max || n > r.remaining()) {
    r.Fail(fmt::format("{}: {} bytes, {} left (at most {})", field, n, r.remaining(), max));
    return {};
  }
  const size_t at = r.position();
  for (uint32_t i = 0; i < n; ++i) r.U8(field);  // advances; bounds checked above
  return {in.begin() + at, in.begin() + at + n};
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string EncodeNixlAddress(const NixlAddress& a) {
  WireWriter w;
  w.Str(a.agent);
  w.Bytes(a.metadata);
  std::string out(kAddressPrefix);
  static constexpr char kHex[] = "0123456789abcdef";
  for (std::byte b : w.buffer()) {
    out.push_back(kHex[static_cast<uint8_t>(b) >> 4]);
    out.push_back(kHex[static_cast<uint8_t>(b) & 15]);
  }
  return out;
}

StatusOr<NixlAddress> DecodeNixlAddress(std::string_view text) {
  if (text.substr(0, kAddressPrefix.size()) != kAddressPrefix) {
    return Status::InvalidArgument(
        fmt::format("not a NIXL transport address (expected '{}...'): '{}'", kAddressPrefix,
                    text.substr(0, 16)));
  }
  text.remove_prefix(kAddressPrefix.size());
  if (text.size() % 2 != 0) {
    return Status::InvalidArgument("NIXL address: odd number of hex digits");
  }
  std::vector<std::byte> bytes(text.size() / 2);
  for (size_t i = 0; i < bytes.size(); ++i) {
    const int hi = HexDigit(text[2 * i]), lo = HexDigit(text[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return Status::InvalidArgument(fmt::format("NIXL address: not hex at digit {}", 2 * i));
    }
    bytes[i] = static_cast<std::byte>(hi << 4 | lo);
  }
  WireReader r(bytes);
  NixlAddress a;
  a.agent = r.Str("agent name", kMaxName);
  a.metadata = ReadBlob(r, bytes, "agent metadata", kMaxMetadata);
  if (r.ok() && r.remaining() != 0) {
    r.Fail(fmt::format("{} bytes after the metadata", r.remaining()));
  }
  if (r.ok() && (a.agent.empty() || a.metadata.empty())) r.Fail("empty agent name or metadata");
  if (!r.ok()) return r.status().WithContext("NIXL address");
  return a;
}

std::vector<std::byte> EncodeNixlKey(const NixlKey& k) {
  WireWriter w;
  const bool v1 = k.mem == 0 && k.device == 0;
  const char* magic = v1 ? kKeyMagic : kKeyMagicV2;
  for (int i = 0; i < 4; ++i) w.U8(static_cast<uint8_t>(magic[i]));
  w.Str(k.agent);
  w.U64(k.base);
  w.U64(k.size);
  if (!v1) {
    w.U8(static_cast<uint8_t>(k.mem));
    w.U64(k.device);
  }
  w.Bytes(k.metadata);
  return w.Take();
}

StatusOr<NixlKey> DecodeNixlKey(std::span<const std::byte> bytes) {
  const bool v1 = bytes.size() >= 4 && std::memcmp(bytes.data(), kKeyMagic, 4) == 0;
  const bool v2 = bytes.size() >= 4 && std::memcmp(bytes.data(), kKeyMagicV2, 4) == 0;
  if (!v1 && !v2) return Status::InvalidArgument("not a NIXL transport key (bad magic)");
  WireReader r(bytes.subspan(4));
  NixlKey k;
  k.agent = r.Str("key agent", kMaxName);
  k.base = r.U64("key base");
  k.size = r.U64("key size");
  if (v2) {
    k.mem = r.U8("key memory type");
    k.device = r.U64("key device");
    if (r.ok() && k.mem > 1) r.Fail(fmt::format("key memory type {} (0 DRAM, 1 VRAM)", k.mem));
  }
  k.metadata = ReadBlob(r, bytes.subspan(4), "key metadata", kMaxMetadata);
  if (r.ok() && r.remaining() != 0) r.Fail(fmt::format("{} bytes after the key", r.remaining()));
  if (r.ok() && k.base + k.size < k.base) r.Fail("key range wraps around");
  if (!r.ok()) return r.status().WithContext("NIXL key");
  return k;
}

std::vector<std::byte> NixlNotifHeader(uint8_t kind, std::string_view hello_address, uint64_t tag,
                                       uint64_t total, uint64_t offset) {
  WireWriter w;
  w.U8(kind | (hello_address.empty() ? 0 : kHelloBit));
  if (!hello_address.empty()) w.Str(hello_address);
  if (kind == kAck) w.U64(tag);
  if (kind == kData) {
    w.U64(tag);
    w.U64(total);
    w.U64(offset);
  }
  return w.Take();
}

StatusOr<NixlNotif> DecodeNixlNotif(std::span<const std::byte> bytes) {
  WireReader r(bytes);
  NixlNotif n;
  const uint8_t k = r.U8("notification kind");
  n.kind = k & ~kHelloBit;
  if (r.ok() && (k & kHelloBit)) n.hello_address = r.Str("hello address", 1 << 26);
  if (r.ok() && n.kind > kAck) r.Fail(fmt::format("unknown notification kind {}", n.kind));
  if (r.ok() && n.kind == kData) {
    n.tag = r.U64("tag");
    n.total = r.U64("message length");
    n.offset = r.U64("fragment offset");
    if (r.ok() && (n.offset > n.total || r.remaining() > n.total - n.offset))
      r.Fail(fmt::format("fragment [{}, +{}) outside a {}-byte message", n.offset, r.remaining(),
                         n.total));
  }
  if (r.ok() && n.kind == kAck) n.tag = r.U64("tag");
  if (!r.ok()) return r.status().WithContext("NIXL notification");
  n.payload = bytes.subspan(r.position());
  return n;
}

}  // namespace kvferry::nixl_detail

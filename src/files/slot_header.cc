#include "files/slot_header.h"

#include <fmt/format.h>
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

namespace kvferry {
namespace {

// Header field offsets (docs/file_format.md).
constexpr size_t kOffMagic = 0;
constexpr size_t kOffVersion = 8;
constexpr size_t kOffHeaderBytes = 10;
constexpr size_t kOffFlags = 12;
constexpr size_t kOffKeyHi = 16;
constexpr size_t kOffKeyLo = 24;
constexpr size_t kOffSlot = 32;
constexpr size_t kOffPayloadBytes = 40;
constexpr size_t kOffPayloadChecksum = 48;
constexpr size_t kOffHeaderChecksum = 56;  // = header_bytes - 8 in version 1

template <typename T>
void Put(std::span<std::byte> out, size_t off, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out[off + i] = static_cast<std::byte>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
  }
}

template <typename T>
T Get(std::span<const std::byte> in, size_t off) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    v |= static_cast<uint64_t>(in[off + i]) << (8 * i);
  }
  return static_cast<T>(v);
}

}  // namespace

uint64_t Checksum64(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

uint64_t Checksum64(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  XXH3_state_t st;
  XXH3_64bits_reset(&st);
  XXH3_64bits_update(&st, a, a_bytes);
  XXH3_64bits_update(&st, b, b_bytes);
  return XXH3_64bits_digest(&st);
}

void EncodeSlotHeader(const SlotHeader& h, std::span<std::byte> out) {
  Put<uint64_t>(out, kOffMagic, kSlotMagic);
  Put<uint16_t>(out, kOffVersion, h.version);
  Put<uint16_t>(out, kOffHeaderBytes, static_cast<uint16_t>(kSlotHeaderBytes));
  Put<uint32_t>(out, kOffFlags, h.flags);
  Put<uint64_t>(out, kOffKeyHi, h.key_hi);
  Put<uint64_t>(out, kOffKeyLo, h.key_lo);
  Put<uint64_t>(out, kOffSlot, h.slot);
  Put<uint64_t>(out, kOffPayloadBytes, h.payload_bytes);
  Put<uint64_t>(out, kOffPayloadChecksum, h.payload_checksum);
  Put<uint64_t>(out, kOffHeaderChecksum, Checksum64(out.data(), kOffHeaderChecksum));
}

StatusOr<SlotHeader> DecodeSlotHeader(std::span<const std::byte> in) {
  if (in.size() < static_cast<size_t>(kSlotHeaderBytes)) {
    return Status::DataLoss(
        fmt::format("header is {} bytes; at least {} expected", in.size(), kSlotHeaderBytes));
  }
  uint64_t magic = Get<uint64_t>(in, kOffMagic);
  if (magic != kSlotMagic) {
    return Status::DataLoss(magic == 0 ? std::string("no slot header (zero bytes: never written)")
                                       : fmt::format("bad magic {:#018x}", magic));
  }
  SlotHeader h;
  h.version = Get<uint16_t>(in, kOffVersion);
  if (h.version != kSlotFormatVersion) {
    return Status::DataLoss(fmt::format("unsupported format version {} (this reader knows {})",
                                        h.version, kSlotFormatVersion));
  }
  uint16_t header_bytes = Get<uint16_t>(in, kOffHeaderBytes);
  if (header_bytes != kSlotHeaderBytes) {
    return Status::DataLoss(fmt::format("header size {} in a version-{} header; expected {}",
                                        header_bytes, h.version, kSlotHeaderBytes));
  }
  uint64_t stored = Get<uint64_t>(in, kOffHeaderChecksum);
  uint64_t computed = Checksum64(in.data(), kOffHeaderChecksum);
  if (stored != computed) {
    return Status::DataLoss(fmt::format(
        "header checksum mismatch (stored {:#018x}, computed {:#018x})", stored, computed));
  }
  h.flags = Get<uint32_t>(in, kOffFlags);
  if ((h.flags & ~kSlotFlagPayloadChecksum) != 0) {
    return Status::DataLoss(fmt::format("unknown header flags {:#x}", h.flags));
  }
  h.key_hi = Get<uint64_t>(in, kOffKeyHi);
  h.key_lo = Get<uint64_t>(in, kOffKeyLo);
  h.slot = Get<uint64_t>(in, kOffSlot);
  h.payload_bytes = Get<uint64_t>(in, kOffPayloadBytes);
  h.payload_checksum = Get<uint64_t>(in, kOffPayloadChecksum);
  return h;
}

}  // namespace kvferry

// The slot header of a slab file: encode/decode of the fixed little-endian record that opens
// every slot (docs/file_format.md gives it byte by byte). Pure functions, no I/O; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvferry/status.h"

namespace kvferry {

inline constexpr uint64_t kSlotMagic = 0x544F4C5346564B;  // "KVFSLOT\0" read little-endian
inline constexpr uint16_t kSlotFormatVersion = 1;
inline constexpr int64_t kSlotHeaderBytes = 64;    // encoded size of a version-1 header
inline constexpr int64_t kSlotHeaderBlock = 4096;  // bytes the header occupies in the slot

// Header flags.
inline constexpr uint32_t kSlotFlagPayloadChecksum = 1u << 0;  // payload_checksum is valid

struct SlotHeader {
  uint16_t version = kSlotFormatVersion;
  uint32_t flags = 0;
  uint64_t key_hi = 0;
  uint64_t key_lo = 0;
  uint64_t slot = 0;  // slot id, so a slot read at the wrong offset is caught
  uint64_t payload_bytes = 0;
  uint64_t payload_checksum = 0;  // XXH3-64 of the payload bytes (seed 0)
  bool operator==(const SlotHeader&) const = default;
};

// Writes kSlotHeaderBytes bytes into out (out.size() >= kSlotHeaderBytes).
void EncodeSlotHeader(const SlotHeader& h, std::span<std::byte> out);

// Decodes and validates (magic, version, header size, header checksum). Errors are kDataLoss with
// the reason ("bad magic 0x...", "header checksum mismatch", "unsupported format version 7").
StatusOr<SlotHeader> DecodeSlotHeader(std::span<const std::byte> in);

// XXH3-64 (seed 0) of bytes.
uint64_t Checksum64(const void* data, size_t bytes);
// XXH3-64 of the concatenation of two pieces (a payload held as body + tail), = Checksum64 of it.
uint64_t Checksum64(const void* a, size_t a_bytes, const void* b, size_t b_bytes);

}  // namespace kvferry

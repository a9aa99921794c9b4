#include "slot_header_fuzz_body.h"

#include <array>
#include <cstring>
#include <span>
#include <vector>

#include "files/slot_header.h"

namespace kvferry {

int SlotHeaderFuzzOne(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool reseal = (data[0] & 1) != 0;
  std::vector<std::byte> in(size - 1);
  if (size > 1) std::memcpy(in.data(), data + 1, size - 1);
  if (reseal && in.size() >= static_cast<size_t>(kSlotHeaderBytes)) {
    // Seal bytes [0, 56) with a valid checksum at 56, little-endian.
    uint64_t sum = Checksum64(in.data(), kSlotHeaderBytes - 8);
    for (int i = 0; i < 8; ++i) in[kSlotHeaderBytes - 8 + i] = std::byte((sum >> (8 * i)) & 0xff);
  }
  auto h = DecodeSlotHeader(in);
  if (!h.ok()) {
    if (h.status().code() != StatusCode::kDataLoss || h.status().message().empty()) {
      __builtin_trap();
    }
    return 0;
  }
  std::array<std::byte, kSlotHeaderBytes> again{};
  EncodeSlotHeader(*h, again);
  if (std::memcmp(again.data(), in.data(), kSlotHeaderBytes) != 0) __builtin_trap();
  auto h2 = DecodeSlotHeader(again);
  if (!h2.ok() || !(*h2 == *h)) __builtin_trap();
  return 0;
}

}  // namespace kvferry

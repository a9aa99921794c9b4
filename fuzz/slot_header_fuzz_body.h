// The body of the slot header fuzz target, shared by the libFuzzer binary
// (fuzz/slot_header_fuzz.cc, KVFERRY_FUZZ=ON) and a gtest that feeds it 100k random and mutated
// inputs in every build.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvferry {

// Decodes `data` as a slot header. The first byte picks a mode: odd = re-seal the header checksum
// after the mutation (so field validation is reached), even = decode as is. Traps (abort) when a
// property breaks: a decoded header must re-encode to the same 64 bytes and decode again equal.
int SlotHeaderFuzzOne(const uint8_t* data, size_t size);

}  // namespace kvferry

// libFuzzer entry for the slot header decoder. Build: clang, -DKVFERRY_FUZZ=ON; run:
//   build/src/slot_header_fuzz -max_total_time=60
#include <cstddef>
#include <cstdint>

#include "slot_header_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvferry::SlotHeaderFuzzOne(data, size);
}

// libFuzzer target for the context handle and control-message decoders.
// Build: cmake -DKVFERRY_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ ... && ./wire_fuzz
#include "transceiver/wire_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvferry::WireFuzzOne(data, size);
  return 0;
}

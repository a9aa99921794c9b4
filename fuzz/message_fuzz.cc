// libFuzzer target: the control-message decoder (every type), then the context rank's planning of a
// FETCH. Build: CC=clang CXX=clang++ cmake -B build-fuzz -DKVFERRY_FUZZ=ON -DKVFERRY_WITH_CUDA=OFF
// Run:   build-fuzz/fuzz/message_fuzz fuzz/corpus/message_fuzz -max_total_time=60
#include <cstddef>
#include <cstdint>

#include "wire_fuzz_bodies.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvferry::MessageFuzzOne(data, size);
}

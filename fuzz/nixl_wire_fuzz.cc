// libFuzzer target: the NIXL transport's address, key and notification decoders.
// Build: CC=clang CXX=clang++ cmake -B build-fuzz -DKVFERRY_FUZZ=ON -DKVFERRY_WITH_CUDA=OFF
// Run:   build-fuzz/fuzz/nixl_wire_fuzz fuzz/corpus/nixl_wire_fuzz -max_total_time=60
#include <cstddef>
#include <cstdint>

#include "wire_fuzz_bodies.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvferry::NixlWireFuzzOne(data, size);
}

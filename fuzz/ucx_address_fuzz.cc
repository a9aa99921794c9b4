// libFuzzer target: the UCX address text decoder.
// Build: CC=clang CXX=clang++ cmake -B build-fuzz -DKVFERRY_FUZZ=ON -DKVFERRY_WITH_CUDA=OFF
// Run:   build-fuzz/fuzz/ucx_address_fuzz fuzz/corpus/ucx_address_fuzz -max_total_time=60
#include <cstddef>
#include <cstdint>

#include "wire_fuzz_bodies.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvferry::UcxAddressFuzzOne(data, size);
}

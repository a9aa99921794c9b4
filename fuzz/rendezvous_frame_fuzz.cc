// libFuzzer target: the rendezvous frame decoder, read as the server reads a connection.
// Build: CC=clang CXX=clang++ cmake -B build-fuzz -DKVFERRY_FUZZ=ON -DKVFERRY_WITH_CUDA=OFF
// Run:   build-fuzz/src/rendezvous_frame_fuzz fuzz/corpus/rendezvous_frame_fuzz -max_total_time=60
#include <cstddef>
#include <cstdint>

#include "rendezvous_frame_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvferry::RendezvousFrameFuzzOne(data, size);
}

// libFuzzer target: the transfer protocol state machines with a hostile peer (see
// protocol_fuzz_body.h). Build: CC=clang CXX=clang++ cmake -B build-fuzz -DKVFERRY_FUZZ=ON
// -DKVFERRY_WITH_CUDA=OFF. Run: build-fuzz/fuzz/protocol_fuzz fuzz/corpus/protocol_fuzz
#include <cstddef>
#include <cstdint>

#include "protocol_fuzz_body.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvferry::ProtocolFuzzOne(data, size);
}

// The stateful protocol fuzz body, shared by the libFuzzer target (fuzz/protocol_fuzz.cc) and the
// FuzzBodies gtest. One input is a program: a real two-rank ContextSide instance and a one-rank
// GenerationSide over the in-process fabric publish and fetch requests, while a hostile peer on
// the same fabric injects control messages (FETCH with a valid token but hostile fields, CREDIT
// beyond the plan, DONE before data, duplicate or forged COMPLETE, ABORT for another transfer,
// stale and unknown ids, garbage) and cancels interleave.
//
// Properties (a broken one traps):
//   - no crash (ASan/UBSan in the fuzz build);
//   - every request reaches exactly one terminal state on every rank that knows it, within its
//     deadline plus the abort grace plus a scheduling slack;
//   - a request reported complete on the generation side holds the context's data;
//   - no staging slot or lease outlives its request: afterwards a request that needs the single
//     staging slot of every rank goes through.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvferry {

int ProtocolFuzzOne(const uint8_t* data, size_t size);

}  // namespace kvferry

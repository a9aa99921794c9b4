// Fuzz bodies for the wire decoders, shared by the libFuzzer targets (fuzz/*_fuzz.cc, built with
// -DKVFERRY_FUZZ=ON) and the FuzzBodies gtest (fuzz/fuzz_test.cc), which feeds each body the
// checked-in corpus and many mutated inputs in every build.
//
// Each body takes arbitrary bytes; the first byte picks a mode, the rest is the input. Checksums
// and headers are re-sealed on request so that mutations reach field validation and, beyond it,
// the planner and the acceptance checks of the side that would receive the bytes. A body returns
// 0 and traps (__builtin_trap) when a property breaks:
//   - a refusal is kInvalidArgument or kDataLoss with a message;
//   - what decodes re-encodes to the same bytes and decodes again equal;
//   - a plan accepted for hostile input reads and writes only inside the local pool.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvferry {

// Context handle. Mode bit 0: re-seal the checksum. Bits 1..7 pick the local generation instance
// (split, layout, reuse, direct) that plans against the decoded handle.
int HandleFuzzOne(const uint8_t* data, size_t size);

// Control messages. Mode bits 0..3: 1..8 = prepend a valid header of that message type and append
// the seal (since version 3), else the bytes as they are (which must then carry a valid seal). Bit
// 4: a FETCH gets the local context's shape and prompt (re-sealed) so it reaches the context rank's
// planning; bits 5..7 pick the local split/layout.
int MessageFuzzOne(const uint8_t* data, size_t size);

// UCX address text. Mode bit 0: the input is raw worker-address bytes, encoded first (so the
// decoder sees a valid address); otherwise the input is the text.
int UcxAddressFuzzOne(const uint8_t* data, size_t size);

// The NIXL transport's own wire (src/transport/nixl_wire.h). Mode bits 0..1: 0 = address text,
// 1 = packed registration key, 2 = notification header and payload, 3 = all three.
int NixlWireFuzzOne(const uint8_t* data, size_t size);

}  // namespace kvferry

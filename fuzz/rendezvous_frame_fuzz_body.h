// The body of the rendezvous frame fuzz target (docs/wire_format.md, "Rendezvous"), shared by the
// libFuzzer binary (fuzz/rendezvous_frame_fuzz.cc, KVFERRY_FUZZ=ON) and the FuzzBodies gtest.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvferry {

// The first byte picks a mode, the rest is the frame as a server or client would read it. Mode bit
// 0: re-seal both tags under the fuzz key (so that mutations reach field validation); bit 1: also
// set the body length to what follows the sealed header; bit 2: the context of an open connection
// (else all zero, as for HELLO). Reads the input the way the server does (version from the first
// 6 bytes, the sealed header, then the whole frame) and traps when a property breaks:
//   - a refusal is kInvalidArgument with a message;
//   - a verified header announces at most kMaxFrameBytes, and what DecodeFrame takes it verifies;
//   - a decoded frame re-encodes to the same bytes and decodes again equal, and fails under
//     another key or another context.
int RendezvousFrameFuzzOne(const uint8_t* data, size_t size);

}  // namespace kvferry

// A frozen copy of the control messages of wire version 10 (docs/wire_format.md), kept for tests
// of mixed versions: what a rank of the previous build puts on the wire and what it takes from
// it. Written out field by field from the format as version 10 defined it, on purpose sharing
// nothing with src/transceiver/wire/messages.cc but the message structs and base/wire.h's integer
// codecs, so a later change of the current encoder can't change it too. Do not edit it to follow
// the current format: when version 12 comes, this file becomes the copy of version 11 (bodies
// unchanged from 10; 11 differs only in its version byte and in the context rank's behaviour:
// version 10's context rank holds a put pair's last CHUNK until the request is complete, and its
// generation rank refuses a COMPLETE on a pair whose CHUNKs fold it).
//
// Thread-safe (pure functions).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "kvferry/status.h"
#include "transceiver/wire/messages.h"

namespace kvferry::wire_v10 {

inline constexpr uint8_t kVersion = 10;

// Version 10's encoding of `msg` (header, body, seal).
std::vector<std::byte> Encode(const ControlMsg& msg);
// Version 10's decoder: refuses any other version (so a VERSION message, type 10 of version 11,
// and every version-11 message), a bad seal, unknown types, flags and modes, trailing bytes.
StatusOr<ControlMsg> Decode(std::span<const std::byte> bytes);

}  // namespace kvferry::wire_v10

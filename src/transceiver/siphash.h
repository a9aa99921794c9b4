// SipHash-2-4 with a 128-bit tag (Aumasson and Bernstein; the reference implementation's
// vectors_sip128): the keyed MAC behind context handles' access tokens. A pseudo-random function
// of its 16-byte key, designed to authenticate short messages; unlike a keyed XXH3, whose
// outputs leak key material to an observer of many of them, seeing any number of (message, tag)
// pairs does not help make a tag for another message. Thread-compatible, no state.
#pragma once

#include <array>
#include <cstdint>
#include <span>

namespace kvferry {

std::array<uint8_t, 16> SipHash128(const std::array<uint8_t, 16>& key,
                                   std::span<const std::byte> message);

}  // namespace kvferry

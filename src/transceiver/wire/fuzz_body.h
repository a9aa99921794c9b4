// The fuzz body shared by the libFuzzer target (fuzz/wire_fuzz.cc) and the WireFuzz gtest: any
// bytes fed to the handle and control-message decoders must be refused or round-trip exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "transceiver/wire/handle.h"
#include "transceiver/wire/messages.h"

namespace kvferry {

inline void WireFuzzOne(const uint8_t* data, size_t size) {
  auto bytes = std::as_bytes(std::span(data, size));
  if (auto h = DecodeHandle(bytes); h.ok()) {
    auto again = DecodeHandle(EncodeHandle(*h));
    if (!again.ok() || !(*again == *h)) std::abort();
  }
  if (auto m = DecodeMessage(bytes); m.ok()) {
    // Every served version (10, 11) re-encodes to the same bytes in the version it came in.
    if (EncodeMessage(*m, MessageVersionOf(bytes)) != std::vector(bytes.begin(), bytes.end()))
      std::abort();
    auto again = DecodeMessage(EncodeMessage(*m));
    if (!again.ok() || !(*again == *m)) std::abort();
  }
  if (auto v = DecodeVersionMsg(bytes); v.ok()) {
    if (EncodeVersionMsg(*v) != std::vector(bytes.begin(), bytes.end())) std::abort();
  }
}

}  // namespace kvferry

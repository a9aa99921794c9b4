// SipHash-2-4 with a 128-bit output (Aumasson and Bernstein; the reference code's `outlen == 16`):
// kvferry's one keyed MAC, behind rendezvous frames' tags (under the group key) and context
// handles' access tokens (under the instance secret). A pseudo-random function under a 128-bit
// key, in about 60 lines and no dependency; unlike a keyed XXH3 (frame version 1, handle
// version 1), it is designed so that a peer without the key can neither forge a tag nor learn the
// key from any number of (message, tag) pairs it sees.
//
// Incremental: Update() any number of times, then Finish() once. Not thread-safe (a value type).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace kvferry {

class SipHash128 {
 public:
  explicit SipHash128(const std::array<uint8_t, 16>& key);
  void Update(std::span<const std::byte> bytes);
  // The tag: v0^v1^v2^v3 after the first and after the second finalization, each little-endian.
  std::array<std::byte, 16> Finish();

 private:
  void Compress(uint64_t m);

  uint64_t v0_, v1_, v2_, v3_;
  uint64_t tail_ = 0;  // bytes of the current 8-byte block, little-endian
  size_t tail_bytes_ = 0;
  uint64_t length_ = 0;  // bytes so far (its low byte enters the last block)
};

// One message at once: the tag as 16 bytes.
std::array<uint8_t, 16> SipHash128Of(const std::array<uint8_t, 16>& key,
                                     std::span<const std::byte> message);

}  // namespace kvferry

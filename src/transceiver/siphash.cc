#include "transceiver/siphash.h"

#include <bit>

namespace kvferry {
namespace {

uint64_t LoadLe(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

struct State {
  uint64_t v0, v1, v2, v3;
  void Round() {
    v0 += v1;
    v1 = std::rotl(v1, 13);
    v1 ^= v0;
    v0 = std::rotl(v0, 32);
    v2 += v3;
    v3 = std::rotl(v3, 16);
    v3 ^= v2;
    v0 += v3;
    v3 = std::rotl(v3, 21);
    v3 ^= v0;
    v2 += v1;
    v1 = std::rotl(v1, 17);
    v1 ^= v2;
    v2 = std::rotl(v2, 32);
  }
  void Compress(uint64_t m) {
    v3 ^= m;
    Round();
    Round();
    v0 ^= m;
  }
  uint64_t Finalize(uint8_t marker) {
    v2 ^= marker;
    for (int i = 0; i < 4; ++i) Round();
    return v0 ^ v1 ^ v2 ^ v3;
  }
};

}  // namespace

std::array<uint8_t, 16> SipHash128(const std::array<uint8_t, 16>& key,
                                   std::span<const std::byte> message) {
  const uint64_t k0 = LoadLe(key.data(), 8), k1 = LoadLe(key.data() + 8, 8);
  State s{0x736f6d6570736575ULL ^ k0, 0x646f72616e646f6dULL ^ k1, 0x6c7967656e657261ULL ^ k0,
          0x7465646279746573ULL ^ k1};
  s.v1 ^= 0xee;  // 128-bit output
  const auto* p = reinterpret_cast<const uint8_t*>(message.data());
  const size_t n = message.size();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) s.Compress(LoadLe(p + i, 8));
  s.Compress(LoadLe(p + i, n - i) | (uint64_t{n & 0xff} << 56));
  const uint64_t lo = s.Finalize(0xee);
  s.v1 ^= 0xdd;
  const uint64_t hi = s.Finalize(0);
  std::array<uint8_t, 16> out{};
  for (int b = 0; b < 8; ++b) {
    out[b] = static_cast<uint8_t>(lo >> (8 * b));
    out[8 + b] = static_cast<uint8_t>(hi >> (8 * b));
  }
  return out;
}

}  // namespace kvferry

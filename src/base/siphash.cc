#include "base/siphash.h"

namespace kvferry {
namespace {

constexpr uint64_t Rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

uint64_t Le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void Round(uint64_t& v0, uint64_t& v1, uint64_t& v2, uint64_t& v3) {
  v0 += v1;
  v1 = Rotl(v1, 13);
  v1 ^= v0;
  v0 = Rotl(v0, 32);
  v2 += v3;
  v3 = Rotl(v3, 16);
  v3 ^= v2;
  v0 += v3;
  v3 = Rotl(v3, 21);
  v3 ^= v0;
  v2 += v1;
  v1 = Rotl(v1, 17);
  v1 ^= v2;
  v2 = Rotl(v2, 32);
}

}  // namespace

SipHash128::SipHash128(const std::array<uint8_t, 16>& key) {
  const uint64_t k0 = Le64(key.data()), k1 = Le64(key.data() + 8);
  v0_ = 0x736f6d6570736575ULL ^ k0;
  v1_ = 0x646f72616e646f6dULL ^ k1 ^ 0xee;  // 0xee: the 128-bit output
  v2_ = 0x6c7967656e657261ULL ^ k0;
  v3_ = 0x7465646279746573ULL ^ k1;
}

void SipHash128::Compress(uint64_t m) {
  v3_ ^= m;
  Round(v0_, v1_, v2_, v3_);
  Round(v0_, v1_, v2_, v3_);
  v0_ ^= m;
}

void SipHash128::Update(std::span<const std::byte> bytes) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(bytes.data());
  size_t n = bytes.size();
  length_ += n;
  for (; tail_bytes_ != 0 && n > 0; --n) {  // complete a block begun by an earlier Update
    tail_ |= static_cast<uint64_t>(*p++) << (8 * tail_bytes_);
    if (++tail_bytes_ == 8) {
      Compress(tail_);
      tail_ = 0;
      tail_bytes_ = 0;
    }
  }
  for (; n >= 8; n -= 8, p += 8) Compress(Le64(p));  // whole blocks: the bulk of a 1 MiB value
  for (; n > 0; --n) tail_ |= static_cast<uint64_t>(*p++) << (8 * tail_bytes_++);
}

std::array<std::byte, 16> SipHash128::Finish() {
  Compress(tail_ | (length_ << 56));
  std::array<std::byte, 16> out;
  v2_ ^= 0xee;
  for (int half = 0; half < 2; ++half) {
    if (half == 1) v1_ ^= 0xdd;
    for (int i = 0; i < 4; ++i) Round(v0_, v1_, v2_, v3_);
    const uint64_t h = v0_ ^ v1_ ^ v2_ ^ v3_;
    for (int i = 0; i < 8; ++i) out[8 * half + i] = static_cast<std::byte>(h >> (8 * i));
  }
  return out;
}

std::array<uint8_t, 16> SipHash128Of(const std::array<uint8_t, 16>& key,
                                     std::span<const std::byte> message) {
  SipHash128 mac(key);
  mac.Update(message);
  std::array<uint8_t, 16> out;
  const auto tag = mac.Finish();
  for (size_t i = 0; i < out.size(); ++i) out[i] = std::to_integer<uint8_t>(tag[i]);
  return out;
}

}  // namespace kvferry

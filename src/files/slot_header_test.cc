#include "files/slot_header.h"

#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <random>
#include <vector>

#include "../../fuzz/slot_header_fuzz_body.h"

namespace kvferry {
namespace {

SlotHeader Sample() {
  SlotHeader h;
  h.flags = kSlotFlagPayloadChecksum;
  h.key_hi = 0x0102030405060708;
  h.key_lo = 0x1112131415161718;
  h.slot = 17;
  h.payload_bytes = 2 * 1024 * 1024 - 3;
  h.payload_checksum = 0xA1A2A3A4A5A6A7A8;
  return h;
}

std::array<std::byte, kSlotHeaderBytes> Encode(const SlotHeader& h) {
  std::array<std::byte, kSlotHeaderBytes> b{};
  EncodeSlotHeader(h, b);
  return b;
}

TEST(SlotHeader, RoundTrip) {
  SlotHeader h = Sample();
  auto b = Encode(h);
  auto d = DecodeSlotHeader(b);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(*d, h);
}

TEST(SlotHeader, BytesAreLittleEndianAtDocumentedOffsets) {
  auto b = Encode(Sample());
  auto u8 = [&](size_t i) { return static_cast<unsigned>(b[i]); };
  // magic "KVFSLOT\0"
  EXPECT_EQ(std::memcmp(b.data(), "KVFSLOT\0", 8), 0);
  EXPECT_EQ(u8(8), 1u);  // version 1
  EXPECT_EQ(u8(9), 0u);
  EXPECT_EQ(u8(10), 64u);    // header bytes
  EXPECT_EQ(u8(12), 1u);     // flags: payload checksum
  EXPECT_EQ(u8(16), 0x08u);  // key hi, least significant byte first
  EXPECT_EQ(u8(23), 0x01u);
  EXPECT_EQ(u8(24), 0x18u);  // key lo
  EXPECT_EQ(u8(32), 17u);    // slot
  EXPECT_EQ(u8(40), 0xFDu);  // payload bytes 0x1FFFFD
  EXPECT_EQ(u8(41), 0xFFu);
  EXPECT_EQ(u8(42), 0x1Fu);
  EXPECT_EQ(u8(48), 0xA8u);  // payload checksum
  uint64_t sum = 0;
  for (int i = 0; i < 8; ++i) sum |= uint64_t{u8(56 + i)} << (8 * i);
  EXPECT_EQ(sum, Checksum64(b.data(), 56));
}

TEST(SlotHeader, Errors) {
  auto b = Encode(Sample());
  EXPECT_EQ(DecodeSlotHeader(std::span(b).first(63)).status().code(), StatusCode::kDataLoss);

  std::array<std::byte, kSlotHeaderBytes> zero{};
  auto z = DecodeSlotHeader(zero);
  EXPECT_EQ(z.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(z.status().message().find("never written"), std::string_view::npos);

  auto bad = b;
  bad[0] = std::byte{'X'};
  EXPECT_NE(DecodeSlotHeader(bad).status().message().find("bad magic"), std::string_view::npos);

  bad = b;
  bad[20] ^= std::byte{1};  // a key bit
  EXPECT_NE(DecodeSlotHeader(bad).status().message().find("header checksum mismatch"),
            std::string_view::npos);

  SlotHeader v2 = Sample();
  v2.version = 2;
  auto d = DecodeSlotHeader(Encode(v2));
  EXPECT_NE(d.status().message().find("unsupported format version 2"), std::string_view::npos);

  SlotHeader flags = Sample();
  flags.flags = 0x80;
  EXPECT_NE(DecodeSlotHeader(Encode(flags)).status().message().find("unknown header flags"),
            std::string_view::npos);
}

TEST(SlotHeader, ChecksumOfTwoPiecesEqualsWhole) {
  std::vector<uint8_t> v(10000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>(i * 7);
  EXPECT_EQ(Checksum64(v.data(), 4096, v.data() + 4096, v.size() - 4096),
            Checksum64(v.data(), v.size()));
}

// The fuzz target's body over 100k random and mutated inputs, so every CI run exercises it.
TEST(SlotHeaderFuzz, HundredThousandInputs) {
  std::mt19937_64 rng(12345);
  auto seed = Encode(Sample());
  std::vector<uint8_t> in;
  for (int iter = 0; iter < 100000; ++iter) {
    in.assign(1 + kSlotHeaderBytes, 0);
    in[0] = static_cast<uint8_t>(rng());
    int mode = iter % 4;
    if (mode == 0) {  // pure random, random length
      in.resize(rng() % 100);
      for (auto& c : in) c = static_cast<uint8_t>(rng());
    } else {  // a valid header with a few bytes mutated (and maybe re-sealed)
      std::memcpy(in.data() + 1, seed.data(), kSlotHeaderBytes);
      int flips = 1 + static_cast<int>(rng() % 4);
      for (int f = 0; f < flips; ++f)
        in[1 + rng() % kSlotHeaderBytes] = static_cast<uint8_t>(rng());
      if (mode == 3) in.resize(1 + rng() % kSlotHeaderBytes);
    }
    ASSERT_EQ(SlotHeaderFuzzOne(in.data(), in.size()), 0);
  }
  // Unmutated seeds decode in both modes.
  in.assign(1, 0);
  in.insert(in.end(), reinterpret_cast<uint8_t*>(seed.data()),
            reinterpret_cast<uint8_t*>(seed.data()) + seed.size());
  EXPECT_EQ(SlotHeaderFuzzOne(in.data(), in.size()), 0);
}

}  // namespace
}  // namespace kvferry

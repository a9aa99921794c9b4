#include <fmt/format.h>
#include <gtest/gtest.h>

#include <random>

#include "transceiver/wire/fuzz_body.h"
#include "transceiver/wire/handle.h"
#include "transceiver/wire/messages.h"
#include "transceiver/wire/seeds.h"

namespace kvferry {
namespace {

ContextHandle SampleHandle() {
  ContextHandle h;
  h.request_id = 0x0123456789abcdefULL;
  h.token = {9, 8, 7};
  h.shape = KvShape{32, 8, 128, DType::kBf16, 2, 32};
  h.parallel = ParallelConfig{2, 2, {20, 12}, 1, 0};
  h.layout = LayoutKind::kPerLayer;
  h.pool_blocks = 100;
  h.prompt_tokens = 70;
  h.layer_wise = true;
  h.ctx_direct = false;
  h.chunk_bytes = 1 << 20;
  h.blocks = {4, 5, 6};
  h.addresses = {"a", "bb", "ccc", "dddd"};
  return h;
}

TEST(Handle, RoundTripsAndStartsWithItsMagic) {
  ContextHandle h = SampleHandle();
  auto bytes = EncodeHandle(h);
  EXPECT_EQ(std::to_integer<int>(bytes[0]), 'K');
  EXPECT_EQ(std::to_integer<int>(bytes[3]), 'H');
  auto back = DecodeHandle(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, h);
}

// Issue 26 item 1: a custom layout travels as its region split and strides (elements).
TEST(Handle, CustomLayoutTravelsWithItsSplitAndStrides) {
  ContextHandle h = SampleHandle();
  h.layout = LayoutKind::kCustom;
  h.split = RegionSplit::kPerLayer;
  // [block][kv][head][token][dim] per layer, each block padded by 256 elements.
  h.strides = {2 * 8 * 32 * 128 + 256, 0, 8 * 32 * 128, 32 * 128, 128, 1};
  auto back = DecodeHandle(EncodeHandle(h));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, h);
  EXPECT_EQ(back->strides, h.strides);

  FetchMsg f = SmallSeedFetch();
  static_cast<InstanceDesc&>(f) = static_cast<const InstanceDesc&>(h);
  auto msg = DecodeMessage(EncodeMessage(f));
  ASSERT_TRUE(msg.ok()) << msg.status().ToString();
  ASSERT_TRUE(std::holds_alternative<FetchMsg>(*msg));
  EXPECT_EQ(std::get<FetchMsg>(*msg), f);
  f.strides[kTokenAxis] += 1;  // the strides are plan inputs
  EXPECT_NE(std::get<FetchMsg>(*msg).plan_inputs(), f.plan_inputs());

  ContextHandle bad = h;
  bad.split = static_cast<RegionSplit>(7);
  auto st = DecodeHandle(EncodeHandle(bad)).status();
  EXPECT_NE(st.message().find("layout.split 7 is unknown"), std::string_view::npos)
      << st.ToString();
  bad = h;
  bad.strides[kHeadAxis] = -128;
  st = DecodeHandle(EncodeHandle(bad)).status();
  EXPECT_NE(st.message().find("layout.strides[3] -128 is negative"), std::string_view::npos)
      << st.ToString();
  // A named layout carries no strides: its bytes are those of before (the golden files agree).
  ContextHandle named = SampleHandle();
  ContextHandle custom_bytes_named = named;
  custom_bytes_named.strides = {1, 2, 3, 4, 5, 1};
  EXPECT_EQ(EncodeHandle(named), EncodeHandle(custom_bytes_named));
}

// Issue 26 item 3: an instance's KV scales travel after its layout (bit 7 of the layout byte),
// in handles and FETCH; without scales the bytes are those of before.
TEST(Handle, ScalesTravelAfterTheLayout) {
  ContextHandle h = SampleHandle();
  h.shape.dtype = DType::kFp8E4M3;
  h.scales.granularity = ScaleGranularity::kTensor;
  for (int i = 0; i < 64; ++i) h.scales.values.push_back(0.5f + i);
  for (LayoutKind layout : {LayoutKind::kPerLayer, LayoutKind::kCustom}) {
    h.layout = layout;
    if (layout == LayoutKind::kCustom)
      h.strides = {2 * 8 * 32 * 128, 0, 8 * 32 * 128, 32 * 128, 128, 1};
    auto back = DecodeHandle(EncodeHandle(h));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, h);
  }
  FetchMsg f = SmallSeedFetch();
  f.scales = KvScales{ScaleGranularity::kHead, std::vector<float>(4 * 2 * 4, 0.25f)};
  auto msg = DecodeMessage(EncodeMessage(f));
  ASSERT_TRUE(msg.ok()) << msg.status().ToString();
  EXPECT_EQ(std::get<FetchMsg>(*msg), f);
  FetchMsg other = f;
  other.scales.values[3] = 0.5f;  // scales are plan inputs
  EXPECT_NE(std::get<FetchMsg>(*msg).plan_inputs(), other.plan_inputs());

  ContextHandle bad = h;
  bad.scales.granularity = static_cast<ScaleGranularity>(4);
  auto st = DecodeHandle(EncodeHandle(bad)).status();
  EXPECT_NE(st.message().find("scales.granularity 4 is unknown"), std::string_view::npos)
      << st.ToString();
  bad = h;
  bad.scales.values.clear();
  st = DecodeHandle(EncodeHandle(bad)).status();
  EXPECT_FALSE(st.ok());
  // Per block: no values (they live in the pools and travel with the chunks), and none accepted.
  ContextHandle block = h;
  block.scales = KvScales{ScaleGranularity::kBlock, {}};
  auto back = DecodeHandle(EncodeHandle(block));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, block);
  block.scales.values = {1.0f};
  EXPECT_FALSE(DecodeHandle(EncodeHandle(block)).ok());
  // No scales: the layout byte and everything after it as before.
  ContextHandle plain = SampleHandle();
  ContextHandle none = plain;
  none.scales.values = {1, 2};  // ignored without a granularity
  EXPECT_EQ(EncodeHandle(plain), EncodeHandle(none));
}

// Issue 29: the token authenticated (request id, blocks, tokens) only, so a handle with its
// layout byte or layer-wise flag altered kept a valid token and was served with wrong KV. The
// token of version 2 is the instance's MAC over every byte but itself and the checksum: changing
// any one of them (and recomputing the checksum, as a forger would) breaks it.
TEST(Handle, TokenAuthenticatesEveryByte) {
  const std::array<uint8_t, 16> secret{1, 2, 3, 4};
  auto [bytes, token] = SealHandle(SampleHandle(), secret);
  auto h = DecodeHandle(bytes);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->token, token);
  EXPECT_EQ(HandleToken(secret, HandleDigestOf(bytes)), token);
  EXPECT_NE(HandleToken({1, 2, 3, 5}, HandleDigestOf(bytes)), token);
  ContextHandle altered = *h;
  altered.layout = LayoutKind::kBlockMajor;
  EXPECT_NE(HandleToken(secret, HandleDigestOf(EncodeHandle(altered))), token) << "layout";
  altered = *h;
  altered.layer_wise = !altered.layer_wise;
  EXPECT_NE(HandleToken(secret, HandleDigestOf(EncodeHandle(altered))), token) << "layer-wise";
  altered = *h;
  altered.addresses[1] = "evil";
  EXPECT_NE(HandleToken(secret, HandleDigestOf(EncodeHandle(altered))), token) << "address";
  // Every byte outside the token and the checksum is covered.
  for (size_t i = 0; i + 8 < bytes.size(); ++i) {
    if (i >= 16 && i < 32) continue;
    auto b = bytes;
    b[i] ^= std::byte{0x01};
    EXPECT_NE(HandleDigestOf(b), HandleDigestOf(bytes)) << "byte " << i;
  }
}

TEST(Handle, RefusesEveryTruncationAndBitFlip) {
  auto bytes = EncodeHandle(SampleHandle());
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(DecodeHandle(std::span(bytes).first(n)).ok()) << "truncated to " << n;
  }
  for (size_t i = 0; i < bytes.size(); ++i) {
    auto b = bytes;
    b[i] ^= std::byte{0x10};
    EXPECT_FALSE(DecodeHandle(b).ok()) << "bit flip at " << i;
  }
}

TEST(Handle, RefusesInconsistentFields) {
  ContextHandle h = SampleHandle();
  h.addresses.pop_back();
  auto st = DecodeHandle(EncodeHandle(h)).status();
  EXPECT_NE(st.message().find("3 addresses"), std::string_view::npos) << st.ToString();
  h = SampleHandle();
  h.parallel.tp = 3;
  EXPECT_FALSE(DecodeHandle(EncodeHandle(h)).ok());
}

TEST(Handle, RefusesAWorldSizeThatWouldWrap) {
  // tp * pp = 2^32 wraps int32 to 0, which 0 addresses would have matched.
  ContextHandle h = SampleHandle();
  h.shape.layers = 1 << 17;
  h.shape.kv_heads = 1;
  h.parallel = ParallelConfig{1 << 16, 1 << 16, {}, 1, 0};
  h.addresses.clear();
  auto st = DecodeHandle(EncodeHandle(h)).status();  // re-sealed: a valid checksum
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tp=65536 * pp=65536"), std::string_view::npos) << st.ToString();
}

TEST(Handle, TokenDependsOnSecretAndContents) {
  std::array<uint8_t, 16> a{1}, b{2};
  ContextHandle h = SampleHandle();
  EXPECT_EQ(SealHandle(h, a).second, SealHandle(h, a).second);
  EXPECT_NE(SealHandle(h, a).second, SealHandle(h, b).second);
  ContextHandle other = h;
  other.request_id += 1;
  EXPECT_NE(SealHandle(h, a).second, SealHandle(other, a).second);
  other = h;
  other.prompt_tokens += 1;
  EXPECT_NE(SealHandle(h, a).second, SealHandle(other, a).second);
}

// A FETCH offering peer memory handles (Device::ExportMemory bytes, opaque here).
FetchMsg PeerFetch() {
  FetchMsg f;
  f.request_id = 3;
  f.shape = KvShape{4, 2, 8, DType::kFp16, 2, 16};
  f.parallel = ParallelConfig{1, 1, {}, 1, 0};
  f.rma = true;
  f.rma_target.pool = {RemoteRegion{0x1000, 4096, {std::byte{1}}}};
  f.rma_target.staging = RemoteRegion{0x2000, 4096, {std::byte{2}}};
  f.rma_target.peer_pool = {{std::byte{'k'}, std::byte{'v'}, std::byte{'p'}, std::byte{'m'}}};
  return f;
}

TEST(Messages, PeerHandlesMustMatchTheRegionsAndChunkCountsMustBePositive) {
  FetchMsg f = PeerFetch();
  f.rma_target.peer_pool.push_back({std::byte{1}});  // one region and the per-block scales
  auto back = DecodeMessage(EncodeMessage(f));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(std::get<FetchMsg>(*back), f);
  f.rma_target.peer_pool.push_back({std::byte{1}});  // three handles for one region
  auto st = DecodeMessage(EncodeMessage(f)).status();
  EXPECT_NE(st.message().find("3 peer pool handles for 1 rma regions"), std::string_view::npos)
      << st.ToString();
  f = PeerFetch();
  f.rma_target.peer_pool[0].clear();
  EXPECT_FALSE(DecodeMessage(EncodeMessage(f)).ok()) << "an empty handle";
  // Flag 4 (peer pool handles follow) with a count of 0 for 0 regions: a form the encoder never
  // writes, so it must not decode (the fuzzer found that it did, and re-encoded 4 bytes shorter).
  f = PeerFetch();
  f.rma_target.pool.clear();
  f.rma_target.peer_pool = {{std::byte{'x'}}};  // encoded as count 1, length 1, 'x', then the seal
  auto bytes = EncodeMessage(f);
  bytes.resize(bytes.size() - kMessageSealBytes - 9);
  for (int i = 0; i < 4; ++i) bytes.push_back(std::byte{0});  // count 0
  const uint64_t seal = MessageSeal(bytes);
  for (size_t i = 0; i < kMessageSealBytes; ++i)
    bytes.push_back(std::byte((seal >> (8 * i)) & 0xff));
  st = DecodeMessage(bytes).status();
  EXPECT_NE(st.message().find("0 peer pool handles for 0 rma regions"), std::string_view::npos)
      << st.ToString();
  st = DecodeMessage(EncodeMessage(ChunkMsg{1, 2, 3, 0, false, 0})).status();
  EXPECT_NE(st.message().find("chunk count 0"), std::string_view::npos) << st.ToString();
  // CHUNK flags: bit 0 checksum, bit 1 complete; never both, no other bit.
  ChunkMsg both{1, 2, 3, 1, true, 9};
  both.complete = true;
  st = DecodeMessage(EncodeMessage(both)).status();
  EXPECT_NE(st.message().find("a chunk that says complete carries no checksum"),
            std::string_view::npos)
      << st.ToString();
  bytes = EncodeMessage(ChunkMsg{1, 2, 3, 1, false, 0});
  bytes.resize(bytes.size() - kMessageSealBytes);
  bytes[bytes.size() - 9] = std::byte{4};  // the flags byte, before the u64 checksum
  const uint64_t chunk_seal = MessageSeal(bytes);
  for (size_t i = 0; i < kMessageSealBytes; ++i)
    bytes.push_back(std::byte((chunk_seal >> (8 * i)) & 0xff));
  st = DecodeMessage(bytes).status();
  EXPECT_NE(st.message().find("chunk flags 0x4 has unknown bits"), std::string_view::npos)
      << st.ToString();
}

TEST(Messages, EveryTypeRoundTrips) {
  FetchMsg f;
  f.request_id = 9;
  f.token[3] = 7;
  f.gen_instance = 77;
  f.gen_rank = 3;
  f.transfer_id = 1234;
  f.shape = KvShape{4, 2, 8, DType::kFp8E4M3, 1, 16};
  f.parallel = ParallelConfig{4, 1, {}, 2, 1};
  f.pool_blocks = 50;
  f.prompt_tokens = 33;
  f.reused_blocks = 1;
  f.chunk_bytes = 4096;
  f.direct_min_bytes = 1 << 18;
  f.blocks = {1, 2, 3};
  f.reply_address = "inproc:3";
  FetchMsg rma = f;
  rma.checksum = true;
  rma.rma = true;
  rma.rma_target.pool = {RemoteRegion{0x1000, 4096, {std::byte{1}, std::byte{2}}},
                         RemoteRegion{0x9000, 8192, {std::byte{3}}}};
  rma.rma_target.staging = RemoteRegion{0x20000, 65536, {std::byte{4}, std::byte{5}}};
  rma.rma_target.slot_bytes = 16384;
  rma.rma_target.slots = 4;
  rma.rma_target.row_min_bytes = 8192;
  FetchMsg peer = rma;
  peer.rma_target.peer_pool = {{std::byte{7}, std::byte{8}}, {std::byte{9}}};
  for (const ControlMsg& m : std::vector<ControlMsg>{
           f, rma, AcceptMsg{1, 2, false}, AcceptMsg{1, 2, true}, RejectMsg{1, 2, 3, "no"},
           CreditMsg{1, 2, 9, {}}, CreditMsg{1, 2, 9, {3, kNoSlot, 0}}, DoneMsg{1, 2, 99},
           AbortMsg{1, 2, 4, "late"}, CompleteMsg{5, 6}, ChunkMsg{1, 2, 3, 1, true, 0xfeedbeef},
           ChunkMsg{1, 2, 3, 1, false, 0}, ChunkMsg{1, 2, 3, 40, false, 0}, peer,
           AcceptMsg{1, 2, true, true}, ChunkMsg{1, 2, 3, 40, false, 0, true},
           SiblingMsg{1, {9, 8, 7}, 3, 0, {}}, SiblingMsg{1, {1}, 0, 4, "timed out"}}) {
    auto bytes = EncodeMessage(m);
    auto back = DecodeMessage(bytes);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, m);
    for (size_t n = 0; n < bytes.size(); ++n)
      EXPECT_FALSE(DecodeMessage(std::span(bytes).first(n)).ok());
    // Any bit flipped on the way is refused (the seal), whichever field it lands in: a FETCH's
    // layout or target decides where a context rank puts.
    for (size_t i = 0; i < bytes.size(); ++i) {
      for (int bit : {0, 6}) {
        std::vector<std::byte> flipped = bytes;
        flipped[i] ^= std::byte(1 << bit);
        auto st = DecodeMessage(flipped);
        EXPECT_FALSE(st.ok()) << "byte " << i << " bit " << bit;
      }
    }
    bytes.push_back(std::byte{0});
    EXPECT_FALSE(DecodeMessage(bytes).ok()) << "trailing bytes";
  }
}

// A context rank plans once per request and again only for a FETCH whose plan inputs differ
// (context_side_fetch.cc): the one value compares every field it plans with, and nothing else.
TEST(Messages, FetchPlanInputsCompareEveryPlanFieldAndNothingElse) {
  FetchMsg a;
  a.shape = KvShape{4, 2, 8, DType::kFp16, 2, 16};
  a.parallel = ParallelConfig{2, 1, {}, 1, 0};
  a.pool_blocks = 8;
  a.prompt_tokens = 20;
  a.chunk_bytes = 4096;
  a.blocks = {1, 2};
  const std::vector<void (*)(FetchMsg&)> plan_changes = {
      [](FetchMsg& f) { f.shape.head_dim = 16; },
      [](FetchMsg& f) { f.parallel.tp = 1; },
      [](FetchMsg& f) { f.parallel.stage_layers = {4}; },
      [](FetchMsg& f) { f.parallel.dp_rank = 1; },
      [](FetchMsg& f) { f.layout = LayoutKind::kPerLayer; },
      [](FetchMsg& f) { f.pool_blocks = 9; },
      [](FetchMsg& f) { f.prompt_tokens = 21; },
      [](FetchMsg& f) { f.reused_blocks = 1; },
      [](FetchMsg& f) { f.chunk_bytes = 2048; },
      [](FetchMsg& f) { f.direct_min_bytes = 1; },
      [](FetchMsg& f) { f.blocks[1] = 3; },
  };
  for (size_t i = 0; i < plan_changes.size(); ++i) {
    FetchMsg b = a;
    plan_changes[i](b);
    EXPECT_NE(a.plan_inputs(), b.plan_inputs()) << "change " << i;
  }
  FetchMsg other_rank = a;  // what differs between the generation ranks of one request
  other_rank.gen_rank = 1;
  other_rank.transfer_id = 7;
  other_rank.reply_address = "inproc:9";
  other_rank.checksum = true;
  other_rank.rma = true;
  other_rank.rma_target.slots = 4;
  EXPECT_EQ(a.plan_inputs(), other_rank.plan_inputs());
  EXPECT_NE(a, other_rank);
}

// The fuzz body over mutated valid encodings and random bytes, so CI exercises the decoders.
TEST(WireFuzz, MutatedInputsAreRefusedOrRoundTrip) {
  std::mt19937_64 rng(1234);
  std::vector<std::vector<std::byte>> seeds = {EncodeHandle(SampleHandle()),
                                               EncodeMessage(AcceptMsg{1, 2, false}),
                                               EncodeMessage(RejectMsg{3, 4, 5, "why"}),
                                               EncodeMessage(CreditMsg{1, 2, 3, {4, 5}}),
                                               EncodeMessage(ChunkMsg{1, 2, 3, 1, true, 4}),
                                               EncodeMessage(PeerFetch()),
                                               EncodeMessage(AcceptMsg{1, 2, true, true}),
                                               EncodeMessage(ChunkMsg{1, 2, 0, 3, false, 0, true}),
                                               EncodeMessage(SiblingMsg{1, {2}, 3, 4, "why"})};
  for (int i = 0; i < 50000; ++i) {
    std::vector<std::byte> in = seeds[rng() % seeds.size()];
    int flips = 1 + rng() % 4;
    for (int f = 0; f < flips && !in.empty(); ++f) in[rng() % in.size()] = std::byte(rng() & 0xff);
    if (rng() % 4 == 0) in.resize(rng() % (in.size() + 1));
    if (rng() % 8 == 0) {
      in.resize(rng() % 128);
      for (auto& b : in) b = std::byte(rng() & 0xff);
    }
    WireFuzzOne(reinterpret_cast<const uint8_t*>(in.data()), in.size());
  }
}

}  // namespace
}  // namespace kvferry

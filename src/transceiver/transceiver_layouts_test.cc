// The transceiver's delivery matrix over the in-process transport: every named and custom layout,
// parallel split, dtype and scale conversion over every data path (tagged, one-sided packed or
// row by row, peer memory), each request's generation elements and sentinel bytes checked against
// the test-data generator. transceiver_test.cc holds the protocol, fault and refusal cases.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "kvferry/config.h"
#include "kvferry/transceiver.h"
#include "testing/testdata.h"
#include "testing/transceiver_test_cluster.h"
#include "transceiver/engine/engine.h"

namespace kvferry {
namespace {

using namespace txtest;  // NOLINT: the shared harness
struct Case {
  const char* name;
  SideSpec ctx, gen;
  int ctx_group = 0, gen_group = 0;
};

// Each layout over every data path: tagged messages, one-sided puts (with small rows packed, or
// every row put pool to pool), and copies into the mapped peer pool; with per-chunk checksums.
enum class Path { kTagged, kRmaPacked, kRmaRows, kPeer };
class Layouts : public ::testing::TestWithParam<std::tuple<Case, Path>> {};

std::string LayoutCaseName(const ::testing::TestParamInfo<std::tuple<Case, Path>>& info) {
  static const char* const kPaths[] = {"tagged", "rma_packed", "rma_rows", "peer"};
  return std::string(std::get<0>(info.param).name) + "_" +
         kPaths[static_cast<int>(std::get<1>(info.param))];
}

// One request of case `c` over `path`: five scattered blocks, ending mid-block, every element and
// every sentinel byte of the generation pools checked.
void DeliverOverPath(const Case& c, Path path, bool checksum) {
  TransceiverOptions o;
  o.chunk_bytes = 4096;  // force packing into several chunks
  o.staging_chunks = 3;
  o.direct_min_bytes = 2048;
  o.rma = path != Path::kTagged;
  o.checksum = checksum;
  ASSERT_TRUE(Config::Global()
                  .Set("transfer.rma_row_min_bytes", path == Path::kRmaRows ? "1" : "256")
                  .ok());
  ASSERT_TRUE(
      Config::Global().Set("transfer.peer_memory", path == Path::kPeer ? "on" : "off").ok());
  Cluster cl(c.ctx, c.gen, o);
  std::vector<int64_t> cb{3, 4, 9, 1, 12}, gb{0, 5, 6, 2, 11};
  const int64_t tokens = 4 * 4 + 3;  // ends mid-block
  auto h = cl.Publish(11, cb, tokens, c.ctx_group);
  ASSERT_FALSE(h.empty());
  ASSERT_TRUE(cl.Fetch(h, gb, 0, c.gen_group).ok());
  size_t ranks =
      Cluster::Group(c.ctx, c.ctx_group).size() + Cluster::Group(c.gen, c.gen_group).size();
  ExpectAllComplete(cl.Drain(c.ctx_group, c.gen_group, 1), ranks);
  cl.Verify(11, gb, tokens, 0, c.gen_group, /*sentinels=*/true);
  // Peer memory is offered and taken, converting too (per-block scales included), unless a
  // converting pair sums its chunks packed.
  InstanceDesc ctx_desc, gen_desc;
  ctx_desc.shape = c.ctx.shape;
  ctx_desc.scales = c.ctx.scales;
  gen_desc.shape = c.gen.shape;
  gen_desc.scales = c.gen.scales;
  if (path == Path::kPeer && !(checksum && Converts(ctx_desc, gen_desc))) {
    const int g = Cluster::Group(c.gen, c.gen_group).front();
    EXPECT_EQ(cl.gen_[g]->metrics().data_path, "peer-memory");
  }
  EXPECT_TRUE(Config::Global().Reset("transfer.rma_row_min_bytes").ok());
  EXPECT_TRUE(Config::Global().Reset("transfer.peer_memory").ok());
}

TEST_P(Layouts, DeliversEveryElement) {
  DeliverOverPath(std::get<0>(GetParam()), std::get<1>(GetParam()), /*checksum=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    Transceiver, Layouts,
    ::testing::Combine(
        ::testing::Values(
            Case{"tp1_to_tp1", {Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}},
            Case{"tp2_to_tp4", {Shape(), {2, 1, {}, 1, 0}}, {Shape(), {4, 1, {}, 1, 0}}},
            Case{"tp4_to_tp2", {Shape(), {4, 1, {}, 1, 0}}, {Shape(), {2, 1, {}, 1, 0}}},
            Case{"tp2pp3_to_tp1pp2_uneven",
                 {Shape(), {2, 3, {1, 4, 1}, 1, 0}},
                 {Shape(), {1, 2, {}, 1, 0}}},
            Case{
                "dup_heads_tp1_to_tp4", {Shape(2), {1, 1, {}, 1, 0}}, {Shape(2), {4, 1, {}, 1, 0}}},
            Case{
                "dup_heads_tp4_to_tp2", {Shape(2), {4, 1, {}, 1, 0}}, {Shape(2), {2, 1, {}, 1, 0}}},
            Case{"tp3_to_tp2", {Shape(6), {3, 1, {}, 1, 0}}, {Shape(6), {2, 1, {}, 1, 0}}},
            Case{
                "mla_tp2_to_tp4", {Shape(1, 1), {2, 1, {}, 1, 0}}, {Shape(1, 1), {4, 2, {}, 1, 0}}},
            Case{"block_major_to_per_layer",
                 {Shape(), {2, 1, {}, 1, 0}},
                 {Shape(), {1, 2, {}, 1, 0}, LayoutKind::kPerLayer}},
            Case{"per_layer_to_block_major",
                 {Shape(), {1, 1, {}, 1, 0}, LayoutKind::kPerLayer},
                 {Shape(), {2, 1, {}, 1, 0}}},
            Case{"ctx_dp2_group1_to_gen_tp2",
                 {Shape(), {4, 1, {}, 2, 0}},
                 {Shape(), {2, 1, {}, 1, 0}},
                 1,
                 0},
            Case{"ctx_tp2_to_gen_dp2_group1",
                 {Shape(), {2, 1, {}, 1, 0}},
                 {Shape(), {4, 1, {}, 2, 0}},
                 0,
                 1},
            Case{"int8_fp32",
                 {Shape(4, 2, DType::kInt8), {1, 2, {}, 1, 0}},
                 {Shape(4, 2, DType::kInt8), {2, 1, {}, 1, 0}}}),
        ::testing::Values(Path::kTagged, Path::kRmaPacked, Path::kRmaRows, Path::kPeer)),
    LayoutCaseName);

// Custom layouts travel (issue 26 item 1): handles and FETCH messages carry the strides of pools
// no named layout describes (K/V outside the layers with padded blocks, heads outermost in a
// layer's region, one region per kv), on every data path, with splits and a dtype change.
class CustomLayouts : public ::testing::TestWithParam<std::tuple<Case, Path>> {};

TEST_P(CustomLayouts, DeliverEveryElement) {
  const Case& c = std::get<0>(GetParam());
  const bool converts = c.ctx.shape.dtype != c.gen.shape.dtype;
  DeliverOverPath(c, std::get<1>(GetParam()), /*checksum=*/!converts);
}

INSTANTIATE_TEST_SUITE_P(
    Transceiver, CustomLayouts,
    ::testing::Combine(
        ::testing::Values(
            Case{"kv_outside_layers_tp2_to_heads_outermost_tp4",
                 CustomSide(Shape(), {2, 1, {}, 1, 0}, RegionSplit::kNone,
                            {kBlockAxis, kKvAxis, kLayerAxis, kTokenAxis, kHeadAxis, kDimAxis}, 40),
                 CustomSide(Shape(), {4, 1, {}, 1, 0}, RegionSplit::kPerLayer,
                            {kHeadAxis, kBlockAxis, kKvAxis, kTokenAxis, kDimAxis}, 0)},
            Case{"per_kv_pp2_to_per_layer_hnd",
                 CustomSide(Shape(), {1, 2, {}, 1, 0}, RegionSplit::kPerKv,
                            {kLayerAxis, kBlockAxis, kHeadAxis, kTokenAxis, kDimAxis}, 16),
                 {Shape(), {2, 1, {}, 1, 0}, LayoutKind::kPerLayerHnd}},
            Case{"block_major_tp4_to_custom_fp16_tp2",
                 {Shape(4, 2, DType::kBf16), {4, 1, {}, 1, 0}},
                 CustomSide(Shape(4, 2, DType::kFp16), {2, 1, {}, 1, 0}, RegionSplit::kPerLayerKv,
                            {kTokenAxis, kBlockAxis, kHeadAxis, kDimAxis}, 8)}),
        ::testing::Values(Path::kTagged, Path::kRmaPacked, Path::kRmaRows, Path::kPeer)),
    LayoutCaseName);

// Dtype conversion (issue 26): the context side converts while packing, on every data path a
// pair can take (the peer-memory and row-put paths fall back to packing), and every generation
// element is the context one converted by Stream::ConvertBatch's rules (the values are random bit
// patterns: NaNs, infinities, subnormals and overflow included).
class Conversions : public ::testing::TestWithParam<std::tuple<Case, Path>> {};

TEST_P(Conversions, DeliverEveryElementConverted) {
  DeliverOverPath(std::get<0>(GetParam()), std::get<1>(GetParam()), /*checksum=*/false);
}

// With checksums: the context side sums each chunk as packed (converted) in staging, the
// generation side the same bytes in its pool; a pair offered peer memory packs instead.
TEST_P(Conversions, ChecksummedDeliverEveryElementConverted) {
  DeliverOverPath(std::get<0>(GetParam()), std::get<1>(GetParam()), /*checksum=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    Transceiver, Conversions,
    ::testing::Combine(
        ::testing::Values(
            Case{"bf16_tp2_to_fp8_tp4_per_layer",
                 {Shape(4, 2, DType::kBf16), {2, 1, {}, 1, 0}},
                 {Shape(4, 2, DType::kFp8E4M3), {4, 1, {}, 1, 0}, LayoutKind::kPerLayer}},
            Case{"fp8_per_layer_hnd_to_bf16_tp2",
                 {Shape(4, 2, DType::kFp8E4M3), {1, 1, {}, 1, 0}, LayoutKind::kPerLayerHnd},
                 {Shape(4, 2, DType::kBf16), {2, 1, {}, 1, 0}}},
            Case{"fp16_tp4_to_bf16_tp2",
                 {Shape(4, 2, DType::kFp16), {4, 1, {}, 1, 0}},
                 {Shape(4, 2, DType::kBf16), {2, 1, {}, 1, 0}, LayoutKind::kPerLayerKvHnd}},
            Case{"fp32_pp2_to_fp16",
                 {Shape(4, 2, DType::kFp32), {1, 2, {}, 1, 0}},
                 {Shape(4, 2, DType::kFp16), {1, 1, {}, 1, 0}, LayoutKind::kPerLayer}},
            Case{"mla_bf16_to_fp32_dup",
                 {Shape(1, 1, DType::kBf16), {2, 1, {}, 1, 0}},
                 {Shape(1, 1, DType::kFp32), {4, 1, {}, 1, 0}}}),
        ::testing::Values(Path::kTagged, Path::kRmaPacked, Path::kRmaRows, Path::kPeer)),
    LayoutCaseName);

// Scales (issue 26 item 3): quantized with the generation's scales, dequantized with the
// context's, requantized between both (fp8 -> fp8), per tensor and per head, on every data path,
// with and without checksums.
INSTANTIATE_TEST_SUITE_P(
    Scales, Conversions,
    ::testing::Combine(
        ::testing::Values(
            Case{"bf16_tp2_to_fp8_tp4_per_tensor",
                 {Shape(4, 2, DType::kBf16), {2, 1, {}, 1, 0}},
                 WithScales({Shape(4, 2, DType::kFp8E4M3), {4, 1, {}, 1, 0}, LayoutKind::kVllmNhd},
                            ScaleGranularity::kTensor, 0.02f)},
            Case{"fp8_per_head_hnd_to_bf16_tp2",
                 WithScales({Shape(4, 2, DType::kFp8E4M3), {1, 1, {}, 1, 0}, LayoutKind::kVllmHnd},
                            ScaleGranularity::kHead, 0.3f),
                 {Shape(4, 2, DType::kBf16), {2, 1, {}, 1, 0}}},
            Case{"fp8_per_tensor_tp4_to_fp8_per_head_tp2",
                 WithScales({Shape(4, 2, DType::kFp8E4M3), {4, 1, {}, 1, 0}},
                            ScaleGranularity::kTensor, 0.5f),
                 WithScales(
                     {Shape(4, 2, DType::kFp8E4M3), {2, 1, {}, 1, 0}, LayoutKind::kPerLayerKvHnd},
                     ScaleGranularity::kHead, 0.05f)},
            Case{"mla_fp16_to_fp8_dup",
                 {Shape(1, 1, DType::kFp16), {2, 1, {}, 1, 0}},
                 WithScales({Shape(1, 1, DType::kFp8E4M3), {4, 1, {}, 1, 0}},
                            ScaleGranularity::kTensor, 0.01f)}),
        ::testing::Values(Path::kTagged, Path::kRmaPacked, Path::kRmaRows, Path::kPeer)),
    LayoutCaseName);

// Per-block scales (issue 26 item 3): the generation's computed from each block's values (toward
// fp8), the context's read (from fp8), or travelling (fp8 -> fp8 per block), on every data path
// (a pair offered peer memory or row puts packs), with and without checksums; the generation's
// scales are checked too (CheckBlock).
INSTANTIATE_TEST_SUITE_P(
    BlockScales, Conversions,
    ::testing::Combine(
        ::testing::Values(
            Case{"bf16_tp2_to_fp8_per_block_tp4_nhd",
                 {Shape(4, 2, DType::kBf16), {2, 1, {}, 1, 0}},
                 WithScales({Shape(4, 2, DType::kFp8E4M3), {4, 1, {}, 1, 0}, LayoutKind::kVllmNhd},
                            ScaleGranularity::kBlock, 0)},
            Case{"fp8_per_block_hnd_to_bf16_tp2",
                 WithScales({Shape(4, 2, DType::kFp8E4M3), {1, 1, {}, 1, 0}, LayoutKind::kVllmHnd},
                            ScaleGranularity::kBlock, 0),
                 {Shape(4, 2, DType::kBf16), {2, 1, {}, 1, 0}}},
            Case{"fp8_per_block_tp4_to_fp8_per_block_tp2_pp2",
                 WithScales({Shape(4, 2, DType::kFp8E4M3), {4, 1, {}, 1, 0}},
                            ScaleGranularity::kBlock, 0),
                 WithScales(
                     {Shape(4, 2, DType::kFp8E4M3), {2, 2, {}, 1, 0}, LayoutKind::kPerLayerKvHnd},
                     ScaleGranularity::kBlock, 0)},
            Case{"fp8_per_tensor_to_fp8_per_block",
                 WithScales({Shape(4, 2, DType::kFp8E4M3), {2, 1, {}, 1, 0}},
                            ScaleGranularity::kTensor, 0.5f),
                 WithScales({Shape(4, 2, DType::kFp8E4M3), {1, 1, {}, 1, 0}, LayoutKind::kPerLayer},
                            ScaleGranularity::kBlock, 0)},
            Case{"mla_fp16_to_fp8_per_block_dup",
                 {Shape(1, 1, DType::kFp16), {2, 1, {}, 1, 0}},
                 WithScales({Shape(1, 1, DType::kFp8E4M3), {4, 1, {}, 1, 0}},
                            ScaleGranularity::kBlock, 0)}),
        ::testing::Values(Path::kTagged, Path::kRmaPacked, Path::kRmaRows, Path::kPeer)),
    LayoutCaseName);
}  // namespace
}  // namespace kvferry

#include "kvferry/kv_model.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

namespace kvferry {
namespace {

KvShape Llama8B() { return KvShape{32, 8, 128, DType::kBf16, 2, 32}; }

TEST(DType, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kFp32), 4);
  EXPECT_EQ(DTypeSize(DType::kBf16), 2);
  EXPECT_EQ(DTypeSize(DType::kFp8E4M3), 1);
  EXPECT_EQ(*ParseDType("bf16"), DType::kBf16);
  EXPECT_EQ(*ParseDType("int8"), DType::kInt8);
  EXPECT_NE(ParseDType("fp64").status().message().find("fp64"), std::string_view::npos);
}

TEST(KvShape, BytesPerTokenMatchesModels) {
  EXPECT_EQ(Llama8B().BytesPerToken(), 128 * 1024);
  KvShape l70{80, 8, 128, DType::kBf16, 2, 32};
  EXPECT_EQ(l70.BytesPerToken(), 320 * 1024);
  KvShape mla{61, 1, 576, DType::kBf16, 1, 64};
  EXPECT_EQ(mla.BytesPerToken(), 61 * 576 * 2);
}

TEST(KvShape, ValidationNamesTheValue) {
  KvShape s = Llama8B();
  s.kv_factor = 3;
  EXPECT_NE(s.Validate().message().find("kv_factor=3"), std::string_view::npos);
  s = Llama8B();
  s.tokens_per_block = 0;
  EXPECT_NE(s.Validate().message().find("tokens_per_block=0"), std::string_view::npos);
}

TEST(ParallelConfig, DefaultSplitGivesFirstStagesTheExtraLayer) {
  EXPECT_EQ(DefaultStageLayers(10, 3), (std::vector<int32_t>{4, 3, 3}));
  EXPECT_EQ(DefaultStageLayers(11, 3), (std::vector<int32_t>{4, 4, 3}));
  EXPECT_EQ(DefaultStageLayers(4, 4), (std::vector<int32_t>{1, 1, 1, 1}));
}

TEST(ParallelConfig, ValidationErrors) {
  KvShape s = Llama8B();
  ParallelConfig p;
  p.tp = 3;  // 8 heads over 3 ranks: neither divides
  Status st = p.Validate(s);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("kv_heads=8"), std::string_view::npos) << st.ToString();
  EXPECT_NE(st.message().find("TP=3"), std::string_view::npos) << st.ToString();
  p = ParallelConfig{};
  p.pp = 2;
  p.stage_layers = {20, 11};
  EXPECT_NE(p.Validate(s).message().find("sum to 31"), std::string_view::npos);
  p.stage_layers = {32, 0};
  EXPECT_NE(p.Validate(s).message().find("stage 1 has 0"), std::string_view::npos);
  p = ParallelConfig{};
  p.pp = 40;
  EXPECT_NE(p.Validate(s).message().find("pp=40"), std::string_view::npos);
  p = ParallelConfig{};
  p.tp = 4;
  p.dp_size = 3;
  EXPECT_NE(p.Validate(s).message().find("dp_size=3"), std::string_view::npos);
  p.dp_size = 2;
  p.dp_rank = 2;
  EXPECT_NE(p.Validate(s).message().find("dp_rank=2"), std::string_view::npos);
  // Duplicated heads: 2 KV heads over TP 8 is fine, and so is 6 heads over TP 3.
  s.kv_heads = 2;
  EXPECT_TRUE((ParallelConfig{8, 1, {}, 1, 0}).Validate(s).ok());
  s.kv_heads = 6;
  EXPECT_TRUE((ParallelConfig{3, 1, {}, 1, 0}).Validate(s).ok());
}

TEST(RankSlice, HeadsLayersAndDuplicates) {
  KvShape s = Llama8B();
  ParallelConfig p{2, 3, {}, 1, 0};  // 32 layers over 3 stages: 11, 11, 10
  auto r = SliceOf(s, p, 5);         // pp 2, tp 1
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->pp_rank, 2);
  EXPECT_EQ(r->tp_rank, 1);
  EXPECT_EQ(r->layer_begin, 22);
  EXPECT_EQ(r->layer_count, 10);
  EXPECT_EQ(r->head_begin, 4);
  EXPECT_EQ(r->head_count, 4);
  // 2 KV heads over TP 8: four replicas of each head.
  s.kv_heads = 2;
  auto d = SliceOf(s, ParallelConfig{8, 1, {}, 1, 0}, 5);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->head_begin, 1);
  EXPECT_EQ(d->head_count, 1);
  EXPECT_EQ(d->head_replicas, 4);
  EXPECT_EQ(d->replica_index, 1);
  // Attention DP: TP 4 in 2 groups of 2; rank 3 is group 1, attention-TP rank 1.
  s.kv_heads = 8;
  auto a = SliceOf(s, ParallelConfig{4, 1, {}, 2, 0}, 3);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->dp_group, 1);
  EXPECT_EQ(a->head_begin, 4);
  EXPECT_EQ(a->head_count, 4);
  EXPECT_EQ(SliceOf(s, ParallelConfig{4, 1, {}, 1, 0}, 4).status().code(),
            StatusCode::kInvalidArgument);
  // Uneven stages given explicitly.
  auto u = SliceOf(s, ParallelConfig{1, 3, {5, 20, 7}, 1, 0}, 2);
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->layer_begin, 25);
  EXPECT_EQ(u->layer_count, 7);
}

TEST(PoolLayout, BlockMajorStridesAndPrinting) {
  PoolLayout l = PoolLayout::BlockMajor({64, 32, 2, 8, 32, 128}, 2);
  EXPECT_EQ(l.strides(), (PoolStrides{2097152, 65536, 32768, 4096, 128, 1}));
  EXPECT_EQ(
      l.ToString(),
      "block-major (blk,L,kv,h,t,d)=(64,32,2,8,32,128):(2097152,65536,32768,4096,128,1) 2B/elem");
  EXPECT_EQ(l.block_bytes(), 4 << 20);
  EXPECT_EQ(l.total_bytes(), 64LL * (4 << 20));
  EXPECT_TRUE(l.block_contiguous());
  EXPECT_EQ(l.ByteOffset(1, 2, 1, 3, 4, 5),
            (2097152 + 2 * 65536 + 32768 + 3 * 4096 + 4 * 128 + 5) * 2);
  EXPECT_EQ(l.Extents(l.WholeBlock(3)), (std::vector<Extent>{{0, 3LL * (4 << 20), 4 << 20}}));
}

TEST(PoolLayout, PerLayerStridesAndRegions) {
  PoolLayout l = PoolLayout::PerLayer({10, 4, 2, 8, 16, 64}, 2);
  EXPECT_EQ(l.num_regions(), 4);
  EXPECT_EQ(l.strides()[kHeadAxis], 64);
  EXPECT_EQ(l.strides()[kTokenAxis], 8 * 64);
  EXPECT_EQ(l.strides()[kBlockAxis], 16 * 8 * 64);
  EXPECT_EQ(l.strides()[kKvAxis], 10 * 16 * 8 * 64);
  EXPECT_EQ(l.region_bytes(), 2LL * 10 * 16 * 8 * 64 * 2);
  EXPECT_FALSE(l.block_contiguous());
  // A whole block: per layer, K and V are each one contiguous run of tokens*heads*dim.
  auto e = l.Extents(l.WholeBlock(1));
  ASSERT_EQ(e.size(), 8u);
  EXPECT_EQ(e[0], (Extent{0, 16 * 8 * 64 * 2, 16 * 8 * 64 * 2}));
  EXPECT_EQ(e[1].region, 0);
  EXPECT_EQ(e[2].region, 1);
  // A head slice of a per-layer pool is scattered: one run per token.
  BlockBox heads{1, {0, 1}, {0, 1}, {2, 4}, {0, 16}};
  EXPECT_EQ(l.Extents(heads).size(), 16u);
}

TEST(PoolLayout, EnginePresetsNamesAndRegions) {
  for (LayoutKind k : NamedLayoutKinds()) {
    auto parsed = ParseLayoutKind(LayoutKindName(k));
    ASSERT_TRUE(parsed.ok()) << LayoutKindName(k);
    EXPECT_EQ(*parsed, k);
  }
  EXPECT_FALSE(ParseLayoutKind("custom").ok());
  EXPECT_NE(ParseLayoutKind("nhd").status().message().find("flashinfer-hnd"),
            std::string_view::npos);
  const PoolDims d{10, 4, 2, 8, 16, 64};
  // K and V tensors per layer: 8 regions, layer-major, each [block][token][head][dim].
  PoolLayout kv = PoolLayout::PerLayerKv(d, 2, HeadOrder::kNhd);
  EXPECT_EQ(kv.num_regions(), 8);
  EXPECT_EQ(kv.RegionOf(2, 1), 5);
  EXPECT_EQ(kv.RegionLayers(5), (Range{2, 3}));
  EXPECT_EQ(kv.RegionKv(5), (Range{1, 2}));
  EXPECT_EQ(kv.region_bytes(), 10LL * 16 * 8 * 64 * 2);
  EXPECT_TRUE(kv.block_contiguous() == false);
  auto e = kv.Extents(kv.WholeBlock(3));
  ASSERT_EQ(e.size(), 8u);  // one run per (layer, kv) region
  EXPECT_EQ(e[5], (Extent{5, 3LL * 16 * 8 * 64 * 2, 16 * 8 * 64 * 2}));
  // FlashInfer HND: per layer [block][kv][head][token][dim]; a block of a layer is one run.
  PoolLayout fi = PoolLayout::FlashInfer(d, 2, HeadOrder::kHnd);
  EXPECT_EQ(fi.strides(), (PoolStrides{2 * 8 * 16 * 64, 0, 8 * 16 * 64, 16 * 64, 64, 1}));
  EXPECT_EQ(fi.Extents(fi.WholeBlock(1)).size(), 4u);
  EXPECT_EQ(fi.ToString(),
            "flashinfer-hnd (blk,L,kv,h,t,d)=(10,4,2,8,16,64):(16384,0,8192,1024,64,1) regions "
            "per-layer 2B/elem");
  // The same strides given explicitly name the preset; one stride off does not.
  auto same = PoolLayout::Custom(d, fi.strides(), RegionSplit::kPerLayer, 2);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->kind(), LayoutKind::kFlashInferHnd);
  EXPECT_EQ(*same, fi);
  PoolStrides off = fi.strides();
  off[kBlockAxis] += 64;
  EXPECT_EQ(PoolLayout::Custom(d, off, RegionSplit::kPerLayer, 2)->kind(), LayoutKind::kCustom);
}

// vLLM's CPU backend: kv_caches[l] = [block][head][token][2*dim], each (block, head) page the
// block's K rows then its V rows, i.e. [block][head][kv][token][dim] per layer.
TEST(PoolLayout, VllmCpuPreset) {
  const PoolDims d{10, 4, 2, 8, 16, 64};
  PoolLayout cpu = PoolLayout::VllmCpu(d, 4);
  EXPECT_EQ(cpu.strides(), (PoolStrides{8 * 2 * 16 * 64, 0, 16 * 64, 2 * 16 * 64, 64, 1}));
  EXPECT_EQ(cpu.num_regions(), 4);
  EXPECT_EQ(cpu.region_bytes(), 10LL * 8 * 16 * 2 * 64 * 4);
  EXPECT_EQ(cpu.ToString(),
            "vllm-cpu (blk,L,kv,h,t,d)=(10,4,2,8,16,64):(16384,0,1024,2048,64,1) regions "
            "per-layer 4B/elem");
  // A block of a layer is one run; the K half of one head's page is one run of 16 tokens.
  EXPECT_EQ(cpu.Extents(cpu.WholeBlock(2)).size(), 4u);
  EXPECT_EQ(cpu.Extents(BlockBox{2, {1, 2}, {0, 1}, {3, 4}, {0, 16}}),
            (std::vector<Extent>{{1, (2LL * 16384 + 3 * 2048) * 4, 16 * 64 * 4}}));
  // torch's byte strides of that tensor, viewed as (block, -, kv, head, token, dim), name it.
  auto same = PoolLayout::FromByteStrides(d, {16384 * 4, 0, 1024 * 4, 2048 * 4, 64 * 4, 4},
                                          RegionSplit::kPerLayer, 4);
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_EQ(same->kind(), LayoutKind::kVllmCpu);
  EXPECT_EQ(*ParseLayoutKind("vllm-cpu"), LayoutKind::kVllmCpu);
}

// vLLM 0.32's CUDA backends: per layer a logical [B][H][T][2*D] tensor, K then V in the content
// dim (flash_attn.py: kv_cache.transpose(1, 2).split(head_size, dim=-1)), its stride order the KV
// cache layout: LBHNC (physical [B][H][T][2D]) or LBNHC ([B][T][H][2D]).
TEST(PoolLayout, VllmCudaLayoutsPackKAndVInTheContentDim) {
  const PoolDims d{10, 4, 2, 8, 16, 64};
  auto hnd = *PoolLayout::Make(LayoutKind::kVllmHnd, d, 2);
  EXPECT_EQ(hnd.ToString(),
            "vllm-hnd (blk,L,kv,h,t,d)=(10,4,2,8,16,64):(16384,0,64,2048,128,1) regions "
            "per-layer 2B/elem");
  auto nhd = *PoolLayout::Make(LayoutKind::kVllmNhd, d, 2);
  EXPECT_EQ(nhd.ToString(),
            "vllm-nhd (blk,L,kv,h,t,d)=(10,4,2,8,16,64):(16384,0,64,128,1024,1) regions "
            "per-layer 2B/elem");
  // One head's K of one token is one run of 64 elements; its K and V together one of 128.
  EXPECT_EQ(hnd.Extents(BlockBox{2, {1, 2}, {0, 1}, {3, 4}, {5, 6}}),
            (std::vector<Extent>{{1, (2LL * 16384 + 3 * 2048 + 5 * 128) * 2, 64 * 2}}));
  EXPECT_EQ(nhd.Extents(BlockBox{2, {1, 2}, {0, 2}, {3, 4}, {5, 6}}),
            (std::vector<Extent>{{1, (2LL * 16384 + 5 * 1024 + 3 * 128) * 2, 128 * 2}}));
  // torch's byte strides of the LBNHC tensor viewed as (block, -, kv, head, token, dim).
  auto same = PoolLayout::FromByteStrides(d, {16384 * 2, 0, 64 * 2, 128 * 2, 1024 * 2, 2},
                                          RegionSplit::kPerLayer, 2);
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_EQ(same->kind(), LayoutKind::kVllmNhd);
  EXPECT_EQ(*ParseLayoutKind("vllm-hnd"), LayoutKind::kVllmHnd);
}

TEST(PoolLayout, CoalescesPartialRanges) {
  PoolLayout l = PoolLayout::BlockMajor({4, 2, 2, 4, 8, 16}, 1);
  // First 3 tokens of each (layer, kv, head) plane: 2*2*4 runs of 3*16 bytes.
  BlockBox b{0, {0, 2}, {0, 2}, {0, 4}, {0, 3}};
  auto e = l.Extents(b);
  ASSERT_EQ(e.size(), 16u);
  EXPECT_EQ(e[1].offset - e[0].offset, 8 * 16);
  EXPECT_EQ(e[0].bytes, 3 * 16);
  // Heads 1..3 of all tokens: contiguous within each (layer, kv).
  BlockBox h{0, {0, 2}, {0, 2}, {1, 3}, {0, 8}};
  EXPECT_EQ(l.Extents(h).size(), 4u);
  // Two neighbouring whole blocks appended: one extent.
  std::vector<Extent> out;
  l.AppendExtents(l.WholeBlock(1), out);
  l.AppendExtents(l.WholeBlock(2), out);
  EXPECT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].bytes, 2 * l.block_bytes());
}

TEST(PoolLayout, BoxErrors) {
  PoolLayout l = PoolLayout::BlockMajor({4, 2, 2, 4, 8, 16}, 1);
  EXPECT_NE(l.CheckBox(l.WholeBlock(4)).message().find("block id 4"), std::string_view::npos);
  BlockBox b = l.WholeBlock(0);
  b.tokens = {0, 9};
  EXPECT_NE(l.CheckBox(b).message().find("tokens range [0, 9)"), std::string_view::npos);
  b.tokens = {3, 3};
  EXPECT_FALSE(l.CheckBox(b).ok());
}

TEST(PoolLayout, CustomRejectsAliasing) {
  PoolDims d{2, 2, 2, 2, 4, 8};
  auto ok = PoolLayout::Custom(d, {256, 128, 64, 32, 8, 1}, false, 2);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  auto bad = PoolLayout::Custom(d, {256, 128, 64, 16, 8, 1}, false, 2);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("aliases"), std::string_view::npos);
  EXPECT_FALSE(PoolLayout::Custom(d, {256, 128, 64, 32, 1, 8}, false, 2).ok());
}

// Extents cover exactly the bytes of the box's elements, in both presets and a custom layout.
TEST(PoolLayout, ExtentsCoverExactlyTheBox) {
  std::mt19937 rng(42);
  PoolDims d{3, 3, 2, 4, 5, 4};
  std::vector<PoolLayout> layouts = {
      // [layer][block][token][kv][head][dim], one region (an engine with token-major pages).
      *PoolLayout::Custom(d, {160, 480, 16, 4, 32, 1}, false, 2),
      // K and V tensors, each [layer][block][token][head][dim] (regions split by kv only).
      *PoolLayout::Custom(d, {80, 240, 0, 4, 16, 1}, RegionSplit::kPerKv, 2)};
  for (LayoutKind k : NamedLayoutKinds()) layouts.push_back(*PoolLayout::Make(k, d, 2));
  for (const PoolLayout& l : layouts) {
    for (int trial = 0; trial < 300; ++trial) {
      auto pick = [&](int64_t n) {
        int64_t a = rng() % n, b = rng() % n;
        return Range{std::min(a, b), std::max(a, b) + 1};
      };
      BlockBox box{static_cast<int64_t>(rng() % d[0]), pick(d[1]), pick(d[2]), pick(d[3]),
                   pick(d[4])};
      std::set<std::pair<int, int64_t>> want, got;
      for (int64_t ly = box.layers.begin; ly < box.layers.end; ++ly)
        for (int64_t kv = box.kv.begin; kv < box.kv.end; ++kv)
          for (int64_t h = box.heads.begin; h < box.heads.end; ++h)
            for (int64_t t = box.tokens.begin; t < box.tokens.end; ++t)
              for (int64_t x = 0; x < d[5]; ++x)
                for (int b = 0; b < 2; ++b)
                  want.insert({l.RegionOf(ly, kv), l.ByteOffset(box.block, ly, kv, h, t, x) + b});
      auto ext = l.Extents(box);
      for (size_t i = 0; i < ext.size(); ++i) {
        if (i > 0 && ext[i].region == ext[i - 1].region) {
          EXPECT_NE(ext[i - 1].offset + ext[i - 1].bytes, ext[i].offset)
              << "neighbours not coalesced";
        }
        for (int64_t b = 0; b < ext[i].bytes; ++b) got.insert({ext[i].region, ext[i].offset + b});
      }
      ASSERT_EQ(want, got) << l.ToString();
    }
  }
}

// ---- hostile sizes: refused with a named error, never wrapped (signed overflow is UB) --------

TEST(KvShape, SizesThatOverflowAreRefused) {
  KvShape huge{1 << 30, 1 << 30, 1 << 30, DType::kFp32, 2, 1 << 30};
  Status st = huge.Validate();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("overflows int64"), std::string_view::npos) << st.ToString();
  EXPECT_EQ(huge.BytesPerToken(), -1);
  // A block that just fits is fine; one token per block more overflows.
  KvShape edge{1 << 20, 1, 1 << 20, DType::kInt8, 1, 1 << 22};  // 2^62 bytes per block
  EXPECT_TRUE(edge.Validate().ok()) << edge.Validate().ToString();
  edge.tokens_per_block = 1 << 23;
  EXPECT_FALSE(edge.Validate().ok());
}

TEST(ParallelConfig, WorldSizeBeyondTheLimitIsRefused) {
  KvShape shape{1 << 20, 1, 8, DType::kBf16, 1, 4};
  ParallelConfig p{1 << 16, 1 << 16, {}, 1, 0};  // tp * pp = 2^32 would wrap int32 to 0
  Status st = p.Validate(shape);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("tp=65536 * pp=65536"), std::string_view::npos) << st.ToString();
  EXPECT_FALSE(SliceOf(shape, p, 0).ok());
  p = ParallelConfig{kMaxWorldSize, 1, {}, 1, 0};
  EXPECT_TRUE(p.Validate(shape).ok());
}

TEST(PoolLayout, DimsWhoseSizeOverflowsAreRefused) {
  PoolDims dims{int64_t{1} << 40, 80, 2, 8, 32, 128};  // 2^40 blocks of 5 MiB
  for (LayoutKind k : {LayoutKind::kBlockMajor, LayoutKind::kPerLayer}) {
    auto l = PoolLayout::Make(k, dims, 2);
    ASSERT_FALSE(l.ok()) << LayoutKindName(k);
    EXPECT_NE(l.status().message().find("overflows int64"), std::string_view::npos)
        << l.status().ToString();
  }
  EXPECT_TRUE(PoolLayout::Make(LayoutKind::kBlockMajor, {1 << 20, 80, 2, 8, 32, 128}, 2).ok());
  // Custom strides: each axis steps over the ones below, and the last one runs off int64.
  PoolStrides strides{int64_t{1} << 50, 1 << 20, 1 << 19, 1 << 16, 1 << 7, 1};
  auto c = PoolLayout::Custom({1 << 14, 2, 2, 8, 512, 128}, strides, false, 2);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("overflows int64"), std::string_view::npos)
      << c.status().ToString();
  EXPECT_TRUE(PoolLayout::Custom({4, 2, 2, 8, 512, 128}, strides, false, 2).ok());
}

// Command-line layouts: a named one, or custom strides as split, axis order and padding.
TEST(LayoutSpec, ParsesNamedAndCustomAndSaysWhatIsWrong) {
  auto named = LayoutSpec::Parse("vllm-hnd");
  ASSERT_TRUE(named.ok()) << named.status().ToString();
  EXPECT_EQ(named->kind, LayoutKind::kVllmHnd);
  EXPECT_EQ(named->ToString(), "vllm-hnd");

  const std::string text = "custom:per-layer:head,block,kv,token,dim:pad=64";
  auto spec = LayoutSpec::Parse(text);
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->kind, LayoutKind::kCustom);
  EXPECT_EQ(spec->split, RegionSplit::kPerLayer);
  EXPECT_EQ(spec->ToString(), text);
  // [head][block][kv][token][dim] over (blk,L,kv,h,t,d) = (10, 3, 2, 4, 8, 16): a block is
  // 2*8*16 = 256 elements plus 64 of padding, a head 10 such blocks.
  const PoolDims span{10, 3, 2, 4, 8, 16};
  EXPECT_EQ(spec->Strides(span), (PoolStrides{320, 0, 128, 3200, 16, 1}));
  auto layout = spec->Make({10, 3, 2, 2, 8, 16}, span, 2);  // a rank with half the heads
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  EXPECT_EQ(layout->strides(), (PoolStrides{320, 0, 128, 3200, 16, 1}));
  EXPECT_EQ(layout->num_regions(), 3);

  for (const auto& [bad, why] : std::vector<std::pair<std::string, std::string>>{
           {"custom:per-layer:block,kv,layer,head,token,dim", "axis 'layer' selects a region"},
           {"custom:one:block,layer,kv,head,dim", "axis 'token' is missing"},
           {"custom:one:block,layer,kv,head,token,token,dim", "axis 'token' twice"},
           {"custom:one:block,layer,kv,head,dim,token", "dim must be the last"},
           {"custom:per-head:block,layer,kv,head,token,dim", "unknown region split 'per-head'"},
           {"custom:one:block,layer,kv,heads,token,dim", "unknown axis 'heads'"},
           {"custom:one:block,layer,kv,head,token,dim:pad=-1", "bad padding 'pad=-1'"},
           {"custom:one", "wrong number of ':' fields"},
           {"per-layers", "unknown layout 'per-layers'"}}) {
    auto st = LayoutSpec::Parse(bad).status();
    EXPECT_NE(st.message().find(why), std::string_view::npos) << bad << ": " << st.ToString();
  }
}

}  // namespace
}  // namespace kvferry

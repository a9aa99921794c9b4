// The planner's test matrix: every configuration is planned, executed on CPU pools and checked
// byte for byte (see RunCase).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "testing/planner_test_util.h"

namespace kvferry::planner_test {
namespace {

// ---- the matrix ---------------------------------------------------------------------------------

// Every valid ctx (TP, PP) x gen (TP, PP) for kv_heads 8, 6 and 2 (TP in {1,2,3,4,6,8}, PP in
// {1,2,3}, 7 layers), all four layout pairs, all five prompt lengths; block ids, reuse and
// chunking rotate with the case index so that each meets every other often.
TEST(PlannerMatrix, TpPpLayoutsPrompts) {
  CountConfigs count;
  const int64_t tpb = 4;
  const int64_t prompts[] = {1, tpb - 1, tpb, tpb + 1, 5 * tpb + 3};
  const int64_t chunks[] = {4 << 20, 100, 48};
  const int64_t directs[] = {256 << 10, 0, 64};
  int idx = 0;
  for (int32_t kvh : kKvHeads) {
    KvShape shape{7, kvh, 8, DType::kBf16, 2, tpb};
    auto configs = ValidConfigs(shape);
    for (const ParallelConfig& cp : configs) {
      for (const ParallelConfig& gp : configs) {
        for (LayoutKind cl : kLayouts) {
          for (LayoutKind gl : kLayouts) {
            for (int64_t prompt : prompts) {
              Case c = PairCase(shape, cp, gp, cl, gl);
              c.prompt = prompt;
              c.block_pattern = idx % 3;
              c.reused = (idx % 7 == 3) ? std::min<int64_t>(1, Needed(c) - 1) : 0;
              c.chunk_bytes = chunks[(idx / 3) % 3];
              c.direct_min = directs[(idx / 9) % 3];
              c.layer_wise = idx % 4 == 1;
              ++idx;
              RunCase(c);
              if (HasFailure()) return;
            }
          }
        }
      }
    }
  }
}

// Who fetches from whom (wire version 8), over every valid split pair, with and without every
// block reused: both sides derive the same pairs (g fetches from c exactly when c expects g);
// every pair that moves data is on the lists; a pair on the lists that moves nothing belongs to a
// context rank that sends nothing to anyone, and then only the group's first generation rank
// fetches from it; every context rank hears from someone.
TEST(PlannerMatrix, FetchListsAgreeOnBothSides) {
  int checked = 0;
  for (int32_t kvh : kKvHeads) {
    KvShape shape{7, kvh, 8, DType::kBf16, 2, 4};
    auto configs = ValidConfigs(shape);
    for (const ParallelConfig& cp : configs) {
      for (const ParallelConfig& gp : configs) {
        for (int64_t reused : {0, 2}) {
          Case c;
          c.shape = shape;
          c.ctx = cp;
          c.gen = gp;
          c.prompt = 7;
          c.reused = reused;
          const PlanInput in = MakeInput(c);
          auto plan = PlanTransfer(in);
          ASSERT_TRUE(plan.ok()) << plan.status().ToString();
          std::set<std::pair<int32_t, int32_t>> moving, by_gen, by_ctx;
          for (const PairPlan& p : plan->pairs) moving.insert({p.ctx_rank, p.gen_rank});
          for (int32_t g = 0; g < gp.world_size(); ++g) {
            auto ctx = CtxRanksToFetch(in, g);
            ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
            ASSERT_TRUE(std::is_sorted(ctx->begin(), ctx->end()));
            for (int32_t r : *ctx) by_gen.insert({r, g});
          }
          for (int32_t r = 0; r < cp.world_size(); ++r) {
            auto gen = GenRanksFetching(in, r);
            ASSERT_TRUE(gen.ok()) << gen.status().ToString();
            ASSERT_TRUE(std::is_sorted(gen->begin(), gen->end()));
            EXPECT_FALSE(gen->empty()) << c.Name() << " context rank " << r;
            for (int32_t g : *gen) by_ctx.insert({r, g});
            if (plan->gen_peers_of_ctx[r].empty()) {
              EXPECT_EQ(*gen, std::vector<int32_t>{0}) << c.Name() << " context rank " << r;
            }
          }
          EXPECT_EQ(by_gen, by_ctx) << c.Name();
          for (const auto& pair : moving) EXPECT_TRUE(by_gen.count(pair)) << c.Name();
          for (const auto& [r, g] : by_gen) {
            if (!moving.count({r, g})) {
              EXPECT_TRUE(plan->gen_peers_of_ctx[r].empty()) << c.Name() << " " << r << g;
            }
          }
          ++checked;
          if (HasFailure()) return;
        }
      }
    }
  }
  std::printf("checked %d split pairs\n", checked);
}

// Every prompt length x reuse x block pattern on a few representative splits.
TEST(PlannerMatrix, PromptLengthsReuseAndBlockIds) {
  CountConfigs count;
  const int64_t tpb = 4;
  const std::pair<ParallelConfig, ParallelConfig> splits[] = {{{1, 1, {}, 1, 0}, {1, 1, {}, 1, 0}},
                                                              {{2, 1, {}, 1, 0}, {4, 1, {}, 1, 0}},
                                                              {{4, 2, {}, 1, 0}, {2, 3, {}, 1, 0}},
                                                              {{8, 1, {}, 1, 0}, {1, 2, {}, 1, 0}}};
  for (const auto& [cp, gp] : splits) {
    for (int64_t prompt : {int64_t{1}, tpb - 1, tpb, tpb + 1, 2 * tpb, 5 * tpb + 3}) {
      const int64_t n = (prompt + tpb - 1) / tpb;
      for (int64_t reused = 0; reused <= n; ++reused) {
        for (int pattern = 0; pattern < 3; ++pattern) {
          for (LayoutKind cl : kLayouts) {
            for (LayoutKind gl : kLayouts) {
              Case c = PairCase(KvShape{5, 8, 16, DType::kFp16, 2, tpb}, cp, gp, cl, gl);
              c.prompt = prompt;
              c.reused = reused;
              c.block_pattern = pattern;
              RunCase(c);
              if (HasFailure()) return;
            }
          }
        }
      }
    }
  }
}

TEST(PlannerMatrix, UnevenPipelineStages) {
  CountConfigs count;
  KvShape shape{7, 4, 8, DType::kFp32, 2, 4};
  const std::vector<ParallelConfig> configs = {{1, 3, {1, 4, 2}, 1, 0}, {2, 3, {3, 3, 1}, 1, 0},
                                               {4, 2, {6, 1}, 1, 0},    {1, 2, {2, 5}, 1, 0},
                                               {2, 3, {}, 1, 0},        {1, 1, {}, 1, 0}};
  for (const auto& cp : configs) {
    for (const auto& gp : configs) {
      for (LayoutKind cl : kLayouts) {
        for (LayoutKind gl : kLayouts) {
          Case c = PairCase(shape, cp, gp, cl, gl);
          c.prompt = 9;
          c.block_pattern = 1;
          c.chunk_bytes = 200;
          c.direct_min = 32;
          RunCase(c);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(PlannerMatrix, Mla) {
  CountConfigs count;
  KvShape shape{5, 1, 16, DType::kInt8, 1, 4};
  std::vector<ParallelConfig> configs;
  for (int32_t tp : {1, 2, 4, 3}) {
    for (int32_t pp : {1, 2}) configs.push_back({tp, pp, {}, 1, 0});
  }
  configs.push_back({4, 1, {}, 4, 2});  // attention DP: each rank its own group
  configs.push_back({4, 2, {}, 2, 1});
  configs.push_back({8, 1, {}, 4, 3});
  for (const auto& cp : configs) {
    for (const auto& gp : configs) {
      for (LayoutKind cl : kLayouts) {
        for (LayoutKind gl : kLayouts) {
          Case c = PairCase(shape, cp, gp, cl, gl);
          c.prompt = 11;
          c.block_pattern = 2;
          c.chunk_bytes = 64;
          c.direct_min = 16;
          RunCase(c);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(PlannerMatrix, AttentionDataParallel) {
  CountConfigs count;
  // kv_heads 4: DP groups with attention TP 1, 2, 4 (and duplication when attention TP > 4).
  KvShape shape{4, 4, 8, DType::kBf16, 2, 4};
  std::vector<ParallelConfig> configs = {
      {4, 1, {}, 2, 0}, {4, 1, {}, 2, 1}, {4, 1, {}, 4, 3}, {8, 1, {}, 2, 1},  // 8/2: 4 heads/4
      {8, 2, {}, 4, 2}, {2, 2, {}, 2, 1}, {2, 1, {}, 1, 0}, {4, 2, {}, 1, 0},
      {8, 1, {}, 1, 0},  // duplicated heads without DP
  };
  for (const auto& cp : configs) {
    for (const auto& gp : configs) {
      for (LayoutKind cl : kLayouts) {
        for (LayoutKind gl : kLayouts) {
          Case c = PairCase(shape, cp, gp, cl, gl);
          c.prompt = 13;
          c.reused = 1;
          c.block_pattern = 1;
          c.chunk_bytes = 96;
          RunCase(c);
          if (HasFailure()) return;
        }
      }
    }
  }
  // Duplicated heads inside DP groups: kv_heads 2, attention TP 4 on either side.
  KvShape dup{3, 2, 8, DType::kBf16, 2, 4};
  for (const auto& [cp, gp] : std::vector<std::pair<ParallelConfig, ParallelConfig>>{
           {{8, 1, {}, 2, 1}, {2, 1, {}, 1, 0}},
           {{2, 1, {}, 1, 0}, {8, 1, {}, 2, 1}},
           {{8, 1, {}, 2, 0}, {8, 3, {}, 2, 1}},
           {{6, 1, {}, 1, 0}, {4, 1, {}, 1, 0}}}) {
    Case c;
    c.shape = dup;
    c.ctx = cp;
    c.gen = gp;
    c.prompt = 7;
    RunCase(c);
  }
}

TEST(PlannerMatrix, ChunkingExtremes) {
  CountConfigs count;
  // chunk_bytes smaller than one row (rows split by bytes), equal to one row, odd sizes; direct
  // thresholds from 0 (every contiguous piece direct) to huge (nothing direct).
  for (int64_t chunk : {1, 7, 16, 33, 1000, 1 << 30}) {
    for (int64_t direct : {int64_t{0}, int64_t{1}, int64_t{100}, int64_t{1} << 40}) {
      for (LayoutKind cl : kLayouts) {
        for (LayoutKind gl : kLayouts) {
          Case c;
          c.shape = KvShape{3, 4, 8, DType::kBf16, 2, 4};
          c.ctx = {2, 1, {}, 1, 0};
          c.gen = {4, 2, {}, 1, 0};
          c.ctx_layout = cl;
          c.gen_layout = gl;
          c.prompt = 10;
          c.chunk_bytes = chunk;
          c.direct_min = direct;
          RunCase(c);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST(Planner, SingleBlockAndTightPools) {
  CountConfigs count;
  for (int64_t prompt : {int64_t{1}, int64_t{3}, int64_t{4}, int64_t{9}}) {
    for (int pattern = 0; pattern < 3; ++pattern) {
      for (LayoutKind cl : kLayouts) {
        for (LayoutKind gl : kLayouts) {
          Case c;
          c.shape = KvShape{3, 2, 4, DType::kFp32, 2, 4};
          c.ctx = {2, 1, {}, 1, 0};
          c.gen = {1, 3, {}, 1, 0};
          c.ctx_layout = cl;
          c.gen_layout = gl;
          c.prompt = prompt;
          c.block_pattern = pattern;
          c.tight_pools = true;
          c.direct_min = 16;
          RunCase(c);
          if (HasFailure()) return;
        }
      }
    }
  }
}

// The block ids, reuse (up to max_reused blocks), chunking and layer-wise flag of case `idx` of a
// matrix: each cycles on its own period, so the cases cover their combinations.
void VaryBlocksAndChunking(Case& c, int idx, int64_t max_reused) {
  c.block_pattern = idx % 3;
  c.reused = (idx % 5 == 2) ? std::min<int64_t>(max_reused, Needed(c) - 1) : 0;
  c.chunk_bytes = idx % 2 ? 4 << 20 : 96;
  c.direct_min = idx % 3 ? 256 << 10 : 0;
  c.layer_wise = idx % 4 == 1;
}

// Every pair of named layouts (the engine presets: vLLM NHD/HND, K/V tensors per layer,
// FlashInfer, block-major NHD), on splits that cut heads and layers differently on each side,
// with partial blocks, reuse, small chunks and layer-wise pieces.
TEST(PlannerMatrix, EveryNamedLayoutPair) {
  CountConfigs count;
  const int64_t tpb = 4;
  const std::pair<ParallelConfig, ParallelConfig> splits[] = {{{1, 1, {}, 1, 0}, {1, 1, {}, 1, 0}},
                                                              {{2, 1, {}, 1, 0}, {4, 1, {}, 1, 0}},
                                                              {{4, 2, {}, 1, 0}, {1, 3, {}, 1, 0}}};
  const int64_t prompts[] = {1, tpb + 1, 5 * tpb + 3};
  int idx = 0;
  for (LayoutKind cl : NamedLayoutKinds()) {
    for (LayoutKind gl : NamedLayoutKinds()) {
      for (const auto& [cp, gp] : splits) {
        for (int64_t prompt : prompts) {
          Case c = PairCase(KvShape{7, 8, 8, DType::kBf16, 2, tpb}, cp, gp, cl, gl);
          c.prompt = prompt;
          VaryBlocksAndChunking(c, idx, 1);
          ++idx;
          RunCase(c);
          if (HasFailure()) return;
        }
      }
    }
  }
}

// Different block sizes on the two sides (a generation block fed by several context blocks and
// the reverse, partial last blocks, reuse counted in generation blocks), over every named layout
// pair and splits that cut heads and layers differently.
TEST(PlannerMatrix, DifferentBlockSizes) {
  CountConfigs count;
  const std::pair<int32_t, int32_t> sizes[] = {{8, 2}, {2, 8}, {4, 16}, {16, 4}, {4, 8}};
  const std::pair<ParallelConfig, ParallelConfig> splits[] = {{{1, 1, {}, 1, 0}, {1, 1, {}, 1, 0}},
                                                              {{2, 1, {}, 1, 0}, {4, 1, {}, 1, 0}},
                                                              {{4, 2, {}, 1, 0}, {1, 3, {}, 1, 0}}};
  int idx = 0;
  for (const auto& [ctx_tpb, gen_tpb] : sizes) {
    const int32_t big = std::max(ctx_tpb, gen_tpb);
    const int64_t prompts[] = {1, big - 1, big, big + 3, 3 * big + 1};
    for (LayoutKind cl : NamedLayoutKinds()) {
      for (LayoutKind gl : NamedLayoutKinds()) {
        for (int64_t prompt : prompts) {
          const auto& [cp, gp] = splits[idx % 3];
          Case c;
          c.shape = KvShape{7, 8, 8, DType::kBf16, 2, ctx_tpb};
          c.gen_tokens_per_block = gen_tpb;
          c.ctx = cp;
          c.gen = gp;
          c.ctx_layout = cl;
          c.gen_layout = gl;
          c.prompt = prompt;
          VaryBlocksAndChunking(c, idx, 2);
          ++idx;
          RunCase(c);
          if (HasFailure()) return;
        }
      }
    }
  }
}

// Custom layouts travel (issue 26 item 1): strides no named layout has (K/V outside the layers,
// heads outermost, tokens outermost, one region per kv, padded blocks), on either side or both,
// against named layouts, across splits, block sizes and dtypes. Padding is never written.
TEST(PlannerMatrix, CustomLayoutsOnEitherSide) {
  CountConfigs count;
  using S = Case::Strided;
  const S customs[] = {
      {RegionSplit::kNone, {kBlockAxis, kKvAxis, kLayerAxis, kTokenAxis, kHeadAxis, kDimAxis}, 64},
      {RegionSplit::kPerLayer, {kHeadAxis, kBlockAxis, kKvAxis, kTokenAxis, kDimAxis}, 0},
      {RegionSplit::kPerLayerKv, {kTokenAxis, kBlockAxis, kHeadAxis, kDimAxis}, 8},
      {RegionSplit::kPerKv, {kLayerAxis, kBlockAxis, kHeadAxis, kTokenAxis, kDimAxis}, 24},
  };
  const LayoutKind named[] = {LayoutKind::kBlockMajor, LayoutKind::kPerLayerHnd,
                              LayoutKind::kVllmNhd, LayoutKind::kPerLayerKvNhd};
  const std::pair<ParallelConfig, ParallelConfig> splits[] = {{{1, 1, {}, 1, 0}, {1, 1, {}, 1, 0}},
                                                              {{2, 1, {}, 1, 0}, {4, 1, {}, 1, 0}},
                                                              {{4, 2, {}, 1, 0}, {1, 3, {}, 1, 0}}};
  int idx = 0;
  for (const S& cs : customs) {
    for (int other = 0; other < 8; ++other) {
      for (int side = 0; side < 3; ++side) {  // custom on the context, the generation, both
        const auto& [cp, gp] = splits[idx % 3];
        Case c;
        c.shape = KvShape{7, 8, 8, DType::kBf16, 2, 4};
        c.ctx = cp;
        c.gen = gp;
        if (other < 4) {
          c.ctx_layout = c.gen_layout = named[other];
        } else {
          c.gen_strided = customs[other - 4];
        }
        if (side != 1) c.ctx_strided = cs;
        if (side == 1 || (side == 2 && other < 4)) c.gen_strided = cs;
        if (idx % 4 == 3) c.gen_tokens_per_block = 8;
        if (idx % 5 == 4) c.gen_dtype = DType::kFp16;
        c.prompt = 1 + (idx * 7) % 23;
        VaryBlocksAndChunking(c, idx, 1);
        ++idx;
        RunCase(c);
        if (HasFailure()) return;
      }
    }
  }
}

// Strides that alias, or fit one rank's dims but not another's, are refused before planning,
// naming the side and the rank.
TEST(Planner, RefusesCustomStridesThatAlias) {
  Case c;
  c.ctx = ParallelConfig{2, 1, {}, 1, 0};
  c.ctx_strided =
      Case::Strided{RegionSplit::kPerLayer, {kBlockAxis, kKvAxis, kHeadAxis, kTokenAxis, kDimAxis}};
  PlanInput in = MakeInput(c);
  ASSERT_TRUE(PlanTransfer(in).ok());
  in.ctx.strides[kHeadAxis] = in.ctx.strides[kTokenAxis];  // heads step over nothing
  auto st = PlanTransfer(in).status();
  EXPECT_NE(st.message().find("context: custom layout of rank 0"), std::string_view::npos)
      << st.ToString();
  EXPECT_NE(st.message().find("aliases"), std::string_view::npos) << st.ToString();
  in = MakeInput(c);
  in.ctx.strides[kDimAxis] = 2;
  st = PlanTransfer(in).status();
  EXPECT_NE(st.message().find("dim axis must have stride 1"), std::string_view::npos)
      << st.ToString();
}

// Every convertible pair of dtypes, across layouts, splits and block sizes: the sender converts
// while packing, every generation element is the context one converted (CheckBlock), no byte
// written twice or outside the request, and no chunk direct.
TEST(PlannerMatrix, DifferentDtypes) {
  CountConfigs count;
  const DType dtypes[] = {DType::kFp32, DType::kFp16, DType::kBf16, DType::kFp8E4M3};
  const std::pair<ParallelConfig, ParallelConfig> splits[] = {{{1, 1, {}, 1, 0}, {1, 1, {}, 1, 0}},
                                                              {{2, 1, {}, 1, 0}, {4, 1, {}, 1, 0}},
                                                              {{4, 2, {}, 1, 0}, {1, 3, {}, 1, 0}}};
  const std::pair<int32_t, int32_t> sizes[] = {{4, 4}, {8, 2}, {2, 8}};
  int idx = 0;
  for (DType from : dtypes) {
    for (DType to : dtypes) {
      if (from == to) continue;
      for (LayoutKind cl : NamedLayoutKinds()) {
        for (LayoutKind gl : NamedLayoutKinds()) {
          const auto& [cp, gp] = splits[idx % 3];
          const auto& [ctx_tpb, gen_tpb] = sizes[idx % 3];
          Case c = PairCase(KvShape{7, 8, 8, from, 2, ctx_tpb}, cp, gp, cl, gl);
          c.gen_dtype = to;
          c.gen_tokens_per_block = gen_tpb;
          c.prompt = idx % 2 ? 2 * std::max(ctx_tpb, gen_tpb) + 1 : 5;
          c.block_pattern = idx % 3;
          c.reused = idx % 5 == 2 ? 1 : 0;
          c.chunk_bytes = idx % 2 ? 4 << 20 : 96;
          c.direct_min = 0;  // would make every contiguous piece direct: conversion forbids it
          c.layer_wise = idx % 4 == 1;
          ++idx;
          RunCase(c);
          if (HasFailure()) return;
        }
      }
    }
  }
}

// Distinct scales for every (layer, kv[, head]) of `shape` (none: empty).
KvScales MakeScales(ScaleGranularity g, const KvShape& shape, float base) {
  KvScales s{g, {}};
  for (int64_t i = 0; i < KvScales::CountFor(g, shape); ++i) s.values.push_back(base + 0.0137f * i);
  return s;
}

// Scales (issue 26 item 3): fp8 quantized, dequantized and requantized with scales per tensor or
// per head on either side, over the named layout pairs, splits and block sizes; every element is
// checked against its value times the source's scale, divided by the destination's, narrowed.
TEST(PlannerMatrix, Scales) {
  CountConfigs count;
  struct Dtypes {
    DType from, to;
  };
  const Dtypes dtypes[] = {{DType::kBf16, DType::kFp8E4M3},
                           {DType::kFp8E4M3, DType::kBf16},
                           {DType::kFp8E4M3, DType::kFp8E4M3},
                           {DType::kFp16, DType::kFp8E4M3}};
  using G = ScaleGranularity;
  const std::pair<G, G> grains[] = {{G::kNone, G::kTensor},   {G::kNone, G::kHead},
                                    {G::kTensor, G::kTensor}, {G::kHead, G::kTensor},
                                    {G::kTensor, G::kNone},   {G::kHead, G::kHead}};
  const std::pair<ParallelConfig, ParallelConfig> splits[] = {{{1, 1, {}, 1, 0}, {1, 1, {}, 1, 0}},
                                                              {{2, 1, {}, 1, 0}, {4, 1, {}, 1, 0}},
                                                              {{4, 2, {}, 1, 0}, {1, 3, {}, 1, 0}}};
  const std::pair<int32_t, int32_t> sizes[] = {{4, 4}, {8, 2}, {2, 8}};
  int idx = 0;
  for (const auto& [from, to] : dtypes) {
    for (const auto& [cg, gg] : grains) {
      for (LayoutKind cl : NamedLayoutKinds()) {
        for (LayoutKind gl : {LayoutKind::kBlockMajor, LayoutKind::kVllmNhd,
                              LayoutKind::kPerLayerKvNhd, LayoutKind::kFlashInferHnd}) {
          const auto& [cp, gp] = splits[idx % 3];
          const auto& [ctx_tpb, gen_tpb] = sizes[idx % 3];
          Case c = PairCase(KvShape{5, 8, 8, from, idx % 7 == 3 ? 1 : 2, ctx_tpb}, cp, gp, cl, gl);
          c.gen_dtype = to;
          c.gen_tokens_per_block = gen_tpb;
          c.ctx_scales = MakeScales(cg, c.shape, 0.031f);
          c.gen_scales = MakeScales(gg, c.shape, 0.0071f);
          c.prompt = idx % 2 ? 2 * std::max(ctx_tpb, gen_tpb) + 1 : 5;
          VaryBlocksAndChunking(c, idx, 1);
          c.direct_min = 0;
          ++idx;
          RunCase(c);
          if (HasFailure()) return;
        }
      }
    }
  }
}

// Equal scales and dtypes on both sides (however described) convert nothing: chunks may go
// direct. Scales that do not fit the shape, or are not finite and positive, are refused naming the
// side.
TEST(Planner, EqualScalesConvertNothingAndBadScalesAreRefused) {
  Case c;
  c.shape = KvShape{3, 2, 8, DType::kFp8E4M3, 2, 4};
  c.ctx_scales = KvScales{ScaleGranularity::kTensor, {1, 2, 3, 4, 5, 6}};
  c.gen_scales = KvScales{ScaleGranularity::kHead, {1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6}};
  c.direct_min = 0;
  PlanInput in = MakeInput(c);
  EXPECT_FALSE(Converts(in.ctx, in.gen));
  EXPECT_FALSE(PlanConversion(in));
  RunCase(c);
  c.gen_scales.values[5] = 2.5f;  // layer 1, K, head 1
  in = MakeInput(c);
  EXPECT_TRUE(Converts(in.ctx, in.gen));
  ASSERT_TRUE(PlanConversion(in));
  EXPECT_EQ(PlanConversion(in)->from, PlanConversion(in)->to);
  RunCase(c);
  c.gen_scales.values.pop_back();
  auto plan = PlanTransfer(MakeInput(c));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(),
            "generation: kv scales per head: 11 values, and the shape (3 layers, kv_factor 2, 2 kv "
            "heads) takes 12");
  c.gen_scales.values.push_back(0);
  plan = PlanTransfer(MakeInput(c));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(),
            "generation: kv scales: value 11 is 0; scales must be finite and positive");
}

// Per-block scales: every plane of every piece is one scale group of the generation rank
// (block, layer, kv, head: its moved tokens, whole), each group exactly once, its index that of
// BlockPool::BlockScaleIndex; chunks hold their scales after their rows, within chunk_bytes. A
// context rank's index names the context group of the same tokens.
TEST(Planner, PerBlockScalesMakeOnePlanePerGroup) {
  using G = ScaleGranularity;
  for (LayoutKind cl : {LayoutKind::kBlockMajor, LayoutKind::kVllmHnd, LayoutKind::kPerLayer}) {
    for (LayoutKind gl :
         {LayoutKind::kVllmNhd, LayoutKind::kPerLayerKvHnd, LayoutKind::kBlockMajor}) {
      for (int64_t chunk : {int64_t{4} << 20, int64_t{300}}) {
        Case c = PairCase(KvShape{3, 4, 8, DType::kFp8E4M3, 2, 4}, {2, 1, {}, 1, 0},
                          {1, 1, {}, 1, 0}, cl, gl);
        c.ctx_scales.granularity = G::kBlock;
        c.gen_scales.granularity = G::kBlock;
        c.prompt = 14;  // 3 whole blocks and one of 2 tokens
        c.chunk_bytes = chunk;
        c.direct_min = 0;
        SCOPED_TRACE(c.Name());
        const PlanInput in = MakeInput(c);
        auto plan = PlanForGenRank(in, 0);
        ASSERT_TRUE(plan.ok()) << plan.status().ToString();
        const int64_t groups_per_block = 3 * 2 * 4;  // layers x kv x heads of generation rank 0
        std::map<int64_t, int64_t> seen;             // dst scale index -> plane bytes
        for (const PairPlan& pair : *plan) {
          for (const Chunk& ch : pair.chunks) {
            EXPECT_FALSE(ch.direct);
            int64_t planes = 0;
            for (const Piece& p : ch.pieces) {
              ASSERT_GE(p.dst_scale_at, 0);
              ASSERT_GE(p.src_scale_at, 0);
              planes += p.planes;
              for (int64_t q = 0; q < p.planes; ++q)
                EXPECT_TRUE(seen.emplace(p.dst_scale_at + q, p.bytes * p.rows).second);
            }
            EXPECT_EQ(ch.scale_bytes, 4 * planes);
            EXPECT_LE(ch.packed_bytes(), c.chunk_bytes);
          }
        }
        const auto& blocks = in.gen_blocks;
        ASSERT_EQ(seen.size(), blocks.size() * groups_per_block);
        for (size_t b = 0; b < blocks.size(); ++b) {
          const int64_t tokens = b + 1 < blocks.size() ? 4 : 2;
          for (int64_t g = 0; g < groups_per_block; ++g) {
            auto it = seen.find(blocks[b] * groups_per_block + g);
            ASSERT_NE(it, seen.end()) << "block " << blocks[b] << " group " << g;
            EXPECT_EQ(it->second, tokens * 8) << "the group's moved tokens, whole";
          }
        }
      }
    }
  }
}

TEST(Planner, PerBlockScalesRefuseWhatTheyCannotMap) {
  Case c;
  c.shape = KvShape{3, 2, 8, DType::kFp8E4M3, 2, 4};
  c.ctx_scales.granularity = ScaleGranularity::kBlock;
  c.gen_tokens_per_block = 8;
  auto plan = PlanTransfer(MakeInput(c));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(),
            "per-block kv scales (context) need the same block size on both sides; context 4, "
            "generation 8 tokens per block");
  c.gen_tokens_per_block = 0;
  c.shape.dtype = DType::kBf16;
  plan = PlanTransfer(MakeInput(c));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(),
            "context: per-block kv scales with dtype bf16: per-block scales quantize an fp8 cache");
  c.shape.dtype = DType::kFp8E4M3;
  c.ctx_scales = {};
  c.gen_scales.granularity = ScaleGranularity::kBlock;
  c.chunk_bytes = 40;  // a group is 4 tokens x 8 bytes = 32 bytes, 36 with its scale
  plan = PlanTransfer(MakeInput(c));
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("a per-block scale group (one block's tokens of a layer, "
                                         "K or V and head) is 32 bytes"),
            std::string::npos)
      << plan.status().ToString();
  c.chunk_bytes = 52;
  EXPECT_TRUE(PlanTransfer(MakeInput(c)).ok());
}

TEST(Planner, RefusesDtypesWithoutAConversion) {
  Case c;
  c.shape.dtype = DType::kBf16;
  c.gen_dtype = DType::kInt8;
  auto plan = PlanTransfer(MakeInput(c));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(),
            "dtype mismatch: context bf16, generation int8, and no conversion between them "
            "(kvferry converts between fp32, fp16, bf16 and fp8)");
  c.shape.dtype = DType::kFp8E5M2;
  c.gen_dtype = DType::kFp16;
  EXPECT_FALSE(PlanTransfer(MakeInput(c)).ok());
}

}  // namespace
}  // namespace kvferry::planner_test

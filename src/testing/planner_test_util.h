// Shared by the planner tests: a test case (shape, splits, layouts, prompt, blocks, chunking),
// structural checks of a plan, and RunCase, which plans, executes the plan on CPU pools and
// checks every byte of every generation rank.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "planner/planner.h"
#include "testing/plan_executor_for_test.h"
#include "testing/testdata.h"

namespace kvferry::planner_test {

constexpr uint64_t kRequest = 42;
constexpr std::byte kGenSentinel{0xA5};
constexpr std::byte kCtxSentinel{0x5A};

struct Case {
  KvShape shape{7, 8, 8, DType::kBf16, 2, 4};
  ParallelConfig ctx, gen;
  LayoutKind ctx_layout = LayoutKind::kBlockMajor;
  LayoutKind gen_layout = LayoutKind::kBlockMajor;
  int64_t prompt = 23;
  int64_t reused = 0;
  int block_pattern = 0;  // 0: same consecutive ids both sides; 1: runs and gaps; 2: reversed
  int64_t chunk_bytes = 4 << 20;
  int64_t direct_min = 256 << 10;
  bool layer_wise = false;
  bool tight_pools = false;          // pool_blocks = the request's blocks
  int32_t gen_tokens_per_block = 0;  // the generation side's block size (0: shape's)
  std::optional<DType> gen_dtype;    // the generation side's dtype (none: shape's)
  // A custom layout instead of ctx_layout / gen_layout (strides travel, issue 26): the region
  // split, the in-region axes outermost first, and `pad` elements after each block.
  struct Strided {
    RegionSplit split = RegionSplit::kNone;
    std::vector<int> order;
    int64_t pad = 0;
    std::string Name() const {
      return fmt::format("custom {}/{} pad {}", RegionSplitName(split), fmt::join(order, ""), pad);
    }
  };
  std::optional<Strided> ctx_strided, gen_strided;
  KvScales ctx_scales, gen_scales;  // each side's KV scales (none: 1)

  std::string Name() const {
    return fmt::format(
        "shape[{}] ctx[{} {}] gen[{} {}] prompt={} reused={} blocks#{} chunk={} "
        "direct_min={}{}{}{}{}",
        shape.ToString(), ctx.ToString(),
        ctx_strided ? ctx_strided->Name() : std::string(LayoutKindName(ctx_layout)), gen.ToString(),
        gen_strided ? gen_strided->Name() : std::string(LayoutKindName(gen_layout)), prompt, reused,
        block_pattern, chunk_bytes, direct_min, layer_wise ? " layer-wise" : "",
        gen_tokens_per_block ? fmt::format(" gen_tokens_per_block={}", gen_tokens_per_block) : "",
        gen_dtype ? fmt::format(" gen_dtype={}", DTypeName(*gen_dtype)) : "",
        ScaleName(" ctx_scales", ctx_scales) + ScaleName(" gen_scales", gen_scales));
  }
  static std::string ScaleName(const char* side, const KvScales& s) {
    return s.granularity == ScaleGranularity::kNone
               ? std::string()
               : fmt::format("{} per {}", side, ScaleGranularityName(s.granularity));
  }
};

// A case between two splits and layouts of `shape` (the rest default).
inline Case PairCase(const KvShape& shape, const ParallelConfig& ctx, const ParallelConfig& gen,
                     LayoutKind ctx_layout, LayoutKind gen_layout) {
  Case c;
  c.shape = shape;
  c.ctx = ctx;
  c.gen = gen;
  c.ctx_layout = ctx_layout;
  c.gen_layout = gen_layout;
  return c;
}

inline KvShape GenShape(const Case& c) {
  KvShape s = c.shape;
  if (c.gen_tokens_per_block) s.tokens_per_block = c.gen_tokens_per_block;
  if (c.gen_dtype) s.dtype = *c.gen_dtype;
  return s;
}

inline int64_t BlocksFor(const Case& c, int64_t tokens_per_block) {
  return (c.prompt + tokens_per_block - 1) / tokens_per_block;
}
inline int64_t CtxNeeded(const Case& c) { return BlocksFor(c, c.shape.tokens_per_block); }
// Generation blocks of the prompt (what `reused` counts).
inline int64_t Needed(const Case& c) { return BlocksFor(c, GenShape(c).tokens_per_block); }

// Strides for `s` over the dims of rank 0 of `d` (every rank of the test cases has its dims).
inline void SetStrided(InstanceDesc& d, const Case::Strided& s) {
  const RankSlice slice = SliceOf(d.shape, d.parallel, 0).value();
  const PoolDims dims = RankPoolDims(d.shape, slice, d.pool_blocks);
  d.layout = LayoutKind::kCustom;
  d.split = s.split;
  d.strides = {};
  int64_t extent = 1;  // elements spanned by the axes inside
  for (auto it = s.order.rbegin(); it != s.order.rend(); ++it) {
    d.strides[*it] = *it == kBlockAxis ? extent + s.pad : extent;
    extent = d.strides[*it] * dims[*it];
  }
}

inline PlanInput MakeInput(const Case& c) {
  PlanInput in;
  const int64_t nc = CtxNeeded(c);
  const int64_t ng = Needed(c);
  in.ctx = InstanceDesc{c.shape, c.ctx, c.ctx_layout, 2 * nc + 3};
  in.gen = InstanceDesc{GenShape(c), c.gen, c.gen_layout, 2 * ng + 2};
  if (c.ctx_strided) SetStrided(in.ctx, *c.ctx_strided);
  if (c.gen_strided) SetStrided(in.gen, *c.gen_strided);
  in.ctx.scales = c.ctx_scales;
  in.gen.scales = c.gen_scales;
  in.prompt_tokens = c.prompt;
  for (int64_t i = 0; i < nc; ++i) {
    switch (c.block_pattern) {
      case 0:
        in.ctx_blocks.push_back(i);
        break;
      case 1:
        in.ctx_blocks.push_back(1 + i + i / 3);
        break;  // runs of three, gaps
      default:
        in.ctx_blocks.push_back(2 * nc + 2 - i);
        break;  // decreasing ids
    }
  }
  for (int64_t i = 0; i < ng; ++i) {
    switch (c.block_pattern) {
      case 0:
        in.gen_blocks.push_back(i);
        break;
      case 1:
        in.gen_blocks.push_back(i + i / 2);
        break;  // runs of two, gaps
      default:
        in.gen_blocks.push_back(ng - 1 - i);
        break;
    }
  }
  if (c.tight_pools) {  // pools of exactly the request's blocks
    in.ctx.pool_blocks = nc;
    in.gen.pool_blocks = ng;
    for (int64_t i = 0; i < nc; ++i) in.ctx_blocks[i] = c.block_pattern == 2 ? nc - 1 - i : i;
    for (int64_t i = 0; i < ng; ++i) in.gen_blocks[i] = c.block_pattern == 1 ? (i + 1) % ng : i;
  }
  in.gen_reused_blocks = c.reused;
  in.chunk_bytes = c.chunk_bytes;
  in.direct_min_bytes = c.direct_min;
  in.layer_wise = c.layer_wise;
  return in;
}

// Tokens of the prompt in its block i of `tpb` tokens.
inline int64_t ValidTokens(const Case& c, int64_t i, int64_t tpb) {
  return std::min(tpb, c.prompt - i * tpb);
}

// Structural invariants of a plan that need no memory.
inline void CheckStructure(const Case& c, const PlanInput& in, const TransferPlan& plan) {
  SCOPED_TRACE(c.Name());
  int64_t total = 0;
  for (size_t k = 0; k < plan.pairs.size(); ++k) {
    const PairPlan& pair = plan.pairs[k];
    if (k > 0) {
      const PairPlan& prev = plan.pairs[k - 1];
      EXPECT_LT(std::pair(prev.ctx_rank, prev.gen_rank), std::pair(pair.ctx_rank, pair.gen_rank));
    }
    EXPECT_FALSE(pair.chunks.empty());
    int64_t pair_bytes = 0;
    int32_t last_layer = -1;
    for (const Chunk& chunk : pair.chunks) {
      ASSERT_FALSE(chunk.pieces.empty());
      int64_t chunk_bytes = 0;
      int32_t max_layer = -1;
      for (const Piece& p : chunk.pieces) {
        EXPECT_GE(p.layer, last_layer) << "pieces not ordered by layer";
        last_layer = p.layer;
        EXPECT_GE(p.bytes, 1);
        EXPECT_GE(p.rows, 1);
        EXPECT_GE(p.planes, 1);
        if (p.planes > 1) {
          EXPECT_GT(p.rows, 1) << "planes of single rows (rows would do)";
        }
        if (p.rows > 1) {
          const int64_t src_bytes =
              p.bytes / in.gen.shape.ElementBytes() * in.ctx.shape.ElementBytes();
          EXPECT_FALSE(p.src_pitch == src_bytes && p.dst_pitch == p.bytes) << "uncollapsed rows";
        }
        chunk_bytes += p.total();
        max_layer = std::max(max_layer, p.layer);
      }
      EXPECT_EQ(chunk.bytes, chunk_bytes);
      EXPECT_EQ(chunk.last_layer, max_layer);
      if (chunk.direct) {
        ASSERT_EQ(chunk.pieces.size(), 1u);
        EXPECT_EQ(chunk.pieces[0].rows, 1);
        EXPECT_EQ(chunk.pieces[0].planes, 1);
        EXPECT_GE(chunk.bytes, in.direct_min_bytes);
        EXPECT_FALSE(PlanConversion(in)) << "a direct chunk in a plan that converts";
      } else {
        EXPECT_LE(chunk.bytes, in.chunk_bytes);
      }
      pair_bytes += chunk.bytes;
    }
    EXPECT_EQ(pair.bytes, pair_bytes);
    total += pair.bytes;
  }
  EXPECT_EQ(plan.total_bytes, total);
  ASSERT_EQ(plan.gen_peers_of_ctx.size(), static_cast<size_t>(c.ctx.world_size()));
  ASSERT_EQ(plan.ctx_peers_of_gen.size(), static_cast<size_t>(c.gen.world_size()));
  std::vector<std::vector<int32_t>> g_of_c(c.ctx.world_size()), c_of_g(c.gen.world_size());
  for (const PairPlan& p : plan.pairs) {
    g_of_c[p.ctx_rank].push_back(p.gen_rank);
    c_of_g[p.gen_rank].push_back(p.ctx_rank);
  }
  EXPECT_EQ(plan.gen_peers_of_ctx, g_of_c);
  EXPECT_EQ(plan.ctx_peers_of_gen, c_of_g);
  // Per-rank planning is the whole plan restricted to that rank.
  for (int32_t r = 0; r < c.ctx.world_size(); ++r) {
    auto mine = PlanForCtxRank(in, r);
    ASSERT_TRUE(mine.ok()) << mine.status().ToString();
    std::vector<PairPlan> want;
    for (const PairPlan& p : plan.pairs) {
      if (p.ctx_rank == r) want.push_back(p);
    }
    EXPECT_TRUE(*mine == want) << "PlanForCtxRank(" << r << ") differs";
  }
  for (int32_t r = 0; r < c.gen.world_size(); ++r) {
    auto mine = PlanForGenRank(in, r);
    ASSERT_TRUE(mine.ok()) << mine.status().ToString();
    std::vector<PairPlan> want;
    for (const PairPlan& p : plan.pairs) {
      if (p.gen_rank == r) want.push_back(p);
    }
    EXPECT_TRUE(*mine == want) << "PlanForGenRank(" << r << ") differs";
  }
}

inline std::vector<BlockPool> MakePools(Device& dev, const InstanceDesc& d, std::byte fill) {
  std::vector<BlockPool> pools;
  for (int32_t r = 0; r < d.parallel.world_size(); ++r) {
    const PoolSpec spec{d.shape, d.parallel, r, d.layout, MemoryKind::kHost, d.pool_blocks};
    const RankSlice slice = SliceOf(d.shape, d.parallel, r).value();
    auto layout = LayoutOf(d, RankPoolDims(d.shape, slice, d.pool_blocks), d.shape.ElementBytes());
    EXPECT_TRUE(layout.ok()) << layout.status().ToString();
    auto pool = BlockPool::Create(dev, spec, *layout);
    EXPECT_TRUE(pool.ok()) << pool.status().ToString();
    for (int32_t g = 0; g < pool->num_regions(); ++g) {
      std::memset(pool->region(g), static_cast<int>(fill),
                  static_cast<size_t>(pool->layout().region_bytes()));
    }
    pools.push_back(std::move(pool).value());
  }
  return pools;
}

inline int g_executed = 0;  // configurations executed by RunCase

// Plans, executes on host pools, and checks every generation byte: the needed ones are written
// exactly once with the right values, all others are untouched.
inline void RunCase(const Case& c) {
  SCOPED_TRACE(c.Name());
  const PlanInput in = MakeInput(c);
  auto plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  CheckStructure(c, in, *plan);
  if (::testing::Test::HasFailure()) return;

  auto dev = OpenCpuDevice();
  // `ref` holds the request's KV; `ctx` (what the plan reads) gets a layer of it only once a
  // chunk says it may be sent (chunk.last_layer), as in layer-wise transfer: a chunk reading a
  // layer beyond its last_layer reads sentinel bytes and fails the value check.
  std::vector<BlockPool> ref = MakePools(*dev, in.ctx, kCtxSentinel);
  std::vector<BlockPool> ctx = MakePools(*dev, in.ctx, kCtxSentinel);
  std::vector<BlockPool> gen = MakePools(*dev, in.gen, kGenSentinel);
  const int64_t n = CtxNeeded(c);
  const int64_t tpb = c.shape.tokens_per_block;
  const int64_t gen_tpb = GenShape(c).tokens_per_block;
  for (BlockPool& pool : ref) {
    if (pool.slice().dp_group != c.ctx.dp_rank) continue;  // only the serving group holds it
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(
          FillBlock(pool, kRequest, {in.ctx_blocks[i], i * tpb, ValidTokens(c, i, tpb)}).ok());
    }
  }
  const PairPlan* current = nullptr;
  int64_t computed = 0;  // local layers of the current pair's ctx rank made available so far
  auto before_chunk = [&](const PairPlan& pair, const Chunk& chunk) {
    const BlockPool& from = ref[pair.ctx_rank];
    const BlockPool& to = ctx[pair.ctx_rank];
    const PoolLayout& lay = to.layout();
    if (&pair != current) {  // a new pair starts from a rank that has computed nothing
      current = &pair;
      computed = 0;
      for (int32_t g = 0; g < to.num_regions(); ++g) {
        std::memset(to.region(g), static_cast<int>(kCtxSentinel),
                    static_cast<size_t>(lay.region_bytes()));
      }
    }
    const int64_t upto =
        std::min<int64_t>(chunk.last_layer + 1 - to.slice().layer_begin, to.slice().layer_count);
    for (; computed < upto; ++computed) {
      for (int64_t i = 0; i < n; ++i) {
        BlockBox box = lay.WholeBlock(in.ctx_blocks[i]);
        box.layers = {computed, computed + 1};
        for (const Extent& e : lay.Extents(box)) {
          std::memcpy(to.Address(e), from.Address(e), static_cast<size_t>(e.bytes));
        }
      }
    }
  };
  WriteCounts counts = MakeWriteCounts(gen);
  Status s = ExecutePlanForTest(plan->pairs, ctx, gen, counts, before_chunk, PlanConversion(in));
  ASSERT_TRUE(s.ok()) << s.ToString();

  int64_t expected_total = 0;
  for (size_t r = 0; r < gen.size(); ++r) {
    const BlockPool& pool = gen[r];
    const PoolLayout& lay = pool.layout();
    std::vector<std::vector<uint8_t>> needed(pool.num_regions());
    for (auto& v : needed) v.assign(static_cast<size_t>(lay.region_bytes()), 0);
    const bool receives = pool.slice().dp_group == c.gen.dp_rank;
    if (receives) {
      for (int64_t i = c.reused; i < Needed(c); ++i) {
        const int64_t valid = ValidTokens(c, i, gen_tpb);
        BlockBox box = lay.WholeBlock(in.gen_blocks[i]);
        box.tokens = {0, valid};
        for (const Extent& e : lay.Extents(box)) {
          std::fill_n(needed[e.region].begin() + e.offset, e.bytes, 1);
          expected_total += e.bytes;
        }
        auto mismatch = CheckBlock(pool, kRequest, {in.gen_blocks[i], i * gen_tpb, valid},
                                   c.shape.dtype, c.ctx_scales, c.gen_scales);
        ASSERT_TRUE(mismatch.ok());
        ASSERT_FALSE(mismatch->has_value())
            << "gen rank " << r << " block " << i << ": " << (*mismatch)->ToString();
      }
    }
    for (int32_t g = 0; g < pool.num_regions(); ++g) {
      const std::byte* bytes = pool.region(g);
      for (int64_t b = 0; b < lay.region_bytes(); ++b) {
        if (counts[r][g][b] != needed[g][b]) {
          FAIL() << "gen rank " << r << " region " << g << " byte " << b << " written "
                 << int{counts[r][g][b]} << " times, needed " << int{needed[g][b]};
        }
        if (!needed[g][b] && bytes[b] != kGenSentinel) {
          FAIL() << "gen rank " << r << " region " << g << " byte " << b << " overwritten";
        }
      }
    }
  }
  EXPECT_EQ(plan->total_bytes, expected_total);
  ++g_executed;
}

// Prints how many configurations a test planned, executed and checked.
struct CountConfigs {
  int before = g_executed;
  ~CountConfigs() { std::printf("executed %d configurations\n", g_executed - before); }
};

inline const std::vector<int32_t> kTps{1, 2, 3, 4, 6, 8};
inline const std::vector<int32_t> kPps{1, 2, 3};
inline const std::vector<int32_t> kKvHeads{8, 6, 2};
inline constexpr LayoutKind kLayouts[] = {LayoutKind::kBlockMajor, LayoutKind::kPerLayer};

inline std::vector<ParallelConfig> ValidConfigs(const KvShape& shape) {
  std::vector<ParallelConfig> out;
  for (int32_t tp : kTps) {
    for (int32_t pp : kPps) {
      ParallelConfig p{tp, pp, {}, 1, 0};
      if (p.Validate(shape).ok()) out.push_back(p);
    }
  }
  return out;
}

}  // namespace kvferry::planner_test

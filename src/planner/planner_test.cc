#include "planner/planner.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <numeric>

#include "kvferry/testdata.h"
#include "planner/plan_executor_for_test.h"

namespace kvferry {
namespace {

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
  bool tight_pools = false;  // pool_blocks = the request's blocks

  std::string Name() const {
    return fmt::format(
        "shape[{}] ctx[{} {}] gen[{} {}] prompt={} reused={} blocks#{} chunk={} "
        "direct_min={}{}",
        shape.ToString(), ctx.ToString(), LayoutKindName(ctx_layout), gen.ToString(),
        LayoutKindName(gen_layout), prompt, reused, block_pattern, chunk_bytes, direct_min,
        layer_wise ? " layer-wise" : "");
  }
};

int64_t Needed(const Case& c) {
  return (c.prompt + c.shape.tokens_per_block - 1) / c.shape.tokens_per_block;
}

PlanInput MakeInput(const Case& c) {
  PlanInput in;
  const int64_t n = Needed(c);
  in.ctx = InstanceDesc{c.shape, c.ctx, c.ctx_layout, 2 * n + 3};
  in.gen = InstanceDesc{c.shape, c.gen, c.gen_layout, 2 * n + 2};
  in.prompt_tokens = c.prompt;
  for (int64_t i = 0; i < n; ++i) {
    switch (c.block_pattern) {
      case 0:
        in.ctx_blocks.push_back(i);
        in.gen_blocks.push_back(i);
        break;
      case 1:  // runs of three consecutive ids with gaps; gen runs of two
        in.ctx_blocks.push_back(1 + i + i / 3);
        in.gen_blocks.push_back(i + i / 2);
        break;
      default:  // decreasing ids
        in.ctx_blocks.push_back(2 * n + 2 - i);
        in.gen_blocks.push_back(n - 1 - i);
        break;
    }
  }
  if (c.tight_pools) {  // pools of exactly the request's blocks
    in.ctx.pool_blocks = in.gen.pool_blocks = n;
    for (int64_t i = 0; i < n; ++i) {
      in.ctx_blocks[i] = c.block_pattern == 2 ? n - 1 - i : i;
      in.gen_blocks[i] = c.block_pattern == 1 ? (i + 1) % n : i;
    }
  }
  in.gen_reused_blocks = c.reused;
  in.chunk_bytes = c.chunk_bytes;
  in.direct_min_bytes = c.direct_min;
  in.layer_wise = c.layer_wise;
  return in;
}

int64_t ValidTokens(const Case& c, int64_t i) {
  const int64_t tpb = c.shape.tokens_per_block;
  return std::min(tpb, c.prompt - i * tpb);
}

// Structural invariants of a plan that need no memory.
void CheckStructure(const Case& c, const PlanInput& in, const TransferPlan& plan) {
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
        if (p.rows > 1) {
          EXPECT_FALSE(p.src_pitch == p.bytes && p.dst_pitch == p.bytes) << "uncollapsed rows";
        }
        chunk_bytes += p.total();
        max_layer = std::max(max_layer, p.layer);
      }
      EXPECT_EQ(chunk.bytes, chunk_bytes);
      EXPECT_EQ(chunk.last_layer, max_layer);
      if (chunk.direct) {
        ASSERT_EQ(chunk.pieces.size(), 1u);
        EXPECT_EQ(chunk.pieces[0].rows, 1);
        EXPECT_GE(chunk.bytes, in.direct_min_bytes);
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

std::vector<BlockPool> MakePools(Device& dev, const KvShape& shape, const ParallelConfig& par,
                                 LayoutKind layout, int64_t blocks, std::byte fill) {
  std::vector<BlockPool> pools;
  for (int32_t r = 0; r < par.world_size(); ++r) {
    auto pool = BlockPool::Create(dev, PoolSpec{shape, par, r, layout, MemoryKind::kHost, blocks});
    EXPECT_TRUE(pool.ok()) << pool.status().ToString();
    for (int32_t g = 0; g < pool->num_regions(); ++g) {
      std::memset(pool->region(g), static_cast<int>(fill),
                  static_cast<size_t>(pool->layout().region_bytes()));
    }
    pools.push_back(std::move(pool).value());
  }
  return pools;
}

int g_executed = 0;

// Plans, executes on host pools, and checks every generation byte: the needed ones are written
// exactly once with the right values, all others are untouched.
void RunCase(const Case& c) {
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
  std::vector<BlockPool> ref =
      MakePools(*dev, c.shape, c.ctx, c.ctx_layout, in.ctx.pool_blocks, kCtxSentinel);
  std::vector<BlockPool> ctx =
      MakePools(*dev, c.shape, c.ctx, c.ctx_layout, in.ctx.pool_blocks, kCtxSentinel);
  std::vector<BlockPool> gen =
      MakePools(*dev, c.shape, c.gen, c.gen_layout, in.gen.pool_blocks, kGenSentinel);
  const int64_t n = Needed(c);
  const int64_t tpb = c.shape.tokens_per_block;
  for (BlockPool& pool : ref) {
    if (pool.slice().dp_group != c.ctx.dp_rank) continue;  // only the serving group holds it
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(FillBlock(pool, kRequest, {in.ctx_blocks[i], i * tpb, ValidTokens(c, i)}).ok());
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
  Status s = ExecutePlanForTest(plan->pairs, ctx, gen, counts, before_chunk);
  ASSERT_TRUE(s.ok()) << s.ToString();

  int64_t expected_total = 0;
  for (size_t r = 0; r < gen.size(); ++r) {
    const BlockPool& pool = gen[r];
    const PoolLayout& lay = pool.layout();
    std::vector<std::vector<uint8_t>> needed(pool.num_regions());
    for (auto& v : needed) v.assign(static_cast<size_t>(lay.region_bytes()), 0);
    const bool receives = pool.slice().dp_group == c.gen.dp_rank;
    if (receives) {
      for (int64_t i = c.reused; i < n; ++i) {
        BlockBox box = lay.WholeBlock(in.gen_blocks[i]);
        box.tokens = {0, ValidTokens(c, i)};
        for (const Extent& e : lay.Extents(box)) {
          std::fill_n(needed[e.region].begin() + e.offset, e.bytes, 1);
          expected_total += e.bytes;
        }
        auto mismatch = CheckBlock(pool, kRequest, {in.gen_blocks[i], i * tpb, ValidTokens(c, i)});
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

const std::vector<int32_t> kTps{1, 2, 3, 4, 6, 8};
const std::vector<int32_t> kPps{1, 2, 3};
const std::vector<int32_t> kKvHeads{8, 6, 2};
const LayoutKind kLayouts[] = {LayoutKind::kBlockMajor, LayoutKind::kPerLayer};

std::vector<ParallelConfig> ValidConfigs(const KvShape& shape) {
  std::vector<ParallelConfig> out;
  for (int32_t tp : kTps) {
    for (int32_t pp : kPps) {
      ParallelConfig p{tp, pp, {}, 1, 0};
      if (p.Validate(shape).ok()) out.push_back(p);
    }
  }
  return out;
}

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
              Case c;
              c.shape = shape;
              c.ctx = cp;
              c.gen = gp;
              c.ctx_layout = cl;
              c.gen_layout = gl;
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
              Case c;
              c.shape = KvShape{5, 8, 16, DType::kFp16, 2, tpb};
              c.ctx = cp;
              c.gen = gp;
              c.ctx_layout = cl;
              c.gen_layout = gl;
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
          Case c;
          c.shape = shape;
          c.ctx = cp;
          c.gen = gp;
          c.ctx_layout = cl;
          c.gen_layout = gl;
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
          Case c;
          c.shape = shape;
          c.ctx = cp;
          c.gen = gp;
          c.ctx_layout = cl;
          c.gen_layout = gl;
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
          Case c;
          c.shape = shape;
          c.ctx = cp;
          c.gen = gp;
          c.ctx_layout = cl;
          c.gen_layout = gl;
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

// ---- coarseness of common cases -----------------------------------------------------------------

PlanInput Llama70B(int64_t tokens, LayoutKind ctx_layout, LayoutKind gen_layout, ParallelConfig cp,
                   ParallelConfig gp) {
  KvShape shape{80, 8, 128, DType::kBf16, 2, 32};
  PlanInput in;
  const int64_t n = (tokens + 31) / 32;
  in.ctx = {shape, cp, ctx_layout, n + 64};
  in.gen = {shape, gp, gen_layout, n + 64};
  in.prompt_tokens = tokens;
  for (int64_t i = 0; i < n; ++i) {
    in.ctx_blocks.push_back(i + 3);
    in.gen_blocks.push_back(i + 17);
  }
  return in;
}

int64_t CountPieces(const PairPlan& p) {
  int64_t n = 0;
  for (const Chunk& c : p.chunks) n += static_cast<int64_t>(c.pieces.size());
  return n;
}

TEST(PlannerShape, BlockMajorIdenticalIsOnePiecePerRun) {
  PlanInput in = Llama70B(4096, LayoutKind::kBlockMajor, LayoutKind::kBlockMajor, {1, 1, {}, 1, 0},
                          {1, 1, {}, 1, 0});
  auto plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 1u);
  ASSERT_EQ(plan->pairs[0].chunks.size(), 1u);
  const Chunk& c = plan->pairs[0].chunks[0];
  EXPECT_TRUE(c.direct);
  EXPECT_EQ(c.bytes, 4096 * in.ctx.shape.BytesPerToken());
  EXPECT_EQ(c.last_layer, 79);
  // A gap in the ids splits the run; a partial last block adds one strided piece.
  in.gen_blocks[10] = 190;
  in.prompt_tokens = 3990;
  in.chunk_bytes = int64_t{1} << 40;  // the partial block's piece would be split at 4 MiB
  plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(CountPieces(plan->pairs[0]), 4);  // [0,10), {10}, [11,124), partial 124
}

TEST(PlannerShape, BlockMajorTp2ToTp4IsOnePiecePerPair) {
  PlanInput in = Llama70B(4096, LayoutKind::kBlockMajor, LayoutKind::kBlockMajor, {2, 1, {}, 1, 0},
                          {4, 1, {}, 1, 0});
  in.chunk_bytes = int64_t{1} << 40;
  auto plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 4u);
  for (const PairPlan& p : plan->pairs) {
    EXPECT_EQ(p.ctx_rank, p.gen_rank / 2);
    ASSERT_EQ(CountPieces(p), 1);
    const Piece& piece = p.chunks[0].pieces[0];
    EXPECT_EQ(piece.rows, 128 * 80 * 2);  // (block, layer, kv) rows of 2 heads x 32 tokens
    EXPECT_EQ(piece.bytes, 2 * 32 * 128 * 2);
  }
}

TEST(PlannerShape, PerLayerIdenticalIsOnePiecePerLayer) {
  PlanInput in = Llama70B(4096, LayoutKind::kPerLayer, LayoutKind::kPerLayer, {2, 1, {}, 1, 0},
                          {2, 1, {}, 1, 0});
  in.chunk_bytes = int64_t{1} << 40;
  auto plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 2u);
  const int64_t row = 128 * 32 * 4 * 128 * 2;  // all blocks of one layer's K (or V), 4 heads
  for (const PairPlan& p : plan->pairs) {
    // Per layer, K and V are each one contiguous run of all blocks on both sides: direct.
    ASSERT_EQ(p.chunks.size(), 160u);
    for (const Chunk& c : p.chunks) {
      EXPECT_TRUE(c.direct);
      EXPECT_EQ(c.bytes, row);
    }
  }
  // Nothing direct: one 2-row piece (K, V) per layer.
  in.direct_min_bytes = int64_t{1} << 40;
  plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok());
  for (const PairPlan& p : plan->pairs) {
    EXPECT_EQ(CountPieces(p), 80);
    EXPECT_EQ(p.chunks[0].pieces[0].rows, 2);
    EXPECT_EQ(p.chunks[0].pieces[0].bytes, row);
  }
}

TEST(PlannerShape, PerLayerTp1ToTp2IsOnePiecePerLayerAndKv) {
  PlanInput in = Llama70B(4096, LayoutKind::kPerLayer, LayoutKind::kPerLayer, {1, 1, {}, 1, 0},
                          {2, 1, {}, 1, 0});
  in.chunk_bytes = int64_t{1} << 40;
  auto plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 2u);
  for (const PairPlan& p : plan->pairs) {
    ASSERT_EQ(CountPieces(p), 80 * 2);  // rows of 4 heads, one row per token of all 128 blocks
    const Piece& piece = p.chunks[0].pieces[0];
    EXPECT_EQ(piece.rows, 128 * 32);
    EXPECT_EQ(piece.bytes, 4 * 128 * 2);
  }
}

TEST(PlannerShape, LayerWiseKeepsLayersApart) {
  PlanInput in = Llama70B(4096, LayoutKind::kBlockMajor, LayoutKind::kBlockMajor, {1, 1, {}, 1, 0},
                          {1, 1, {}, 1, 0});
  in.layer_wise = true;
  in.chunk_bytes = int64_t{1} << 40;
  auto plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 1u);
  // One piece per layer: a row per block (one layer's K and V of the block), ordered by layer.
  ASSERT_EQ(CountPieces(plan->pairs[0]), 80);
  int32_t layer = 0;
  for (const Chunk& c : plan->pairs[0].chunks) {
    for (const Piece& p : c.pieces) {
      EXPECT_EQ(p.layer, layer++);
      EXPECT_EQ(p.rows, 128);
      EXPECT_EQ(p.bytes, 2 * 8 * 32 * 128 * 2);
    }
  }
}

TEST(PlannerShape, DuplicatedHeadsSpreadOverReplicas) {
  // kv_heads 2 over TP 8: 4 replicas of each head. Identical splits pair each rank with itself.
  KvShape shape{4, 2, 8, DType::kBf16, 2, 4};
  Case c;
  c.shape = shape;
  c.ctx = {8, 1, {}, 1, 0};
  c.gen = {8, 1, {}, 1, 0};
  auto plan = PlanTransfer(MakeInput(c));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 8u);
  for (const PairPlan& p : plan->pairs) EXPECT_EQ(p.ctx_rank, p.gen_rank);
  // TP 8 -> TP 2 (one head per gen rank): gen rank g takes head g from replica g % 4.
  c.gen = {2, 1, {}, 1, 0};
  plan = PlanTransfer(MakeInput(c));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 2u);
  EXPECT_EQ(plan->ctx_peers_of_gen[0], std::vector<int32_t>{0});
  EXPECT_EQ(plan->ctx_peers_of_gen[1], std::vector<int32_t>{5});
  // TP 4 -> TP 8 (both duplicated): every ctx rank sends, every gen rank receives once per head.
  c.ctx = {4, 1, {}, 1, 0};
  c.gen = {8, 1, {}, 1, 0};
  plan = PlanTransfer(MakeInput(c));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 8u);
  for (int32_t r = 0; r < 4; ++r) EXPECT_EQ(plan->gen_peers_of_ctx[r].size(), 2u) << r;
}

TEST(PlannerShape, AttentionDpOnlyServingAndReceivingGroupsTakePart) {
  Case c;
  c.shape = KvShape{4, 4, 8, DType::kBf16, 2, 4};
  c.ctx = {4, 1, {}, 2, 1};  // group 1 = ranks 2, 3 (2 heads each)
  c.gen = {4, 2, {}, 4, 2};  // group 2 = ranks 2 and 6 (all heads, one PP stage each)
  auto plan = PlanTransfer(MakeInput(c));
  ASSERT_TRUE(plan.ok());
  std::vector<std::pair<int32_t, int32_t>> pairs;
  for (const PairPlan& p : plan->pairs) pairs.emplace_back(p.ctx_rank, p.gen_rank);
  EXPECT_EQ(pairs, (std::vector<std::pair<int32_t, int32_t>>{{2, 2}, {2, 6}, {3, 2}, {3, 6}}));
  EXPECT_TRUE(plan->gen_peers_of_ctx[0].empty());
  EXPECT_TRUE(plan->ctx_peers_of_gen[3].empty());
  auto none = PlanForGenRank(MakeInput(c), 0);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST(PlannerShape, BlockMajorToPerLayerIsRowsOfTokensPerHead) {
  PlanInput in = Llama70B(4096, LayoutKind::kBlockMajor, LayoutKind::kPerLayer, {1, 1, {}, 1, 0},
                          {1, 1, {}, 1, 0});
  auto plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 1u);
  EXPECT_EQ(CountPieces(plan->pairs[0]), 80 * 128 * 2 * 8);
  const Piece& p = plan->pairs[0].chunks[0].pieces[0];
  EXPECT_EQ(p.rows, 32);
  EXPECT_EQ(p.bytes, 256);
  // Staging is bounded by chunk_bytes, whatever the prompt.
  for (const Chunk& c : plan->pairs[0].chunks) EXPECT_LE(c.bytes, in.chunk_bytes);
}

// ---- errors -----------------------------------------------------------------------------------

PlanInput SmallInput() {
  Case c;
  c.shape = KvShape{4, 4, 8, DType::kBf16, 2, 4};
  c.ctx = {2, 1, {}, 1, 0};
  c.gen = {1, 2, {}, 1, 0};
  c.prompt = 10;
  return MakeInput(c);
}

void ExpectError(const PlanInput& in, std::vector<std::string_view> parts) {
  auto plan = PlanTransfer(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  for (auto part : parts) {
    EXPECT_NE(plan.status().message().find(part), std::string_view::npos)
        << plan.status().ToString() << " lacks '" << part << "'";
  }
  EXPECT_FALSE(PlanForCtxRank(in, 0).ok());
  EXPECT_FALSE(PlanForGenRank(in, 0).ok());
}

TEST(PlannerErrors, ShapeMismatchNamesBothValues) {
  PlanInput in = SmallInput();
  in.gen.shape.dtype = DType::kFp16;
  ExpectError(in, {"dtype mismatch: context bf16, generation fp16"});
  in = SmallInput();
  in.gen.shape.layers = 6;
  ExpectError(in, {"layers mismatch: context 4, generation 6"});
  in = SmallInput();
  in.ctx.shape.kv_heads = 8;
  ExpectError(in, {"kv_heads mismatch: context 8, generation 4"});
  in = SmallInput();
  in.gen.shape.head_dim = 16;
  ExpectError(in, {"head_dim mismatch: context 8, generation 16"});
  in = SmallInput();
  in.gen.shape.kv_factor = 1;
  ExpectError(in, {"kv_factor mismatch: context 2, generation 1"});
  in = SmallInput();
  in.ctx.shape.tokens_per_block = 8;
  ExpectError(in, {"tokens_per_block mismatch: context 8, generation 4"});
  EXPECT_FALSE(CheckCompatible(in.ctx, in.gen).ok());
  EXPECT_TRUE(CheckCompatible(SmallInput().ctx, SmallInput().gen).ok());
}

TEST(PlannerErrors, BadParallelConfigs) {
  PlanInput in = SmallInput();
  in.gen.parallel.tp = 3;
  ExpectError(in, {"generation", "kv_heads=4", "TP=3"});
  in = SmallInput();
  in.ctx.parallel.stage_layers = {3, 3};
  in.ctx.parallel.pp = 2;
  ExpectError(in, {"context", "sum to 6"});
  in = SmallInput();
  in.ctx.parallel.dp_size = 2;
  in.ctx.parallel.dp_rank = 2;
  ExpectError(in, {"context", "dp_rank=2"});
  in = SmallInput();
  in.gen.pool_blocks = 0;
  ExpectError(in, {"generation", "pool_blocks=0"});
}

TEST(PlannerErrors, BadBlocks) {
  PlanInput in = SmallInput();
  in.ctx_blocks[1] = in.ctx.pool_blocks;
  ExpectError(in, {"ctx_blocks[1]", fmt::format("block id {}", in.ctx.pool_blocks)});
  in = SmallInput();
  in.gen_blocks[2] = -1;
  ExpectError(in, {"gen_blocks[2]", "block id -1"});
  in = SmallInput();
  in.gen_blocks.pop_back();
  ExpectError(in, {"gen_blocks has 2 blocks but the prompt needs 3"});
  in = SmallInput();
  in.ctx_blocks.resize(1);
  ExpectError(in, {"ctx_blocks has 1 blocks but the prompt needs 3"});
  in = SmallInput();
  in.gen_blocks[2] = in.gen_blocks[0];
  ExpectError(in, {"gen_blocks[2]", "twice"});
  in = SmallInput();
  in.gen_reused_blocks = 4;
  ExpectError(in, {"gen_reused_blocks=4", "[0, 3]"});
  in = SmallInput();
  in.gen_reused_blocks = -1;
  ExpectError(in, {"gen_reused_blocks=-1"});
  in = SmallInput();
  in.prompt_tokens = 0;
  ExpectError(in, {"prompt_tokens=0"});
  in = SmallInput();
  in.chunk_bytes = 0;
  ExpectError(in, {"chunk_bytes=0"});
  in = SmallInput();
  EXPECT_FALSE(PlanForCtxRank(in, 2).ok());
  EXPECT_FALSE(PlanForGenRank(in, -1).ok());
  // Extra blocks beyond the prompt are allowed and ignored.
  in.ctx_blocks.push_back(in.ctx.pool_blocks - 1);
  EXPECT_TRUE(PlanTransfer(in).ok());
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

TEST(Planner, FullyReusedPromptMovesNothing) {
  PlanInput in = SmallInput();
  in.gen_reused_blocks = 3;
  auto plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(plan->pairs.empty());
  EXPECT_EQ(plan->total_bytes, 0);
  EXPECT_EQ(plan->gen_peers_of_ctx.size(), 2u);
  EXPECT_EQ(plan->ctx_peers_of_gen.size(), 2u);
}

// ---- planning time ------------------------------------------------------------------------------

double ThreadCpuMicros() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

TEST(PlannerTiming, Llama70B) {
  struct Row {
    const char* name;
    LayoutKind cl, gl;
    ParallelConfig cp, gp;
  };
  const Row rows[] = {
      {"TP1->TP1 block-major",
       LayoutKind::kBlockMajor,
       LayoutKind::kBlockMajor,
       {1, 1, {}, 1, 0},
       {1, 1, {}, 1, 0}},
      {"TP2->TP4 block-major",
       LayoutKind::kBlockMajor,
       LayoutKind::kBlockMajor,
       {2, 1, {}, 1, 0},
       {4, 1, {}, 1, 0}},
      {"TP1->TP1 per-layer",
       LayoutKind::kPerLayer,
       LayoutKind::kPerLayer,
       {1, 1, {}, 1, 0},
       {1, 1, {}, 1, 0}},
      {"TP1->TP1 block-major->per-layer",
       LayoutKind::kBlockMajor,
       LayoutKind::kPerLayer,
       {1, 1, {}, 1, 0},
       {1, 1, {}, 1, 0}},
  };
  for (const Row& row : rows) {
    for (auto [tokens, fragmented] :
         {std::pair<int64_t, bool>{4096, false}, {32768, false}, {4096, true}, {32768, true}}) {
      PlanInput in = Llama70B(tokens, row.cl, row.gl, row.cp, row.gp);
      if (fragmented) {  // every other block id: no two request blocks are neighbours
        in.ctx.pool_blocks = in.gen.pool_blocks = 2 * in.ctx_blocks.size() + 1;
        for (size_t i = 0; i < in.ctx_blocks.size(); ++i) {
          in.ctx_blocks[i] = 2 * static_cast<int64_t>(i);
          in.gen_blocks[i] = 2 * static_cast<int64_t>(i) + 1;
        }
      }
      int64_t pieces = 0, chunks = 0;
      auto run = [&] {
        auto plan = PlanTransfer(in);
        EXPECT_TRUE(plan.ok());
        pieces = chunks = 0;
        for (const PairPlan& p : plan->pairs) {
          pieces += CountPieces(p);
          chunks += static_cast<int64_t>(p.chunks.size());
        }
      };
      run();  // warm up
      // The build machine is shared: report thread CPU time (what planning costs) as well as
      // wall time (what it took here), best and median of 3 to 9 batches, per plan, plan
      // destruction included.
      const int iters = pieces > 10000 ? 1 : 50;
      const int batches = pieces > 100000 ? 3 : 9;
      std::vector<double> cpu_us, wall_us;
      for (int b = 0; b < batches; ++b) {
        const double c0 = ThreadCpuMicros();
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) run();
        wall_us.push_back(
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count() /
            iters);
        cpu_us.push_back((ThreadCpuMicros() - c0) / iters);
      }
      std::sort(cpu_us.begin(), cpu_us.end());
      std::sort(wall_us.begin(), wall_us.end());
      std::printf(
          "plan %-32s %5lld tokens %s: cpu best %8.1f median %8.1f us, wall best %8.1f us "
          "(%lld pieces, %lld chunks)\n",
          row.name, static_cast<long long>(tokens), fragmented ? "scattered " : "contiguous",
          cpu_us.front(), cpu_us[cpu_us.size() / 2], wall_us.front(),
          static_cast<long long>(pieces), static_cast<long long>(chunks));
    }
  }
}

}  // namespace
}  // namespace kvferry

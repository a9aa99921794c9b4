// Planner tests: coarseness of common cases, errors, planning time. The executed matrix is in
// planner_matrix_test.cc.
#include "planner/planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>

#include "testing/planner_test_util.h"

namespace kvferry::planner_test {
namespace {

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

// 2-D copies: the planes of every piece.
int64_t CountPlanes(const PairPlan& p) {
  int64_t n = 0;
  for (const Chunk& c : p.chunks) {
    for (const Piece& piece : c.pieces) n += piece.planes;
  }
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

TEST(PlannerShape, BlockMajorToPerLayerIsPlanesOfHeadsOfTokenRows) {
  PlanInput in = Llama70B(4096, LayoutKind::kBlockMajor, LayoutKind::kPerLayer, {1, 1, {}, 1, 0},
                          {1, 1, {}, 1, 0});
  for (size_t i = 0; i < in.ctx_blocks.size(); ++i) {  // scattered: no two blocks are neighbours
    in.ctx_blocks[i] = 2 * static_cast<int64_t>(i);
    in.gen_blocks[i] = 2 * static_cast<int64_t>(i) + 1;
  }
  in.ctx.pool_blocks = in.gen.pool_blocks = 2 * static_cast<int64_t>(in.ctx_blocks.size()) + 1;
  auto plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 1u);
  // One piece per (layer, block, kv): planes of heads, rows of tokens (a piece a chunk boundary
  // cuts goes in two).
  EXPECT_EQ(CountPlanes(plan->pairs[0]), 80 * 128 * 2 * 8);
  const int64_t cuts = static_cast<int64_t>(plan->pairs[0].chunks.size());
  EXPECT_LE(CountPieces(plan->pairs[0]), 80 * 128 * 2 + cuts);
  const Piece& p = plan->pairs[0].chunks[0].pieces.back();
  EXPECT_EQ(p.planes, 8);
  EXPECT_EQ(p.src_plane_pitch, 32 * 256);  // HND: a head's tokens follow each other
  EXPECT_EQ(p.dst_plane_pitch, 256);       // NHD: heads side by side in a token's row
  EXPECT_EQ(p.rows, 32);
  EXPECT_EQ(p.bytes, 256);
  // Staging is bounded by chunk_bytes, whatever the prompt.
  for (const Chunk& c : plan->pairs[0].chunks) EXPECT_LE(c.bytes, in.chunk_bytes);
}

TEST(PlannerShape, BlockMajorToPerLayerRunsAreOnePiecePerHeadWithPlanesOfBlocks) {
  PlanInput in = Llama70B(4096, LayoutKind::kBlockMajor, LayoutKind::kPerLayer, {1, 1, {}, 1, 0},
                          {1, 1, {}, 1, 0});  // consecutive blocks on both sides
  auto plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->pairs.size(), 1u);
  // A piece per (layer, kv, head): planes of blocks, rows of tokens; a chunk boundary cuts a
  // piece in two (whole planes on each side of it).
  EXPECT_EQ(CountPlanes(plan->pairs[0]), 80 * 2 * 8 * 128 + 0);
  const int64_t cuts = static_cast<int64_t>(plan->pairs[0].chunks.size());
  EXPECT_LE(CountPieces(plan->pairs[0]), 80 * 2 * 8 + cuts);
  const Piece& p = plan->pairs[0].chunks[0].pieces.front();
  EXPECT_GT(p.planes, 1);
  const int64_t block_bytes = 80 * 2 * 8 * 32 * 256;  // block-major: all of a block's layers
  EXPECT_EQ(p.src_plane_pitch, block_bytes);
  EXPECT_EQ(p.dst_plane_pitch, 32 * 8 * 256);  // per-layer NHD: a block's tokens of all heads
  EXPECT_EQ(p.rows, 32);
  EXPECT_EQ(p.bytes, 256);
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
  in.gen.shape.dtype = DType::kInt8;
  ExpectError(in, {"dtype mismatch: context bf16, generation int8"});
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
  in.ctx.shape.tokens_per_block = 6;
  ExpectError(in, {"tokens_per_block: context 6, generation 4: one must be a multiple"});
  EXPECT_FALSE(CheckCompatible(in.ctx, in.gen).ok());
  in = SmallInput();
  in.ctx.shape.tokens_per_block = 8;  // 8 -> 4 is compatible
  EXPECT_TRUE(CheckCompatible(in.ctx, in.gen).ok());
  EXPECT_TRUE(PlanTransfer(in).ok());
  in.ctx.shape.tokens_per_block = 2;  // 2 -> 4 too, but 10 tokens need 5 blocks of 2
  ExpectError(in, {"ctx_blocks has 3 blocks but the prompt needs 5"});
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

// A peer's pool_blocks, prompt_tokens and chunk_bytes are data: they may not size memory or
// overflow the plan's arithmetic.
TEST(PlannerErrors, HostileSizesAreBoundedNotAllocated) {
  PlanInput in = SmallInput();
  auto small = PlanTransfer(in);
  ASSERT_TRUE(small.ok());
  // A context pool of 2^40 blocks: planned without a bitmap over the pool (block-major offsets do
  // not depend on the block count, so the plan is the same).
  in.ctx.pool_blocks = int64_t{1} << 40;
  auto big = PlanTransfer(in);
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  EXPECT_EQ(big->pairs, small->pairs);
  in.ctx_blocks[0] = in.ctx.pool_blocks - 1;  // ids far apart still check for duplicates
  in.ctx_blocks[2] = in.ctx.pool_blocks - 1;
  ExpectError(in, {"ctx_blocks[2]", "twice"});
  // A pool whose bytes overflow int64.
  in = SmallInput();
  in.gen.pool_blocks = int64_t{1} << 60;
  ExpectError(in, {"generation", "pool_blocks=1152921504606846976", "overflow int64"});
  // A prompt near INT64_MAX: the block count is computed without overflow.
  in = SmallInput();
  in.prompt_tokens = INT64_MAX;
  ExpectError(in, {"ctx_blocks has 3 blocks but the prompt needs 2305843009213693952"});
}

TEST(PlannerErrors, MoreChunksThanDataTagsCanNumberAreRefused) {
  // 1,100 blocks of 4 KiB in one-byte chunks: 4.5 million chunks, more than the 2^20 a data tag
  // numbers; the plan is refused instead of aliasing tags (or reserving memory per chunk).
  KvShape shape{1, 4, 128, DType::kFp32, 2, 1};
  PlanInput in;
  in.ctx = {shape, {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 2000};
  in.gen = in.ctx;
  in.prompt_tokens = 1100;
  for (int64_t i = 0; i < 1100; ++i) {
    in.ctx_blocks.push_back(i);
    in.gen_blocks.push_back(1999 - i);
  }
  in.direct_min_bytes = INT64_MAX;
  in.chunk_bytes = 1;
  ExpectError(in, {"more than 1048576 chunks", "chunk_bytes=1"});
  in.chunk_bytes = 4096;
  EXPECT_TRUE(PlanTransfer(in).ok());
  in.direct_min_bytes = 0;  // every row direct: one chunk per 512-byte row, within the bound
  EXPECT_TRUE(PlanTransfer(in).ok());
}

// max_plan_bytes bounds the memory of the plan's chunks and pieces, all pairs together, whichever
// way they come (direct rows, packed parts): the plan is refused naming chunk_bytes and the bound.
TEST(PlannerErrors, PlanMemoryIsBoundedByMaxPlanBytes) {
  KvShape shape{1, 4, 128, DType::kFp32, 2, 1};
  PlanInput in;
  in.ctx = {shape, {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 2000};
  in.gen = {shape, {2, 1, {}, 1, 0}, LayoutKind::kPerLayer, 2000};
  in.prompt_tokens = 1100;
  for (int64_t i = 0; i < 1100; ++i) {
    in.ctx_blocks.push_back(i);
    in.gen_blocks.push_back(1999 - i);
  }
  in.chunk_bytes = 4096;
  in.direct_min_bytes = 0;  // every row direct: chunks counted as they are made
  auto unbounded = PlanTransfer(in);
  ASSERT_TRUE(unbounded.ok()) << unbounded.status().ToString();
  int64_t chunks = 0;
  for (const PairPlan& p : unbounded->pairs) chunks += static_cast<int64_t>(p.chunks.size());
  const int64_t need = chunks * kPlanChunkCharge;
  in.max_plan_bytes = need;  // exactly enough
  EXPECT_TRUE(PlanTransfer(in).ok());
  in.max_plan_bytes = need - 1;  // the last chunk of the second pair passes it
  auto st = PlanTransfer(in);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find(fmt::format("max_plan_bytes={}", need - 1)),
            std::string_view::npos)
      << st.status().ToString();
  // Each pair takes half: one rank's part alone is refused below half.
  in.max_plan_bytes = need / 2 - 1;
  ExpectError(in, {"chunk_bytes=4096", fmt::format("max_plan_bytes={}", need / 2 - 1), "pool"});
  // Packed: known up front to need more (no chunk is built).
  in.direct_min_bytes = INT64_MAX;
  in.chunk_bytes = 16;
  in.max_plan_bytes = 1 << 20;
  ExpectError(in, {"chunk_bytes=16 ", "max_plan_bytes=1048576"});
}

// The plan's time is bounded by max_plan_bytes too: every chunk is charged kPlanChunkCharge, more
// than its memory, so tiny chunks (a peer's chunk_bytes) are refused after max_plan_bytes / 512
// chunks, not after as many as fit in memory (handle_fuzz: a second of planning per handle).
TEST(PlannerErrors, PlanChunkCountIsBoundedByMaxPlanBytes) {
  KvShape shape{1, 4, 128, DType::kFp32, 2, 1};  // 512-byte rows
  PlanInput in;
  in.ctx = {shape, {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 200};
  in.gen = in.ctx;
  in.prompt_tokens = 110;
  for (int64_t i = 0; i < 110; ++i) {
    in.ctx_blocks.push_back(i);
    in.gen_blocks.push_back(199 - i);
  }
  in.direct_min_bytes = 1 << 20;  // below the pair's bytes (no refusal up front), above any row
  in.chunk_bytes = 8;             // 56,320 chunks of 8 bytes: 5.9 MB of chunks and pieces
  in.max_plan_bytes = 10 << 20;
  ExpectError(in, {"chunk_bytes=8 ", "max_plan_bytes=10485760"});
  in.chunk_bytes = 4096;  // the same request in 110 chunks
  EXPECT_TRUE(PlanTransfer(in).ok());
}

// The chunk cap (max_chunks, from the planning rank's own chunk size: PlanChunkCap) refuses a
// peer's tiny chunks that the memory charge alone lets through, naming the field and the bound:
// up front when nothing can go direct, while chunking otherwise (tiny direct_min_bytes).
TEST(PlannerErrors, PlanChunkCountIsBoundedByMaxChunks) {
  EXPECT_EQ(PlanChunkCap(int64_t{1} << 30, 4 << 20), 16384);  // 1 GiB in 4 MiB chunks, times 64
  EXPECT_EQ(PlanChunkCap(1000, 4 << 20), kPeerChunkSlack);    // a pool smaller than one chunk
  EXPECT_EQ(PlanChunkCap(INT64_MAX, 1), INT64_MAX / kPeerChunkSlack * kPeerChunkSlack);
  KvShape shape{1, 4, 128, DType::kFp32, 2, 1};  // 512-byte rows, 4 KiB blocks
  PlanInput in;
  in.ctx = {shape, {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 200};
  in.gen = in.ctx;
  in.prompt_tokens = 110;
  for (int64_t i = 0; i < 110; ++i) {
    in.ctx_blocks.push_back(i);
    in.gen_blocks.push_back(199 - i);
  }
  in.max_plan_bytes = 10 << 20;  // 20,480 chunks' charge: not the bound here
  in.max_chunks = 500;
  in.direct_min_bytes = int64_t{1} << 40;  // nothing direct
  in.chunk_bytes = 64;                     // 7,040 chunks
  ExpectError(in, {"chunk_bytes=64 ", "max_chunks=500 "});
  in.direct_min_bytes = 64;  // every block direct: 110 chunks, refused while chunking at 100
  in.chunk_bytes = 4096;
  in.max_chunks = 100;
  ExpectError(in, {"direct_min_bytes=64)", "max_chunks=100 "});
  in.max_chunks = 110;
  EXPECT_TRUE(PlanTransfer(in).ok());
  in.max_chunks = 500;
  in.direct_min_bytes = int64_t{1} << 40;  // nothing direct
  in.chunk_bytes = 1024;                   // 440 chunks
  EXPECT_TRUE(PlanTransfer(in).ok());
}

// Pieces alternating between direct and packed (a FETCH's direct_min_bytes between the two piece
// sizes) make a chunk per piece: each may reserve only what it holds, or a hostile FETCH makes
// the context rank allocate gigabytes (found by message_fuzz: out of memory).
TEST(PlannerErrors, ChunkReservationsFollowTheirContents) {
  KvShape shape{2, 2, 64, DType::kFp16, 2, 4};
  PlanInput in;
  in.ctx = {shape, {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 128};
  in.gen = {shape, {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 64};
  in.prompt_tokens = 4 * 40 - 1;  // a partial last block: a piece of another size
  for (int64_t i = 0; i < 40; ++i) {
    in.ctx_blocks.push_back(2 * i);
    in.gen_blocks.push_back(63 - i);
  }
  in.chunk_bytes = int64_t{1} << 30;
  in.direct_min_bytes = 512;  // whole blocks go direct, the partial block's rows are packed
  auto plan = PlanTransfer(in);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  size_t pieces = 0, reserved = 0;
  for (const PairPlan& p : plan->pairs) {
    for (const Chunk& c : p.chunks) {
      pieces += c.pieces.size();
      reserved += c.pieces.capacity();
    }
  }
  EXPECT_GT(pieces, 0u);
  EXPECT_LE(reserved, 2 * pieces + 64) << pieces << " pieces";
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
      {"TP4->TP2 block-major->per-layer-kv",
       LayoutKind::kBlockMajor,
       LayoutKind::kPerLayerKvNhd,
       {4, 1, {}, 1, 0},
       {2, 1, {}, 1, 0}},
      {"TP1->TP1 per-layer-hnd->per-layer",
       LayoutKind::kPerLayerHnd,
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
}  // namespace kvferry::planner_test

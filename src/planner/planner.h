// The transfer planner: which (context rank, generation rank) pairs exchange which bytes, for one
// request, whatever the TP / PP / attention-DP split and pool layout on each side.
//
// Pure: a function from descriptors to a plan, no I/O, no device, deterministic. Both sides of a
// transfer compute the same plan independently, so the message sequence between a pair (chunk k
// carries these pieces, in this order) needs no negotiation on the wire.
//
// Pieces are 2-D strided copies (rows of contiguous bytes), or 3-D (planes of them) when the
// layouts differ, the unit a copy engine, a pack kernel or a memcpy loop handles in one
// descriptor. A piece whose bytes are contiguous on both
// sides and large goes pool to pool directly (a "direct" chunk); smaller or strided pieces are
// packed back to back into a bounded staging chunk on the sender and unpacked on the receiver.
//
// Who sends what:
// - Only the context ranks of the DP group that served the request (ctx.parallel.dp_rank) send,
//   and only the generation ranks of the DP group that will decode it (gen.parallel.dp_rank)
//   receive. Ranks are pp_rank * tp + tp_rank on both sides.
// - Each generation rank receives every (layer, kv, head, token) it holds exactly once, from one
//   context rank holding it. When several context ranks hold a head (KV heads < attention TP),
//   generation rank g takes it from the replica with index g.tp_rank % replicas. Every
//   generation replica of a duplicated head gets its own copy.
// - Generation blocks [gen_reused_blocks, ceil(prompt_tokens / tokens_per_block)) move; a block
//   that ends mid-prompt moves only its valid tokens; nothing else on the generation side is
//   written. The sides' tokens per block may differ when one is a multiple of the other: the
//   tokens move in segments of the smaller block size, each inside one block on both sides.
//
// Cost: validation is O(blocks); each pair costs one step per run of consecutive block ids
// (consecutive on both sides; with different block sizes, one per segment) when a block's share
// is one piece, otherwise one step per emitted piece (a run's blocks are the planes of one piece
// when that makes fewer). Never one step per element or token.
//
// Thread-safety: all functions are pure and thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/kv_model.h"
#include "kvferry/status.h"
#include "model/coalesce.h"

namespace kvferry {

// The most chunks one (context rank, generation rank) pair may exchange: a chunk's index travels
// in the low 20 bits of its data tag (transceiver/wire/messages.h, kChunkTagBits). A plan needing
// more (tiny chunk_bytes for a large request) is refused with kInvalidArgument.
inline constexpr int64_t kMaxChunksPerPair = int64_t{1} << 20;

// What one chunk costs the plan's budget (max_plan_bytes): its memory (the Chunk, its first Piece
// and their heap blocks, about 120 bytes) and its work (an allocation while planning, a message
// and a credit round trip while sending). Charging more than the memory bounds the plan's time
// by the rank's own budget too: a peer's tiny chunk_bytes (a handle's, a FETCH's) makes at most
// max_plan_bytes / 512 chunks, not as many as fit in memory (found by handle_fuzz: seven-byte
// chunks cost a generation rank a second of planning under ASan). 512 bytes: no chunk of a real
// deployment's plan carries less (direct rows and staging chunks are far larger).
inline constexpr int64_t kPlanChunkCharge = 512;

// How many chunks a plan made for a peer may have follows from the planning rank's own chunk size:
// at most what its pool and staging make in chunks of its own size, times kPeerChunkSlack (a peer
// may use chunks, or direct_min_bytes, up to that much smaller than this rank's). A handle or
// FETCH naming tiny chunks is then refused at once, naming chunk_bytes and the bound, instead of
// being planned: the memory charge alone (kPlanChunkCharge) let a 1 GiB pool plan 2 million
// chunks (the data tag's limit, kMaxChunksPerPair, per pair); with 4 MiB chunks of its own it now
// plans at most 16,384.
inline constexpr int64_t kPeerChunkSlack = 64;
// PlanInput::max_chunks for a rank whose pool and staging hold `budget_bytes` and whose own
// staging chunks are `own_chunk_bytes`: max(budget / own, 1) * kPeerChunkSlack.
int64_t PlanChunkCap(int64_t budget_bytes, int64_t own_chunk_bytes);

// One side of a transfer: an instance's model, split and pool layout.
struct InstanceDesc {
  KvShape shape;
  ParallelConfig parallel;  // for the context side, dp_rank is the DP group serving the request
  LayoutKind layout = LayoutKind::kBlockMajor;
  int64_t pool_blocks = 0;  // blocks in each rank's pool (for the layout's strides)
  // With layout kCustom: the region split and strides (in elements, 0 on the axes that select a
  // region) of every rank's pool; all ranks of an instance share them. Zero with a named layout,
  // whose strides each rank derives from its own dims.
  RegionSplit split = RegionSplit::kNone;
  PoolStrides strides{};
  KvScales scales{};  // the instance's KV scales (none: every scale 1)
  bool operator==(const InstanceDesc&) const = default;
};

// Whether a transfer from `ctx` to `gen` converts its elements: the dtypes differ, or some
// (layer, kv, head) has another scale on each side.
bool Converts(const InstanceDesc& ctx, const InstanceDesc& gen);
// Either side keeps per-block scales (ScaleGranularity::kBlock): the transfer converts, and each
// piece plane is one scale group (Piece::src_scale_at, dst_scale_at).
bool BlockScaled(const InstanceDesc& ctx, const InstanceDesc& gen);

// The layout `d` gives a rank whose pool has `dims`: the named layout's, or the instance's custom
// strides over these dims (validated: no two elements at one address, dim axis contiguous).
StatusOr<PoolLayout> LayoutOf(const InstanceDesc& d, const PoolDims& dims, int64_t element_bytes);
// Sets d's layout fields from a pool's layout: its kind when it is a named one; else kCustom with
// the pool's split and strides.
void DescribeLayout(const PoolLayout& layout, InstanceDesc& d);

struct PlanInput {
  InstanceDesc ctx;
  InstanceDesc gen;
  int64_t prompt_tokens = 0;        // tokens of the request's KV (the last block may be partial)
  std::vector<int64_t> ctx_blocks;  // the request's blocks on every context rank, in order
  std::vector<int64_t> gen_blocks;  // destination blocks on every generation rank, in order
  int64_t gen_reused_blocks = 0;    // leading blocks the generation side already holds
  int64_t chunk_bytes = 4 << 20;    // staging chunk size bound
  int64_t direct_min_bytes = 256 << 10;  // contiguous pieces at least this large go direct
  // Every piece holds one layer, so a chunk can be sent as soon as its layer is computed
  // (layer-wise transfer overlapping prefill). Otherwise a piece may span layers when the
  // layouts allow it (fewer, larger pieces; a chunk then waits for its last_layer).
  bool layer_wise = false;
  // The most memory the plan's chunks and pieces may take, all pairs together (0: no bound); each
  // chunk is charged kPlanChunkCharge, each further piece its size.
  // chunk_bytes and direct_min_bytes come from the peer (a FETCH, a handle): each side passes its
  // own pool and staging bytes here, so a peer can't make it allocate more than that (nor plan for
  // longer). A plan that would need more is refused, naming chunk_bytes and this bound.
  int64_t max_plan_bytes = 0;
  // The most chunks the plan may have, all pairs together (0: no bound; PlanChunkCap). A plan
  // that would need more is refused, naming chunk_bytes, direct_min_bytes and this bound.
  int64_t max_chunks = 0;
};

// A 3-D copy: `planes` planes of a 2-D copy (model/coalesce.h) of `rows` rows of `bytes`; row r
// of plane q at src_offset + q * src_plane_pitch + r * src_pitch in the context rank's pool
// region src_region, to dst_offset + q * dst_plane_pitch + r * dst_pitch in the generation rank's
// region dst_region. Packed (staging), its rows go back to back, plane by plane. Planes carry a
// layout conversion's third axis (HND <-> NHD: heads x tokens of head_dim rows per block) in one
// piece instead of one piece per head; most pieces have one plane.
struct Piece : StridedRun {
  // Highest global layer among the piece's bytes (a piece may span several layers when the
  // layouts allow it); layer-wise transfer sends a chunk once its layers are ready.
  int32_t layer = 0;
  // The scales of the piece's elements on each side (KvScales::At), when the transfer converts
  // with scales: the planner then cuts pieces that lie in one (layer, kv) and, per head, one head.
  float src_scale = 1.0f;
  float dst_scale = 1.0f;
  // Per-block scales (ScaleGranularity::kBlock): the index of the first plane's scale in the
  // side's BlockPool::block_scales (plane q at + q: planes run over heads), -1 when that side has
  // none. Each plane is then one scale group, a (block, layer, kv, head)'s moved tokens; a piece
  // with a generation index is never cut below a plane, and its scales are packed after the
  // chunk's rows (Chunk::scale_bytes).
  int64_t src_scale_at = -1;
  int64_t dst_scale_at = -1;
  int64_t planes = 1;
  int64_t src_plane_pitch = 0;  // unused when planes == 1
  int64_t dst_plane_pitch = 0;
  int64_t total() const { return bytes * rows * planes; }
  // Bytes from src_offset (dst_offset) to the end of the piece's last row on that side.
  int64_t src_span() const {
    return (planes - 1) * src_plane_pitch + (rows - 1) * src_pitch + bytes;
  }
  int64_t dst_span() const {
    return (planes - 1) * dst_plane_pitch + (rows - 1) * dst_pitch + bytes;
  }
  // Planes [first, first + count) as a piece of their own.
  Piece Planes(int64_t first, int64_t count) const {
    Piece p = *this;
    p.src_offset += first * src_plane_pitch;
    p.dst_offset += first * dst_plane_pitch;
    if (src_scale_at >= 0) p.src_scale_at += first;
    if (dst_scale_at >= 0) p.dst_scale_at += first;
    p.planes = count;
    if (count == 1) p.src_plane_pitch = p.dst_plane_pitch = 0;
    return p;
  }
  Piece Plane(int64_t q) const { return Planes(q, 1); }
  bool operator==(const Piece&) const = default;
};

// A unit of transfer between one pair. A direct chunk is one piece with rows == 1 (contiguous on
// both sides), at least direct_min_bytes, copied pool to pool. A packed chunk holds pieces whose
// rows are packed back to back, in order, into a staging buffer of `bytes` <= chunk_bytes on the
// sender and unpacked from it on the receiver.
struct Chunk {
  bool direct = false;  // one contiguous piece, sent from the source pool into the destination pool
  int32_t last_layer = 0;  // highest global layer among its pieces
  int64_t bytes = 0;       // sum of piece totals (the rows' packed size)
  // Per-block scales written at the generation side (Piece::dst_scale_at): 4 bytes per plane of
  // those pieces, packed in piece order after the rows, from ScaleAreaOffset.
  int64_t scale_bytes = 0;
  std::vector<Piece> pieces;
  int64_t scale_area_offset() const { return (bytes + 15) / 16 * 16; }
  // Bytes of the chunk packed into staging: its rows, then its scales (if any) 16-byte aligned.
  int64_t packed_bytes() const { return scale_bytes ? scale_area_offset() + scale_bytes : bytes; }
  bool operator==(const Chunk&) const = default;
};

// Everything one context rank sends to one generation rank. Pieces are ordered by global layer
// first, so chunks come in non-decreasing last_layer and layer-wise sending can gate each chunk
// on its last_layer; within a layer, by block (or, when that lets runs of consecutive blocks
// merge into one piece, by kv / head, then block). Both sides derive the same chunk sequence.
struct PairPlan {
  int32_t ctx_rank = 0;
  int32_t gen_rank = 0;
  int64_t bytes = 0;
  std::vector<Chunk> chunks;
  bool operator==(const PairPlan&) const = default;
};

struct TransferPlan {
  std::vector<PairPlan> pairs;  // sorted by (ctx_rank, gen_rank)
  int64_t total_bytes = 0;
  // The generation ranks each context rank sends to, and the reverse (for completion counting).
  std::vector<std::vector<int32_t>> gen_peers_of_ctx;  // indexed by ctx rank
  std::vector<std::vector<int32_t>> ctx_peers_of_gen;  // indexed by gen rank
};

// Checks that the two sides can exchange caches at all (same layers, heads, head dim, kv factor;
// dtypes equal or both convertible (ElementFormatOf); tokens per block equal or one a multiple of
// the other); errors name both values.
Status CheckCompatible(const InstanceDesc& ctx, const InstanceDesc& gen);

StatusOr<TransferPlan> PlanTransfer(const PlanInput& input);

// The element conversion a plan's copies make (context dtype to generation dtype), or none when
// the transfer does not convert (Converts: equal dtypes and scales). With scales, each piece's
// src_scale and dst_scale go with its copy (CopyDesc), the dtypes possibly equal. With one, a
// piece's `bytes`, offsets and pitches at the destination are in the generation dtype's bytes, and
// at the source in the context dtype's (a source row holds bytes / gen element size elements);
// chunks are packed in the generation dtype (the sender converts while packing, or while copying
// into a peer's pool), and no chunk is direct (DirectMin: a direct chunk is copied as it is).
std::optional<Conversion> PlanConversion(const PlanInput& input);
// The element format of a dtype a plan can convert (fp32, fp16, bf16, fp8 e4m3), or none.
std::optional<ElementFormat> ElementFormatOf(DType dtype);

// Only the pairs of one context rank / one generation rank (each side plans only its own part;
// cheaper than the whole plan for large instances).
StatusOr<std::vector<PairPlan>> PlanForCtxRank(const PlanInput& input, int32_t ctx_rank);
StatusOr<std::vector<PairPlan>> PlanForGenRank(const PlanInput& input, int32_t gen_rank);

// Who talks to whom (wire version 8): generation rank g fetches from the context ranks that send it
// something and, when g is the first rank of its DP group, also from every context rank that sends
// nothing to any generation rank (so that each hears of the request and can release it). Pairs
// with nothing to move otherwise exchange no message. Both ascending; a rank outside the request's
// DP group is an error.
StatusOr<std::vector<int32_t>> CtxRanksToFetch(const PlanInput& input, int32_t gen_rank);
StatusOr<std::vector<int32_t>> GenRanksFetching(const PlanInput& input, int32_t ctx_rank);

}  // namespace kvferry

// The transfer planner. See planner.h for the contract.
//
// How a plan is built, per (context rank, generation rank) pair:
//   1. The pair's share: the global layers both hold, and the global heads both hold for which
//      this context rank is the chosen sender (one sender per head and generation rank).
//   2. The share of one block (of one segment, when the sides' block sizes differ: the smaller
//      size's tokens, inside one block on each side) is a 4-D box (layer, kv, head, token) of
//      head_dim-element rows. A "template" turns the box into 2-D pieces: axes contiguous on
//      both sides merge into the contiguous run (dim first); the axis, or chain of axes, giving
//      the most rows becomes the row axis (any pitch on each side); the rest are enumerated, the
//      innermost of them as the pieces' planes when blocks are enumerated one by one. A block
//      that ends mid-prompt has its own template (fewer tokens).
//   3. Pieces are emitted ordered by global layer (when layers are enumerated), then by block
//      (or by the other enumerated axes, then block, when runs of blocks merge), and each is
//      merged with the previous one when the result is still one 2-D piece: runs of consecutive
//      block ids on both sides collapse to one piece, 2-D when the layouts allow it, else with a
//      plane per block (layout conversions: one piece per head and run, not one per block).
//   4. Merged pieces go to a chunker: big contiguous pieces become direct chunks, others are
//      packed into chunks of at most chunk_bytes (split by planes, then rows, or by bytes for
//      huge rows).
// The cost is one step per run of consecutive block ids plus one per emitted piece; no step per
// element or per token.
#include "planner/planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <limits>
#include <optional>

#include "model/coalesce.h"
#include "planner/chunker.h"
#include "planner/plan_input.h"

namespace kvferry {
namespace {

// ---- geometry ---------------------------------------------------------------------------------

// The axes of a block's box; dim is always whole and always the innermost run.
enum BoxAxis : int { kL = 0, kK, kH, kT, kBoxAxes };
constexpr int kLayoutAxisOf[kBoxAxes] = {kLayerAxis, kKvAxis, kHeadAxis, kTokenAxis};

// One side of a pair: byte strides of its pool and where the pair's box starts in it.
struct Side {
  std::array<int64_t, kBoxAxes> stride{};  // bytes
  int64_t block_stride = 0;                // bytes
  bool layer_regions = false;              // each layer its own region (not a stride)
  bool kv_regions = false;                 // K and V in separate regions (not a stride)
  int32_t kv_factor = 1;
  int64_t base = 0;    // offset of (block 0, first layer, kv 0, first head, token 0)
  int32_t layer0 = 0;  // local index of the box's first layer
};

Side MakeSide(const PoolLayout& layout, int64_t local_layer0, int64_t local_head0) {
  Side s;
  const int64_t eb = layout.element_bytes();
  for (int a = 0; a < kBoxAxes; ++a) s.stride[a] = layout.strides()[kLayoutAxisOf[a]] * eb;
  s.block_stride = layout.strides()[kBlockAxis] * eb;
  s.layer_regions = layout.region_per_layer();
  s.kv_regions = layout.region_per_kv();
  s.kv_factor = static_cast<int32_t>(layout.dims()[kKvAxis]);
  s.base = layout.ByteOffset(0, local_layer0, 0, local_head0, 0, 0);
  s.layer0 = static_cast<int32_t>(local_layer0);
  return s;
}

// How one block's box becomes 2-D pieces.
struct Template {
  int64_t bytes = 0;  // contiguous run per row
  int64_t rows = 1;
  int64_t src_pitch = 0, dst_pitch = 0;
  bool layer_outer = false;   // layers enumerated (outermost loop)
  int n = 0;                  // other enumerated axes, outermost first
  std::array<int, 3> axis{};  // the box axis (BoxAxis) of each
  std::array<int64_t, 3> ext{}, src_step{}, dst_step{};
};

// `apart`: box axes kept out of runs and rows (enumerated): layers for layer-wise sending, the axes
// a transfer's scales vary over (ScaleAxes).
Template BuildTemplate(const std::array<int64_t, kBoxAxes>& ext, const Side& src, const Side& dst,
                       int64_t row_bytes, AxisSet apart) {
  // Layers in separate regions (or kept apart) are never folded into runs or rows.
  if (src.layer_regions || dst.layer_regions) apart |= AxisSet{1} << kL;
  CopyAxis copy_axes[kBoxAxes];
  AxisSet foldable = 0;
  std::array<bool, kBoxAxes> used{};
  for (int a = 0; a < kBoxAxes; ++a) {
    copy_axes[a] = CopyAxis{ext[a], src.stride[a], dst.stride[a]};
    used[a] = ext[a] <= 1;
    if (!used[a] && !InSet(apart, a)) foldable |= AxisSet{1} << a;
  }
  Template t;
  // Contiguous on both sides: grow the run.
  const ContiguousRun folded = FoldContiguous(copy_axes, foldable, row_bytes);
  t.bytes = folded.bytes;
  foldable &= ~folded.axes;
  // The row axis: the chain of axes (each stepping over the ones before on both sides) with the
  // most rows. Ties go to the first axis in (layer, kv, head, token) order.
  RowChain best;
  for (int a0 = 0; a0 < kBoxAxes; ++a0) {
    if (!InSet(foldable, a0)) continue;
    const RowChain chain = ChainRows(copy_axes, foldable, a0);
    if (chain.rows > best.rows) best = chain;
  }
  t.rows = best.rows;
  if (best.axes != 0) {
    t.src_pitch = best.src_pitch;
    t.dst_pitch = best.dst_pitch;
  }
  for (int a = 0; a < kBoxAxes; ++a) {
    used[a] = used[a] || InSet(folded.axes | best.axes, a);
  }
  // Enumerated axes: layers outermost, then by decreasing source stride.
  t.layer_outer = !used[kL];
  std::array<int, 3> axes{};
  for (int a = kK; a < kBoxAxes; ++a) {
    if (!used[a]) axes[t.n++] = a;
  }
  for (int i = 1; i < t.n; ++i) {  // insertion sort (n <= 3)
    for (int j = i; j > 0 && src.stride[axes[j]] > src.stride[axes[j - 1]]; --j) {
      std::swap(axes[j], axes[j - 1]);
    }
  }
  for (int i = 0; i < t.n; ++i) {
    t.axis[i] = axes[i];
    t.ext[i] = ext[axes[i]];
    t.src_step[i] = src.stride[axes[i]];
    t.dst_step[i] = dst.stride[axes[i]];
  }
  return t;
}

// ---- ranks and pairs --------------------------------------------------------------------------

// The tokens that move, in segments: a segment is min(ctx, gen tokens per block) tokens that lie
// in one block on each side (the last may be shorter: partial). With equal block sizes a segment
// is a block, and consecutive blocks whose ids are consecutive on both sides form one run.
struct BlockRun {
  int64_t ctx = 0;        // index into ctx_blocks of the run's first segment
  int64_t gen = 0;        // index into gen_blocks
  int64_t count = 0;      // segments (more than one only with equal block sizes)
  int64_t ctx_token = 0;  // the first token's offset within its block, on each side
  int64_t gen_token = 0;
  bool partial = false;
};

struct Segments {
  int64_t tokens = 0;      // per segment: min(ctx, gen tokens per block)
  int64_t last_valid = 0;  // tokens of the last segment (== tokens unless the prompt ends mid-way)
  std::vector<BlockRun> runs;
};

Segments SegmentsOf(const PlanInput& in) {
  Segments out;
  const int64_t tc = in.ctx.shape.tokens_per_block;
  const int64_t tg = in.gen.shape.tokens_per_block;
  const int64_t seg = std::min(tc, tg);
  out.tokens = seg;
  const int64_t end = in.prompt_tokens;
  out.last_valid = end - (end - 1) / seg * seg;
  for (int64_t t = in.gen_reused_blocks * tg; t < end; t += seg) {
    const bool partial = end - t < seg;
    BlockRun r{t / tc, t / tg, 1, t % tc, t % tg, partial};
    BlockRun* last = out.runs.empty() ? nullptr : &out.runs.back();
    if (tc == tg && last && !partial && !last->partial &&
        in.ctx_blocks[r.ctx] == in.ctx_blocks[r.ctx - 1] + 1 &&
        in.gen_blocks[r.gen] == in.gen_blocks[r.gen - 1] + 1) {
      ++last->count;
    } else {
      out.runs.push_back(r);
    }
  }
  return out;
}

// Whether the pieces of consecutive blocks (consecutive ids on both sides) at the same
// enumerated-axes index merge into one piece.
bool RunMerges(const Template& t, const Side& src, const Side& dst) {
  return (src.block_stride == t.bytes && dst.block_stride == t.bytes) || t.rows == 1 ||
         (src.block_stride == t.rows * t.src_pitch && dst.block_stride == t.rows * t.dst_pitch);
}

// Turns `p` (bytes, rows and pitches of one block's piece, one plane) into the piece covering
// `count` consecutive blocks: one 2-D piece when RunMerges, else a 3-D piece whose planes are the
// blocks (a block's rows are a plane; a layout conversion's runs of blocks, e.g. block-major HND
// -> per-layer NHD, one piece per head and run instead of one per block).
void MergeRun(const Template& t, const Side& src, const Side& dst, int64_t count, Piece& p) {
  if (src.block_stride == t.bytes && dst.block_stride == t.bytes) {
    p.bytes = t.bytes * count;  // rows grow side by side
  } else if (t.rows == 1) {
    p.rows = count;  // one row per block
    p.src_pitch = src.block_stride;
    p.dst_pitch = dst.block_stride;
  } else if (src.block_stride == t.rows * t.src_pitch && dst.block_stride == t.rows * t.dst_pitch) {
    p.rows = t.rows * count;  // the row axis continues into the next block
  } else {
    p.planes = count;  // a plane per block
    p.src_plane_pitch = src.block_stride;
    p.dst_plane_pitch = dst.block_stride;
  }
}

// Calls fn(src_delta, dst_delta, index) for every index of the template's enumerated axes,
// innermost fastest (index[k]: the position along t.axis[k]).
using Index = std::array<int64_t, 3>;

template <typename Fn>
void ForEachIndex(const Template& t, Fn&& fn) {
  Index idx{};
  while (true) {
    int64_t sd = 0, dd = 0;
    for (int k = 0; k < t.n; ++k) {
      sd += idx[k] * t.src_step[k];
      dd += idx[k] * t.dst_step[k];
    }
    fn(sd, dd, idx);
    int k = t.n - 1;
    for (; k >= 0; --k) {
      if (++idx[k] < t.ext[k]) break;
      idx[k] = 0;
    }
    if (k < 0) return;
  }
}

struct Context {
  const PlanInput& in;
  int64_t needed = 0;          // generation blocks of the prompt
  Segments segs;               // the tokens that move
  std::vector<RankSlice> ctx;  // ctx ranks of the serving DP group (ascending rank)
  std::vector<RankSlice> gen;  // gen ranks of the receiving DP group (ascending rank)
};

StatusOr<std::vector<RankSlice>> GroupSlices(const InstanceDesc& d,
                                             std::optional<int32_t> only_rank) {
  std::vector<RankSlice> out;
  const int32_t lo = only_rank ? *only_rank : 0;
  const int32_t hi = only_rank ? *only_rank + 1 : d.parallel.world_size();
  for (int32_t r = lo; r < hi; ++r) {
    KVF_ASSIGN_OR_RETURN(RankSlice s, SliceOf(d.shape, d.parallel, r));
    if (s.dp_group == d.parallel.dp_rank) out.push_back(s);
  }
  return out;
}

Status TooManyChunks(const RankSlice& c, const RankSlice& g, const PlanInput& in) {
  return Status::InvalidArgument(fmt::format(
      "context rank {} -> generation rank {}: more than {} chunks of at most chunk_bytes={} "
      "(direct_min_bytes={}); use larger chunks",
      c.rank, g.rank, kMaxChunksPerPair, in.chunk_bytes, in.direct_min_bytes));
}

Status TooBig(const RankSlice& c, const RankSlice& g, const PlanInput& in, int64_t plan_bytes) {
  return Status::InvalidArgument(fmt::format(
      "context rank {} -> generation rank {}: a plan of chunks of at most chunk_bytes={} "
      "(direct_min_bytes={}) needs more than {} bytes of memory, the bound (max_plan_bytes={}: "
      "this rank's pool and staging); use larger chunks",
      c.rank, g.rank, in.chunk_bytes, in.direct_min_bytes, plan_bytes, in.max_plan_bytes));
}

Status OverCap(const RankSlice& c, const RankSlice& g, const PlanInput& in) {
  return Status::InvalidArgument(fmt::format(
      "context rank {} -> generation rank {}: a plan of chunks of at most chunk_bytes={} "
      "(direct_min_bytes={}) makes more than max_chunks={} chunks, the bound of this rank (its "
      "pool and staging in chunks of its own size, times {}); use larger chunks",
      c.rank, g.rank, in.chunk_bytes, in.direct_min_bytes, in.max_chunks, kPeerChunkSlack));
}

// Whether context rank c sends anything to generation rank g: layers and heads both hold (c is
// the replica chosen for g when heads are duplicated), and some block is not reused.
bool Exchanges(const PlanInput& in, int64_t needed, const RankSlice& c, const RankSlice& g) {
  const int32_t l0 = std::max(c.layer_begin, g.layer_begin);
  const int32_t l1 = std::min(c.layer_begin + c.layer_count, g.layer_begin + g.layer_count);
  if (l0 >= l1) return false;
  // When several context ranks hold a head (duplicated heads), generation rank g takes it from
  // replica g.tp_rank % replicas.
  if (c.head_replicas > 1 && c.replica_index != g.tp_rank % c.head_replicas) return false;
  const int32_t h0 = std::max(c.head_begin, g.head_begin);
  const int32_t h1 = std::min(c.head_begin + c.head_count, g.head_begin + g.head_count);
  return h0 < h1 && in.gen_reused_blocks < needed;
}

// The box a pair moves: the layers and heads both ranks hold.
struct PairBox {
  int32_t l0 = 0, l1 = 0;  // global layers [l0, l1)
  int32_t h0 = 0, h1 = 0;  // heads [h0, h1)
};

PairBox BoxOf(const RankSlice& c, const RankSlice& g) {
  return PairBox{std::max(c.layer_begin, g.layer_begin),
                 std::min(c.layer_begin + c.layer_count, g.layer_begin + g.layer_count),
                 std::max(c.head_begin, g.head_begin),
                 std::min(c.head_begin + c.head_count, g.head_begin + g.head_count)};
}

// How a pair's box is cut into pieces: both sides' geometry, the piece templates of full blocks
// and of the last, partial one, and the loops around them.
struct PairCut {
  Side src, dst;
  Template full, part;
  int64_t row_bytes = 0;
  int64_t kv_iters = 1;     // kv is a loop outside the template (K and V in separate regions)
  int64_t layer_iters = 1;  // layers are a loop outside the template
  bool layer_outer = false;
  bool axes_outside = false;  // enumerated axes outside the block loop (runs of blocks merge)
  AxisSet scale_axes = 0;     // the box axes the pieces' scales vary over (ScaleAxes)
  // Per-block scales on either side (BlockScaled): no piece spans two blocks, and a block's pieces
  // may be planes of heads (one scale group each); the slices give the scales' indices.
  bool block_scaled = false;
  RankSlice ctx_slice, gen_slice;
};

// With a conversion whose scales are not all 1, each piece lies in one (layer, kv) and, with scales
// per head on either side, one head: those axes are enumerated, never folded into a piece.
AxisSet ScaleAxes(const PlanInput& in) {
  const ScaleGranularity a = in.ctx.scales.granularity, b = in.gen.scales.granularity;
  if ((a == ScaleGranularity::kNone && b == ScaleGranularity::kNone) || !Converts(in.ctx, in.gen))
    return 0;
  AxisSet axes = (AxisSet{1} << kL) | (AxisSet{1} << kK);
  if (a == ScaleGranularity::kHead || b == ScaleGranularity::kHead || BlockScaled(in.ctx, in.gen))
    axes |= AxisSet{1} << kH;
  return axes;
}

StatusOr<PairCut> CutPair(const Context& cx, const RankSlice& c, const RankSlice& g,
                          const PairBox& b) {
  const PlanInput& in = cx.in;
  const KvShape& shape = in.ctx.shape;
  // Both layouts in the generation side's element bytes: pieces come out in destination bytes
  // (ScaleSource then moves the source's fields to its own element size when the dtypes differ).
  const int64_t eb = in.gen.shape.ElementBytes();
  KVF_ASSIGN_OR_RETURN(const PoolLayout cl,
                       LayoutOf(in.ctx, RankPoolDims(shape, c, in.ctx.pool_blocks), eb));
  KVF_ASSIGN_OR_RETURN(const PoolLayout gl,
                       LayoutOf(in.gen, RankPoolDims(in.gen.shape, g, in.gen.pool_blocks), eb));
  PairCut cut;
  cut.src = MakeSide(cl, b.l0 - c.layer_begin, b.h0 - c.head_begin);
  cut.dst = MakeSide(gl, b.l0 - g.layer_begin, b.h0 - g.head_begin);
  const Side& src = cut.src;
  const Side& dst = cut.dst;
  const int64_t tpb = cx.segs.tokens;
  const int64_t last_valid = cx.segs.last_valid;
  cut.row_bytes = shape.head_dim * eb;
  // When either side keeps K and V in separate regions, kv is a loop outside the template (each
  // piece lies in one region on both sides), like layers of per-layer pools.
  const bool kv_outer = src.kv_regions || dst.kv_regions;
  cut.kv_iters = kv_outer ? shape.kv_factor : 1;
  std::array<int64_t, kBoxAxes> ext{b.l1 - b.l0, kv_outer ? 1 : shape.kv_factor, b.h1 - b.h0, tpb};
  const bool has_full =
      cx.segs.runs.size() > 1 || cx.segs.runs.front().count > 1 || last_valid == tpb;
  cut.scale_axes = ScaleAxes(in);
  cut.block_scaled = BlockScaled(in.ctx, in.gen);
  cut.ctx_slice = c;
  cut.gen_slice = g;
  const AxisSet apart = cut.scale_axes | (in.layer_wise ? AxisSet{1} << kL : 0);
  cut.full = BuildTemplate(ext, src, dst, cut.row_bytes, apart);
  ext[kT] = last_valid;
  cut.part = BuildTemplate(ext, src, dst, cut.row_bytes, apart);
  if (last_valid < tpb && has_full && cut.full.layer_outer != cut.part.layer_outer) {
    // Keep one piece order (layer, then block) for both: enumerate layers in both.
    ext[kT] = tpb;
    cut.full = BuildTemplate(ext, src, dst, cut.row_bytes, apart | AxisSet{1} << kL);
    ext[kT] = last_valid;
    cut.part = BuildTemplate(ext, src, dst, cut.row_bytes, apart | AxisSet{1} << kL);
  }
  cut.layer_outer = (last_valid < tpb ? cut.part : cut.full).layer_outer;
  cut.layer_iters = cut.layer_outer ? b.l1 - b.l0 : 1;
  // Enumerated axes outside the block loop when that lets runs of blocks merge into one piece
  // (e.g. per-layer pools: K and V are far apart, consecutive blocks of K are neighbours); the
  // order is then (layer, enumerated axes, block) instead of (layer, block, enumerated axes).
  // Otherwise, when a block's pieces would be planes of one piece (a 2-D box per enumerated index,
  // the innermost of them as planes), the runs' blocks become the planes instead when that makes
  // fewer pieces: ext / inner ext pieces per block against ext per run.
  int64_t full_blocks = 0, full_runs = 0;
  for (const BlockRun& run : cx.segs.runs) {
    if (run.partial) continue;
    full_blocks += run.count;
    ++full_runs;
  }
  const Template& f = cut.full;
  cut.axes_outside = !cut.block_scaled && f.n > 0 && full_blocks > full_runs &&
                     (RunMerges(f, src, dst) || f.ext[f.n - 1] * full_runs < full_blocks);
  return cut;
}

// Refuses a pair that can only be staged into more chunks than the bounds allow, before building
// its plan, and reserves room for its chunks in `out`.
Status ReserveChunks(const Context& cx, const RankSlice& c, const RankSlice& g, const PairBox& b,
                     int64_t row_bytes, int64_t plan_bytes, int64_t plan_chunks, PairPlan& out) {
  const PlanInput& in = cx.in;
  const KvShape& shape = in.ctx.shape;
  const int64_t moved_tokens =
      in.prompt_tokens - in.gen_reused_blocks * in.gen.shape.tokens_per_block;
  // Fits: at most the bytes of the request's distinct blocks in a pool (CheckSide).
  const int64_t pair_bytes =
      (b.l1 - b.l0) * shape.kv_factor * (b.h1 - b.h0) * moved_tokens * row_bytes;
  // Nothing can go direct: the chunk count is known now (no need to build a plan to refuse).
  const int64_t min_chunks = pair_bytes / in.chunk_bytes;
  const bool none_direct = DirectMin(in) > pair_bytes;
  if (none_direct && min_chunks >= kMaxChunksPerPair) {
    return TooManyChunks(c, g, in);
  }
  // Each chunk holds a piece at least.
  constexpr int64_t kChunkCost = kPlanChunkCharge;
  const int64_t left = in.max_plan_bytes - plan_bytes;
  if (in.max_plan_bytes > 0 && none_direct && min_chunks > left / kChunkCost)
    return TooBig(c, g, in, plan_bytes + min_chunks * kChunkCost);
  if (in.max_chunks > 0 && none_direct && min_chunks > in.max_chunks - plan_chunks) {
    return OverCap(c, g, in);
  }
  int64_t reserve = std::min(min_chunks + 1, kMaxChunksPerPair);
  if (in.max_plan_bytes > 0) reserve = std::min(reserve, std::max<int64_t>(left, 0) / kChunkCost);
  out.chunks.reserve(static_cast<size_t>(reserve));
  return Status::Ok();
}

// Adds a pair's pieces, in plan order, to its Chunker: for each layer and kv outside the
// templates, the blocks' pieces (runs of blocks merged where both layouts allow).
class PieceWriter {
 public:
  PieceWriter(const Context& cx, const PairCut& cut, Chunker& chunker)
      : in_(cx.in), runs_(cx.segs.runs), cut_(cut), chunker_(chunker) {}

  void Write(const PairBox& b) {
    const Side& src = cut_.src;
    const Side& dst = cut_.dst;
    h0_ = b.h0;
    for (int64_t li = 0; li < cut_.layer_iters && !chunker_.failed(); ++li) {
      p_.layer = cut_.layer_outer ? static_cast<int32_t>(b.l0 + li) : b.l1 - 1;
      src_l_ = src.layer_regions ? 0 : li * src.stride[kL];
      dst_l_ = dst.layer_regions ? 0 : li * dst.stride[kL];
      for (int64_t ki = 0; ki < cut_.kv_iters && !chunker_.failed(); ++ki) {
        kv_ = ki;
        p_.src_region = Region(src, li, ki);
        p_.dst_region = Region(dst, li, ki);
        src_k_ = src.kv_regions ? 0 : ki * src.stride[kK];
        dst_k_ = dst.kv_regions ? 0 : ki * dst.stride[kK];
        if (cut_.axes_outside) {
          WriteAxesOutside();
        } else {
          WriteBlocks();
        }
      }
    }
  }

 private:
  static int32_t Region(const Side& side, int64_t li, int64_t ki) {
    const int64_t l = side.layer_regions ? side.layer0 + li : 0;
    return static_cast<int32_t>(side.kv_regions ? l * side.kv_factor + ki : l);
  }

  // The scales of the pieces at enumerated index `idx` of `t` (Piece::src_scale, dst_scale):
  // layer, kv and head are whole in each piece when the transfer has scales (ScaleAxes).
  void SetScales(const Template& t, const Index& idx) {
    if (cut_.scale_axes == 0) return;
    int64_t kv = kv_, head = h0_;
    for (int k = 0; k < t.n; ++k) {
      if (t.axis[k] == kK) kv += idx[k];
      if (t.axis[k] == kH) head += idx[k];
    }
    p_.src_scale = in_.ctx.scales.At(in_.ctx.shape, p_.layer, kv, head);
    p_.dst_scale = in_.gen.scales.At(in_.gen.shape, p_.layer, kv, head);
    scale_kv_ = kv;
    scale_head_ = head;
  }

  // The per-block scale index of (block, the piece's layer, kv, first head) in a rank's pool
  // (BlockPool::BlockScaleIndex), or -1 when that side has no per-block scales.
  int64_t BlockScaleAt(const InstanceDesc& d, const RankSlice& s, int64_t block) const {
    if (d.scales.granularity != ScaleGranularity::kBlock) return -1;
    return ((block * s.layer_count + (p_.layer - s.layer_begin)) * d.shape.kv_factor + scale_kv_) *
               s.head_count +
           (scale_head_ - s.head_begin);
  }

  // Order (enumerated axes, block): runs of full blocks merge.
  void WriteAxesOutside() {
    ForEachIndex(cut_.full, [&](int64_t sd, int64_t dd, const Index& idx) {
      SetScales(cut_.full, idx);
      for (const BlockRun& run : runs_) {
        if (!run.partial) Emit(cut_.full, run, sd, dd);
      }
    });
    const BlockRun& last = runs_.back();  // the partial block, if any, is the last run
    if (last.partial) {
      ForEachIndex(cut_.part, [&](int64_t sd, int64_t dd, const Index& idx) {
        SetScales(cut_.part, idx);
        Emit(cut_.part, last, sd, dd);
      });
    }
  }

  // Order (block, enumerated axes). A block's pieces of 2-D rows become planes of one piece along
  // the innermost enumerated axis (HND <-> NHD: one piece per block of heads x tokens, not one
  // per head).
  void WriteBlocks() {
    for (const BlockRun& run : runs_) {
      if (chunker_.failed()) break;
      const Template& t = run.partial ? cut_.part : cut_.full;
      if (t.n == 0) {
        SetScales(t, Index{});
        Emit(t, run, 0, 0);
        continue;
      }
      Template outer = t;
      // Planes along an axis the scales vary over would mix scales in one piece; with per-block
      // scales, planes of heads are one scale group each.
      const int inner = t.axis[t.n - 1];
      const bool planes =
          cut_.block_scaled ? inner == kH : t.rows > 1 && !InSet(cut_.scale_axes, inner);
      if (planes) --outer.n;
      for (int64_t i = 0; i < run.count; ++i) {
        BlockRun one = run;
        one.ctx += i;
        one.gen += i;
        one.count = 1;
        ForEachIndex(outer, [&](int64_t sd, int64_t dd, const Index& idx) {
          SetScales(outer, idx);
          Emit(t, one, sd, dd, planes);
        });
      }
    }
  }

  // Emits the pieces of a run's segments at enumerated-axes offsets (sd, dd): one piece (MergeRun)
  // unless `planes`, where the piece's planes are the template's innermost enumerated axis (sd, dd
  // then leave it out) and the blocks merge only when RunMerges.
  void Emit(const Template& t, const BlockRun& run, int64_t sd, int64_t dd, bool planes = false) {
    int64_t count = run.count;
    const Side& src = cut_.src;
    const Side& dst = cut_.dst;
    p_.bytes = t.bytes;
    p_.rows = t.rows;
    p_.src_pitch = t.rows > 1 ? t.src_pitch : 0;
    p_.dst_pitch = t.rows > 1 ? t.dst_pitch : 0;
    p_.planes = planes ? t.ext[t.n - 1] : 1;
    p_.src_plane_pitch = planes ? t.src_step[t.n - 1] : 0;
    p_.dst_plane_pitch = planes ? t.dst_step[t.n - 1] : 0;
    if (count > 1 && !cut_.block_scaled && (RunMerges(t, src, dst) || !planes)) {
      MergeRun(t, src, dst, count, p_);
      count = 1;
    }
    const int64_t src_t = run.ctx_token * src.stride[kT];
    const int64_t dst_t = run.gen_token * dst.stride[kT];
    for (int64_t i = 0; i < count; ++i) {
      p_.src_offset =
          src.base + in_.ctx_blocks[run.ctx + i] * src.block_stride + src_l_ + src_k_ + src_t + sd;
      p_.dst_offset =
          dst.base + in_.gen_blocks[run.gen + i] * dst.block_stride + dst_l_ + dst_k_ + dst_t + dd;
      if (cut_.block_scaled) {
        p_.src_scale_at = BlockScaleAt(in_.ctx, cut_.ctx_slice, in_.ctx_blocks[run.ctx + i]);
        p_.dst_scale_at = BlockScaleAt(in_.gen, cut_.gen_slice, in_.gen_blocks[run.gen + i]);
      }
      chunker_.Add(p_);
    }
  }

  const PlanInput& in_;
  const std::vector<BlockRun>& runs_;
  const PairCut& cut_;
  Chunker& chunker_;
  Piece p_;
  int64_t src_l_ = 0, dst_l_ = 0;  // offset of the current layer (layouts without layer regions)
  int64_t src_k_ = 0, dst_k_ = 0;  // offset of the current kv (kv outside, no kv regions)
  int64_t kv_ = 0;                 // the current kv of the loop outside the template
  int64_t h0_ = 0;                 // global head of the box's first head
  int64_t scale_kv_ = 0, scale_head_ = 0;  // the kv and global head of the pieces (SetScales)
};

// With a dtype conversion, the pieces were cut in destination bytes on both sides: the source's
// offsets and pitches go to its own element size (exact: each is a whole number of elements).
// `bytes` stays the destination row's (Piece).
void ScaleSource(const PlanInput& in, PairPlan& out) {
  const int64_t from = in.ctx.shape.ElementBytes();
  const int64_t to = in.gen.shape.ElementBytes();
  if (from == to) return;
  const auto scale = [&](int64_t& v) { v = v / to * from; };
  for (Chunk& c : out.chunks) {
    for (Piece& p : c.pieces) {
      scale(p.src_offset);
      scale(p.src_pitch);
      scale(p.src_plane_pitch);
    }
  }
}

// Plans one pair; returns false when the pair exchanges nothing. `plan_bytes`: the memory the
// plan's chunks and pieces take so far, all pairs together (bounded by in.max_plan_bytes);
// `plan_chunks`: the chunks of the pairs planned before (bounded by in.max_chunks).
StatusOr<bool> PlanPair(const Context& cx, const RankSlice& c, const RankSlice& g, PairPlan& out,
                        int64_t& plan_bytes, int64_t plan_chunks) {
  const PlanInput& in = cx.in;
  if (!Exchanges(in, cx.needed, c, g)) return false;
  const PairBox b = BoxOf(c, g);
  KVF_ASSIGN_OR_RETURN(const PairCut cut, CutPair(cx, c, g, b));
  out.ctx_rank = c.rank;
  out.gen_rank = g.rank;
  out.bytes = 0;
  out.chunks.clear();
  KVF_RETURN_IF_ERROR(ReserveChunks(cx, c, g, b, cut.row_bytes, plan_bytes, plan_chunks, out));
  Chunker chunker(
      in, out, plan_bytes,
      in.max_chunks > 0 ? in.max_chunks - plan_chunks : std::numeric_limits<int64_t>::max());
  PieceWriter(cx, cut, chunker).Write(b);
  chunker.Finish();
  if (chunker.too_many()) return TooManyChunks(c, g, in);
  if (chunker.over_cap()) return OverCap(c, g, in);
  if (chunker.too_big()) return TooBig(c, g, in, plan_bytes);
  if (chunker.group_too_big() > 0) {
    return Status::InvalidArgument(fmt::format(
        "context rank {} -> generation rank {}: a per-block scale group (one block's tokens of a "
        "layer, K or V and head) is {} bytes, and a chunk of chunk_bytes={} holds at most {} "
        "with its scale; use larger chunks",
        c.rank, g.rank, chunker.group_too_big(), in.chunk_bytes, in.chunk_bytes - 20));
  }
  ScaleSource(in, out);
  return true;
}

StatusOr<std::vector<PairPlan>> PlanRanks(const PlanInput& in, std::optional<int32_t> ctx_rank,
                                          std::optional<int32_t> gen_rank) {
  KVF_RETURN_IF_ERROR(CheckInput(in));
  if (ctx_rank && (*ctx_rank < 0 || *ctx_rank >= in.ctx.parallel.world_size())) {
    return Status::InvalidArgument(
        fmt::format("context rank {} is outside [0, {})", *ctx_rank, in.ctx.parallel.world_size()));
  }
  if (gen_rank && (*gen_rank < 0 || *gen_rank >= in.gen.parallel.world_size())) {
    return Status::InvalidArgument(fmt::format("generation rank {} is outside [0, {})", *gen_rank,
                                               in.gen.parallel.world_size()));
  }
  Context cx{in, GenBlocksNeeded(in), {}, {}, {}};
  cx.segs = SegmentsOf(in);
  KVF_ASSIGN_OR_RETURN(cx.ctx, GroupSlices(in.ctx, ctx_rank));
  KVF_ASSIGN_OR_RETURN(cx.gen, GroupSlices(in.gen, gen_rank));
  std::vector<PairPlan> pairs;
  int64_t plan_bytes = 0, plan_chunks = 0;
  for (const RankSlice& c : cx.ctx) {
    for (const RankSlice& g : cx.gen) {
      PairPlan pair;
      KVF_ASSIGN_OR_RETURN(bool exchanges, PlanPair(cx, c, g, pair, plan_bytes, plan_chunks));
      plan_chunks += static_cast<int64_t>(pair.chunks.size());
      if (exchanges) pairs.push_back(std::move(pair));
    }
  }
  return pairs;
}

}  // namespace

int64_t PlanChunkCap(int64_t budget_bytes, int64_t own_chunk_bytes) {
  const int64_t own = std::max<int64_t>(own_chunk_bytes, 1);
  const int64_t chunks = std::max<int64_t>(budget_bytes / own, 1);
  return std::min(chunks, std::numeric_limits<int64_t>::max() / kPeerChunkSlack) * kPeerChunkSlack;
}

StatusOr<TransferPlan> PlanTransfer(const PlanInput& input) {
  KVF_ASSIGN_OR_RETURN(std::vector<PairPlan> pairs, PlanRanks(input, std::nullopt, std::nullopt));
  TransferPlan plan;
  plan.gen_peers_of_ctx.resize(static_cast<size_t>(input.ctx.parallel.world_size()));
  plan.ctx_peers_of_gen.resize(static_cast<size_t>(input.gen.parallel.world_size()));
  for (const PairPlan& p : pairs) {  // sorted by (ctx, gen): both peer lists come out sorted
    plan.total_bytes += p.bytes;
    plan.gen_peers_of_ctx[p.ctx_rank].push_back(p.gen_rank);
    plan.ctx_peers_of_gen[p.gen_rank].push_back(p.ctx_rank);
  }
  plan.pairs = std::move(pairs);
  return plan;
}

namespace {

// CtxRanksToFetch (gen_rank set) and GenRanksFetching (ctx_rank set).
StatusOr<std::vector<int32_t>> FetchPeers(const PlanInput& input, std::optional<int32_t> ctx_rank,
                                          std::optional<int32_t> gen_rank) {
  KVF_RETURN_IF_ERROR(CheckInput(input));
  const int64_t needed = GenBlocksNeeded(input);
  KVF_ASSIGN_OR_RETURN(std::vector<RankSlice> ctx, GroupSlices(input.ctx, ctx_rank));
  KVF_ASSIGN_OR_RETURN(std::vector<RankSlice> gen, GroupSlices(input.gen, std::nullopt));
  const bool in_group =
      ctx_rank ? !ctx.empty() : std::any_of(gen.begin(), gen.end(), [&](const RankSlice& g) {
        return g.rank == *gen_rank;
      });
  if (!in_group) {
    return Status::InvalidArgument(
        ctx_rank ? fmt::format("context rank {} is not in the request's DP group", *ctx_rank)
                 : fmt::format("generation rank {} is not in the request's DP group", *gen_rank));
  }
  std::vector<int32_t> out;
  for (const RankSlice& c : ctx) {
    bool any = false;
    for (const RankSlice& g : gen) {
      if (!Exchanges(input, needed, c, g)) continue;
      any = true;
      if (ctx_rank) {
        out.push_back(g.rank);
      } else if (g.rank == *gen_rank) {
        out.push_back(c.rank);
      }
    }
    // A context rank that sends nothing to anyone still hears from the group's first rank.
    if (!any && ctx_rank) out.push_back(gen.front().rank);
    if (!any && !ctx_rank && gen.front().rank == *gen_rank) out.push_back(c.rank);
  }
  return out;
}

}  // namespace

StatusOr<std::vector<int32_t>> CtxRanksToFetch(const PlanInput& input, int32_t gen_rank) {
  return FetchPeers(input, std::nullopt, gen_rank);
}

StatusOr<std::vector<int32_t>> GenRanksFetching(const PlanInput& input, int32_t ctx_rank) {
  return FetchPeers(input, ctx_rank, std::nullopt);
}

StatusOr<std::vector<PairPlan>> PlanForCtxRank(const PlanInput& input, int32_t ctx_rank) {
  return PlanRanks(input, ctx_rank, std::nullopt);
}

StatusOr<std::vector<PairPlan>> PlanForGenRank(const PlanInput& input, int32_t gen_rank) {
  return PlanRanks(input, std::nullopt, gen_rank);
}

}  // namespace kvferry

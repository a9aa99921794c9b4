// Validation of a plan's inputs (planner.h CheckCompatible, and what planning checks first).
#include "planner/plan_input.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "base/checked.h"

namespace kvferry {
namespace {

template <typename T>
Status Mismatch(std::string_view what, const T& ctx, const T& gen) {
  return Status::InvalidArgument(
      fmt::format("{} mismatch: context {}, generation {}", what, ctx, gen));
}

Status CheckSide(std::string_view side, const InstanceDesc& d) {
  Status s = d.shape.Validate();
  if (s.ok()) s = d.parallel.Validate(d.shape);
  if (!s.ok()) return s.WithContext(side);
  if (static_cast<uint8_t>(d.layout) > static_cast<uint8_t>(kLastLayoutKind)) {
    return Status::InvalidArgument(
        fmt::format("{}: layout {} is unknown", side, static_cast<int>(d.layout)));
  }
  if (d.pool_blocks < 1) {
    return Status::InvalidArgument(
        fmt::format("{}: pool_blocks={} must be at least 1", side, d.pool_blocks));
  }
  // Every offset the plan computes lies inside one rank's pool, which holds at most a whole
  // model's block per block id: that product must fit in int64 (a peer's pool_blocks is data).
  const KvShape& sh = d.shape;
  if (!CheckedProduct({d.pool_blocks, sh.layers, sh.kv_factor, sh.kv_heads, sh.head_dim,
                       sh.tokens_per_block, sh.ElementBytes()})) {
    return Status::InvalidArgument(
        fmt::format("{}: pool_blocks={} blocks of {} bytes overflow int64", side, d.pool_blocks,
                    sh.BytesPerToken() * sh.tokens_per_block));
  }
  if (d.layout == LayoutKind::kCustom) {
    // The shared strides must lay out every rank's pool (ranks differ in layers with uneven
    // pipeline stages): checked once per distinct rank dims.
    PoolDims last{};
    for (int32_t r = 0; r < d.parallel.world_size(); ++r) {
      KVF_ASSIGN_OR_RETURN(const RankSlice slice, SliceOf(sh, d.parallel, r));
      const PoolDims dims = RankPoolDims(sh, slice, d.pool_blocks);
      if (r > 0 && dims == last) continue;
      last = dims;
      if (auto layout = LayoutOf(d, dims, sh.ElementBytes()); !layout.ok()) {
        return layout.status().WithContext(fmt::format("{}: custom layout of rank {}", side, r));
      }
    }
  }
  return Status::Ok();
}

// Block ids: inside the pool, and no id twice among the request's first `needed` blocks.
Status CheckBlocks(std::string_view side, const std::vector<int64_t>& blocks, int64_t needed,
                   int64_t pool_blocks) {
  if (static_cast<int64_t>(blocks.size()) < needed) {
    return Status::InvalidArgument(
        fmt::format("{} has {} blocks but the prompt needs {}", side, blocks.size(), needed));
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t b = blocks[i];
    if (b < 0 || b >= pool_blocks) {
      return Status::InvalidArgument(fmt::format(
          "{}[{}]: block id {} is outside the pool's [0, {})", side, i, b, pool_blocks));
    }
  }
  // Duplicates among the first `needed` ids. A bitmap over the pool when that is small next to
  // the request; else a sort: pool_blocks may come from a peer, so it never sizes memory alone.
  const auto first = blocks.begin();
  const auto last = first + needed;
  if (pool_blocks / 64 <= needed + 4096) {
    std::vector<uint64_t> seen(static_cast<size_t>(pool_blocks / 64 + 1), 0);
    for (auto it = first; it != last; ++it) {
      uint64_t& word = seen[static_cast<size_t>(*it / 64)];
      const uint64_t bit = uint64_t{1} << (*it % 64);
      if (word & bit) {
        return Status::InvalidArgument(
            fmt::format("{}[{}]: block id {} appears twice in the request", side, it - first, *it));
      }
      word |= bit;
    }
    return Status::Ok();
  }
  std::vector<int64_t> sorted(first, last);
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) {
    const auto at = std::find(first, last, *dup);
    const auto again = std::find(at + 1, last, *dup);
    return Status::InvalidArgument(
        fmt::format("{}[{}]: block id {} appears twice in the request", side, again - first, *dup));
  }
  return Status::Ok();
}

int64_t BlocksOf(int64_t tokens, int64_t tokens_per_block) {
  return tokens / tokens_per_block + (tokens % tokens_per_block != 0 ? 1 : 0);  // no overflow
}

}  // namespace

int64_t CtxBlocksNeeded(const PlanInput& in) {
  return BlocksOf(in.prompt_tokens, in.ctx.shape.tokens_per_block);
}

int64_t GenBlocksNeeded(const PlanInput& in) {
  return BlocksOf(in.prompt_tokens, in.gen.shape.tokens_per_block);
}

Status CheckInput(const PlanInput& in) {
  KVF_RETURN_IF_ERROR(CheckCompatible(in.ctx, in.gen));
  if (in.prompt_tokens < 1) {
    return Status::InvalidArgument(
        fmt::format("prompt_tokens={} must be at least 1", in.prompt_tokens));
  }
  const int64_t gen_needed = GenBlocksNeeded(in);
  KVF_RETURN_IF_ERROR(
      CheckBlocks("ctx_blocks", in.ctx_blocks, CtxBlocksNeeded(in), in.ctx.pool_blocks));
  KVF_RETURN_IF_ERROR(CheckBlocks("gen_blocks", in.gen_blocks, gen_needed, in.gen.pool_blocks));
  if (in.gen_reused_blocks < 0 || in.gen_reused_blocks > gen_needed) {
    return Status::InvalidArgument(
        fmt::format("gen_reused_blocks={} is outside [0, {}] (generation blocks of a {}-token "
                    "prompt)",
                    in.gen_reused_blocks, gen_needed, in.prompt_tokens));
  }
  if (in.chunk_bytes < 1) {
    return Status::InvalidArgument(
        fmt::format("chunk_bytes={} must be at least 1", in.chunk_bytes));
  }
  if (in.direct_min_bytes < 0) {
    return Status::InvalidArgument(
        fmt::format("direct_min_bytes={} must not be negative", in.direct_min_bytes));
  }
  return Status::Ok();
}

Status CheckCompatible(const InstanceDesc& ctx, const InstanceDesc& gen) {
  const KvShape& a = ctx.shape;
  const KvShape& b = gen.shape;
  if (a.layers != b.layers) return Mismatch("layers", a.layers, b.layers);
  if (a.kv_heads != b.kv_heads) return Mismatch("kv_heads", a.kv_heads, b.kv_heads);
  if (a.head_dim != b.head_dim) return Mismatch("head_dim", a.head_dim, b.head_dim);
  if (a.dtype != b.dtype && (!ElementFormatOf(a.dtype) || !ElementFormatOf(b.dtype))) {
    return Status::InvalidArgument(fmt::format(
        "dtype mismatch: context {}, generation {}, and no conversion between them (kvferry "
        "converts between fp32, fp16, bf16 and fp8)",
        DTypeName(a.dtype), DTypeName(b.dtype)));
  }
  if (a.kv_factor != b.kv_factor) return Mismatch("kv_factor", a.kv_factor, b.kv_factor);
  // Different block sizes: each block of the smaller size lies within one block of the larger.
  const int32_t lo = std::min(a.tokens_per_block, b.tokens_per_block);
  const int32_t hi = std::max(a.tokens_per_block, b.tokens_per_block);
  if (lo > 0 && hi % lo != 0) {
    return Status::InvalidArgument(fmt::format(
        "tokens_per_block: context {}, generation {}: one must be a multiple of the other (a "
        "block of the smaller size must lie within one block of the larger)",
        a.tokens_per_block, b.tokens_per_block));
  }
  KVF_RETURN_IF_ERROR(CheckSide("context", ctx));
  KVF_RETURN_IF_ERROR(CheckSide("generation", gen));
  for (const auto& [name, d] : {std::pair{"context", &ctx}, std::pair{"generation", &gen}}) {
    if (Status s = d->scales.Check(d->shape); !s.ok()) {
      return Status::InvalidArgument(fmt::format("{}: {}", name, s.message()));
    }
    if (d->scales.granularity != ScaleGranularity::kNone && !ElementFormatOf(d->shape.dtype)) {
      return Status::InvalidArgument(
          fmt::format("{}: kv scales with dtype {}: kvferry scales fp32, fp16, bf16 and fp8", name,
                      DTypeName(d->shape.dtype)));
    }
    if (d->scales.granularity == ScaleGranularity::kBlock && d->shape.dtype != DType::kFp8E4M3) {
      return Status::InvalidArgument(fmt::format(
          "{}: per-block kv scales with dtype {}: per-block scales quantize an fp8 cache", name,
          DTypeName(d->shape.dtype)));
    }
  }
  // A per-block scale covers one block's tokens: with another block size on the other side, a
  // generation block's scale would come from several context blocks' values (or the reverse).
  if (BlockScaled(ctx, gen) && a.tokens_per_block != b.tokens_per_block) {
    return Status::InvalidArgument(fmt::format(
        "per-block kv scales ({}) need the same block size on both sides; context {}, generation "
        "{} tokens per block",
        ctx.scales.granularity == ScaleGranularity::kBlock ? "context" : "generation",
        a.tokens_per_block, b.tokens_per_block));
  }
  return Status::Ok();
}

bool BlockScaled(const InstanceDesc& ctx, const InstanceDesc& gen) {
  return ctx.scales.granularity == ScaleGranularity::kBlock ||
         gen.scales.granularity == ScaleGranularity::kBlock;
}

bool Converts(const InstanceDesc& ctx, const InstanceDesc& gen) {
  if (ctx.shape.dtype != gen.shape.dtype) return true;
  if (BlockScaled(ctx, gen)) return true;  // each block's scales differ: they travel
  if (ctx.scales == gen.scales) return false;
  // Scales described differently may still be equal everywhere (per head, all of a tensor's the
  // same): compare them where they apply. Unchecked scales convert (the planner refuses them).
  if (!ctx.scales.Check(ctx.shape).ok() || !gen.scales.Check(gen.shape).ok()) return true;
  const KvShape& s = ctx.shape;
  for (int64_t l = 0; l < s.layers; ++l) {
    for (int64_t k = 0; k < s.kv_factor; ++k) {
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        if (ctx.scales.At(s, l, k, h) != gen.scales.At(gen.shape, l, k, h)) return true;
      }
    }
  }
  return false;
}

std::optional<Conversion> PlanConversion(const PlanInput& input) {
  if (!Converts(input.ctx, input.gen)) return std::nullopt;
  const auto from_format = ElementFormatOf(input.ctx.shape.dtype);
  const auto to_format = ElementFormatOf(input.gen.shape.dtype);
  if (!from_format || !to_format) return std::nullopt;  // refused by CheckCompatible
  return Conversion{*from_format, *to_format};
}

std::optional<ElementFormat> ElementFormatOf(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return ElementFormat::kFp32;
    case DType::kFp16:
      return ElementFormat::kFp16;
    case DType::kBf16:
      return ElementFormat::kBf16;
    case DType::kFp8E4M3:
      return ElementFormat::kFp8E4m3;
    case DType::kFp8E5M2:
    case DType::kInt8:
      return std::nullopt;
  }
  return std::nullopt;
}

int64_t DirectMin(const PlanInput& in) {
  return PlanConversion(in) ? std::numeric_limits<int64_t>::max() : in.direct_min_bytes;
}

StatusOr<PoolLayout> LayoutOf(const InstanceDesc& d, const PoolDims& dims, int64_t element_bytes) {
  if (d.layout != LayoutKind::kCustom) return PoolLayout::Make(d.layout, dims, element_bytes);
  return PoolLayout::Custom(dims, d.strides, d.split, element_bytes);
}

void DescribeLayout(const PoolLayout& layout, InstanceDesc& d) {
  d.layout = layout.kind();
  d.split = RegionSplit::kNone;
  d.strides = {};
  if (layout.kind() != LayoutKind::kCustom) return;
  d.split = layout.split();
  d.strides = layout.strides();
}

}  // namespace kvferry

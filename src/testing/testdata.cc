#include "testing/testdata.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <utility>

#include "device/convert.h"
#include "device/convert_core.h"
#include "planner/planner.h"

namespace kvferry {
namespace {

inline uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// Hash of everything but dim; the dim is folded in last so the inner loop is one multiply-mix.
inline uint64_t RowSeed(uint64_t request, int64_t layer, int64_t kv, int64_t head, int64_t token) {
  uint64_t h = Mix(request + 0x9e3779b97f4a7c15ULL);
  h = Mix(h ^ static_cast<uint64_t>(layer) * 0x100000001b3ULL);
  h = Mix(h ^ (static_cast<uint64_t>(kv) << 32 | static_cast<uint64_t>(head)));
  return Mix(h ^ static_cast<uint64_t>(token));
}

inline uint64_t ElementValue(uint64_t row_seed, int64_t dim) {
  return Mix(row_seed + static_cast<uint64_t>(dim) * 0x9e3779b97f4a7c15ULL);
}

Status CheckArgs(const BlockPool& pool, const BlockTokens& where) {
  if (where.block < 0 || where.block >= pool.blocks()) {
    return Status::InvalidArgument(
        fmt::format("block id {} is outside the pool's [0, {})", where.block, pool.blocks()));
  }
  if (where.valid_tokens < 0 || where.valid_tokens > pool.shape().tokens_per_block) {
    return Status::InvalidArgument(
        fmt::format("valid_tokens={} is outside [0, tokens_per_block={}]", where.valid_tokens,
                    pool.shape().tokens_per_block));
  }
  if (where.first_token < 0) return Status::InvalidArgument("first_token must not be negative");
  return Status::Ok();
}

// Calls fn(coord-without-dim, pointer to the row of head_dim elements) for every row of the block.
template <typename Fn>
void ForEachRow(const BlockPool& pool, uint64_t request, const BlockTokens& where, Fn&& fn) {
  const PoolLayout& lay = pool.layout();
  const RankSlice& s = pool.slice();
  const auto& d = lay.dims();
  for (int64_t l = 0; l < d[kLayerAxis]; ++l) {
    for (int64_t kv = 0; kv < d[kKvAxis]; ++kv) {
      std::byte* region = pool.region(lay.RegionOf(l, kv));
      for (int64_t h = 0; h < d[kHeadAxis]; ++h) {
        for (int64_t t = 0; t < where.valid_tokens; ++t) {
          ElementCoord c{request,          s.layer_begin + l,     kv,
                         s.head_begin + h, where.first_token + t, 0};
          fn(c, region + lay.ByteOffset(where.block, l, kv, h, t, 0));
        }
      }
    }
  }
}

}  // namespace

uint64_t TestValue(const ElementCoord& c) {
  return ElementValue(RowSeed(c.request, c.layer, c.kv, c.head, c.token), c.dim);
}

float TestBlockScale(uint64_t request, int64_t layer, int64_t kv, int64_t head, int64_t block) {
  const uint64_t h = Mix(RowSeed(request, layer, kv, head, block) ^ 0x5ca1eULL);
  return std::ldexp(1.0f + static_cast<float>(h % 1024) / 1024.0f,
                    static_cast<int>((h >> 10) % 13) - 6);
}

Status FillBlock(const BlockPool& pool, uint64_t request, const BlockTokens& where) {
  KVF_RETURN_IF_ERROR(CheckArgs(pool, where));
  const int esize = DTypeSize(pool.shape().dtype);
  const int64_t dims = pool.shape().head_dim;
  ForEachRow(pool, request, where, [&](const ElementCoord& c, std::byte* row) {
    uint64_t seed = RowSeed(c.request, c.layer, c.kv, c.head, c.token);
    for (int64_t i = 0; i < dims; ++i) {
      uint64_t v = ElementValue(seed, i);
      std::memcpy(row + i * esize, &v, esize);  // little-endian hosts: the low bytes
    }
  });
  if (float* scales = pool.block_scales()) {
    const RankSlice& s = pool.slice();
    const int64_t block = where.first_token / pool.shape().tokens_per_block;
    for (int64_t l = 0; l < s.layer_count; ++l) {
      for (int64_t kv = 0; kv < pool.shape().kv_factor; ++kv) {
        for (int64_t h = 0; h < s.head_count; ++h) {
          scales[pool.BlockScaleIndex(where.block, l, kv, h)] =
              TestBlockScale(request, s.layer_begin + l, kv, s.head_begin + h, block);
        }
      }
    }
  }
  return Status::Ok();
}

StatusOr<std::optional<Mismatch>> CheckBlock(const BlockPool& pool, uint64_t request,
                                             const BlockTokens& where, std::optional<DType> sent_as,
                                             const KvScales& sent_scales,
                                             const KvScales& own_scales) {
  KVF_RETURN_IF_ERROR(CheckArgs(pool, where));
  KVF_RETURN_IF_ERROR(sent_scales.Check(pool.shape()));
  KVF_RETURN_IF_ERROR(own_scales.Check(pool.shape()));
  const int esize = DTypeSize(pool.shape().dtype);
  const int64_t dims = pool.shape().head_dim;
  std::optional<Conversion> conversion;
  InstanceDesc sender, receiver;
  sender.shape = receiver.shape = pool.shape();
  if (sent_as) sender.shape.dtype = *sent_as;
  sender.scales = sent_scales;
  receiver.scales = own_scales;
  if (Converts(sender, receiver)) {
    if (!sent_as) sent_as = pool.shape().dtype;
    const auto from = ElementFormatOf(*sent_as);
    const auto to = ElementFormatOf(pool.shape().dtype);
    if (!from || !to) {
      return Status::InvalidArgument(fmt::format("no conversion from {} to {}", DTypeName(*sent_as),
                                                 DTypeName(pool.shape().dtype)));
    }
    conversion = Conversion{*from, *to};
  }
  const int sent_size = conversion ? DTypeSize(*sent_as) : esize;
  const uint64_t sent_mask = sent_size == 8 ? ~0ULL : ((1ULL << (8 * sent_size)) - 1);
  const bool sent_per_block = sent_scales.granularity == ScaleGranularity::kBlock;
  const bool own_per_block = own_scales.granularity == ScaleGranularity::kBlock;
  if (own_per_block && pool.block_scales() == nullptr)
    return Status::InvalidArgument("kv scales per block, and the pool has none");
  const int64_t token_block = where.first_token / pool.shape().tokens_per_block;
  // fp8 per block on both sides: the codes are copied and the scales travel.
  const bool travel = sent_per_block && own_per_block && sent_as == pool.shape().dtype;
  // A group's (layer, kv, head) scales: the sender's, and the pool's as the transfer sets them.
  const auto group_scales = [&](const ElementCoord& c) -> std::pair<float, float> {
    const float src = sent_per_block ? TestBlockScale(request, c.layer, c.kv, c.head, token_block)
                                     : sent_scales.At(pool.shape(), c.layer, c.kv, c.head);
    if (!own_per_block) return {src, own_scales.At(pool.shape(), c.layer, c.kv, c.head)};
    if (travel) return {src, src};
    const Conversion widen{*ElementFormatOf(*sent_as), ElementFormat::kFp32};
    uint32_t amax = 0;
    for (int64_t t = 0; t < where.valid_tokens; ++t) {
      const uint64_t seed = RowSeed(request, c.layer, c.kv, c.head, where.first_token + t);
      for (int64_t i = 0; i < dims; ++i) {
        const auto bits = static_cast<uint32_t>(ElementValue(seed, i) & sent_mask);
        amax = std::max(amax, convert::FiniteMagnitude(ConvertElement(bits, widen)));
      }
    }
    return {src, convert::BlockScale(amax, src)};
  };
  const RankSlice& slice = pool.slice();
  ElementCoord group{request, -1, -1, -1, 0, 0};
  std::pair<float, float> scales{1.0f, 1.0f};
  std::optional<Mismatch> first;
  ForEachRow(pool, request, where, [&](const ElementCoord& c, std::byte* row) {
    if (first) return;
    uint64_t seed = RowSeed(c.request, c.layer, c.kv, c.head, c.token);
    if (c.layer != group.layer || c.kv != group.kv || c.head != group.head) {
      group = c;
      scales = group_scales(c);  // rows come group by group (ForEachRow)
    }
    const float src_scale = scales.first, dst_scale = scales.second;
    if (own_per_block && c.token == where.first_token) {
      const float got = pool.block_scales()[pool.BlockScaleIndex(
          where.block, c.layer - slice.layer_begin, c.kv, c.head - slice.head_begin)];
      if (std::bit_cast<uint32_t>(got) != std::bit_cast<uint32_t>(dst_scale)) {
        ElementCoord at = c;
        at.dim = -1;
        first = Mismatch{at, std::bit_cast<uint32_t>(dst_scale), std::bit_cast<uint32_t>(got)};
        return;
      }
    }
    const auto expected = [&](uint64_t filled) -> uint64_t {
      filled &= sent_mask;
      return conversion && !travel
                 ? ConvertElement(static_cast<uint32_t>(filled), *conversion, src_scale, dst_scale)
                 : filled;
    };
    for (int64_t i = 0; i < dims; ++i) {
      uint64_t want = expected(ElementValue(seed, i));
      uint64_t got = 0;
      std::memcpy(&got, row + i * esize, esize);
      if (got != want) {
        ElementCoord at = c;
        at.dim = i;
        first = Mismatch{at, want, got};
        return;
      }
    }
  });
  return first;
}

std::string Mismatch::ToString() const {
  return fmt::format("request {} layer {} kv {} head {} token {} dim {}: expected {:#x}, got {:#x}",
                     at.request, at.layer, at.kv, at.head, at.token, at.dim, expected, actual);
}

}  // namespace kvferry

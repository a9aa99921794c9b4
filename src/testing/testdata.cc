#include "testing/testdata.h"

#include <fmt/format.h>

#include <cstring>

#include "device/convert.h"
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
  std::optional<Mismatch> first;
  ForEachRow(pool, request, where, [&](const ElementCoord& c, std::byte* row) {
    if (first) return;
    uint64_t seed = RowSeed(c.request, c.layer, c.kv, c.head, c.token);
    const float src_scale = sent_scales.At(pool.shape(), c.layer, c.kv, c.head);
    const float dst_scale = own_scales.At(pool.shape(), c.layer, c.kv, c.head);
    const auto expected = [&](uint64_t filled) -> uint64_t {
      filled &= sent_mask;
      return conversion
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

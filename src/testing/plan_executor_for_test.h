// A plan executor for tests: runs TransferPlan chunks between host-memory BlockPools with plain
// memcpy, the way a transceiver would (direct chunks pool to pool; packed chunks packed into a
// staging buffer of chunk.bytes, then unpacked), and counts how many times each destination byte
// is written. Bounds-checks every piece against its regions before touching memory.
//
// Test-only: single-threaded, no device streams, no transport.
#pragma once

#include <fmt/format.h>

#include <cstring>
#include <functional>
#include <optional>
#include <vector>

#include "device/convert.h"
#include "kvferry/pool.h"
#include "planner/planner.h"

namespace kvferry {

// write_counts[gen rank][region][byte]: times the executor wrote that byte.
using WriteCounts = std::vector<std::vector<std::vector<uint8_t>>>;

inline WriteCounts MakeWriteCounts(const std::vector<BlockPool>& gen_pools) {
  WriteCounts w(gen_pools.size());
  for (size_t r = 0; r < gen_pools.size(); ++r) {
    w[r].resize(static_cast<size_t>(gen_pools[r].num_regions()));
    for (auto& region : w[r])
      region.assign(static_cast<size_t>(gen_pools[r].layout().region_bytes()), 0);
  }
  return w;
}

// Calls fn(plane) for each plane of each piece of `chunk`, in packed order.
template <typename Fn>
Status ForEachPlane(const Chunk& chunk, Fn&& fn) {
  for (const Piece& whole : chunk.pieces) {
    if (whole.planes < 1) return Status::Internal(fmt::format("piece of {} planes", whole.planes));
    for (int64_t q = 0; q < whole.planes; ++q) KVF_RETURN_IF_ERROR(fn(whole.Plane(q)));
  }
  return Status::Ok();
}

// Checks that every row of `p` (one plane) lies inside both pools' regions; a source row holds
// `src_bytes` (the piece's bytes, or as many elements of the source dtype when converting).
inline Status CheckPieceBounds(const Piece& p, int64_t src_bytes, const BlockPool& src,
                               const BlockPool& dst) {
  auto check = [&](const BlockPool& pool, int32_t region, int64_t offset, int64_t pitch,
                   int64_t bytes, const char* side) -> Status {
    if (region < 0 || region >= pool.num_regions()) {
      return Status::Internal(
          fmt::format("{} region {} is outside [0, {})", side, region, pool.num_regions()));
    }
    const int64_t last = offset + (p.rows - 1) * pitch;
    const int64_t lo = std::min(offset, last);
    const int64_t hi = std::max(offset, last) + bytes;
    if (bytes < 1 || p.rows < 1 || lo < 0 || hi > pool.layout().region_bytes()) {
      return Status::Internal(
          fmt::format("{} piece offset {} pitch {} rows {} bytes {} leaves region of {} bytes",
                      side, offset, pitch, p.rows, bytes, pool.layout().region_bytes()));
    }
    return Status::Ok();
  };
  KVF_RETURN_IF_ERROR(check(src, p.src_region, p.src_offset, p.src_pitch, src_bytes, "source"));
  return check(dst, p.dst_region, p.dst_offset, p.dst_pitch, p.bytes, "destination");
}

// Called before each chunk is sent (e.g. to make layers up to chunk.last_layer "computed").
using BeforeChunk = std::function<void(const PairPlan&, const Chunk&)>;

// Executes the chunks of `pairs`, pair by pair, chunks in order; pools are indexed by instance
// rank. With `conversion` (PlanConversion), the sender converts while packing, as the
// transceiver does.
inline Status ExecutePlanForTest(const std::vector<PairPlan>& pairs,
                                 const std::vector<BlockPool>& ctx_pools,
                                 const std::vector<BlockPool>& gen_pools, WriteCounts& counts,
                                 const BeforeChunk& before_chunk = {},
                                 std::optional<Conversion> conversion = std::nullopt) {
  std::vector<std::byte> staging;
  const auto src_bytes = [&](const Piece& p) {
    return conversion
               ? p.bytes / ElementFormatSize(conversion->to) * ElementFormatSize(conversion->from)
               : p.bytes;
  };
  for (const PairPlan& pair : pairs) {
    const BlockPool& src = ctx_pools.at(static_cast<size_t>(pair.ctx_rank));
    const BlockPool& dst = gen_pools.at(static_cast<size_t>(pair.gen_rank));
    auto& cnt = counts.at(static_cast<size_t>(pair.gen_rank));
    auto mark = [&](const Piece& p, int64_t row) {
      uint8_t* c = cnt[p.dst_region].data() + p.dst_offset + row * p.dst_pitch;
      for (int64_t b = 0; b < p.bytes; ++b) c[b] += c[b] < 255 ? 1 : 0;
    };
    for (const Chunk& chunk : pair.chunks) {
      KVF_RETURN_IF_ERROR(ForEachPlane(
          chunk, [&](const Piece& p) { return CheckPieceBounds(p, src_bytes(p), src, dst); }));
      if (before_chunk) before_chunk(pair, chunk);
      if (chunk.direct) {
        if (chunk.pieces.size() != 1 || chunk.pieces[0].planes != 1)
          return Status::Internal("a direct chunk is one piece of one plane");
        if (conversion) return Status::Internal("a direct chunk in a plan that converts");
        for (const Piece& p : chunk.pieces) {
          for (int64_t r = 0; r < p.rows; ++r) {
            std::memcpy(dst.region(p.dst_region) + p.dst_offset + r * p.dst_pitch,
                        src.region(p.src_region) + p.src_offset + r * p.src_pitch,
                        static_cast<size_t>(p.bytes));
            mark(p, r);
          }
        }
        continue;
      }
      // Sender: pack. Staging is exactly chunk.bytes; extra bytes stay poisoned to catch overrun.
      staging.assign(static_cast<size_t>(chunk.bytes), std::byte{0xEE});
      int64_t at = 0;
      KVF_RETURN_IF_ERROR(ForEachPlane(chunk, [&](const Piece& p) -> Status {
        for (int64_t r = 0; r < p.rows; ++r) {
          if (at + p.bytes > chunk.bytes)
            return Status::Internal("chunk pieces exceed chunk.bytes");
          const std::byte* from = src.region(p.src_region) + p.src_offset + r * p.src_pitch;
          if (conversion) {
            ConvertElementsScaled(staging.data() + at, from,
                                  static_cast<size_t>(p.bytes / ElementFormatSize(conversion->to)),
                                  *conversion, p.src_scale, p.dst_scale);
          } else {
            std::memcpy(staging.data() + at, from, static_cast<size_t>(p.bytes));
          }
          at += p.bytes;
        }
        return Status::Ok();
      }));
      if (at != chunk.bytes) {
        return Status::Internal(fmt::format("chunk.bytes {} but pieces pack {}", chunk.bytes, at));
      }
      // Receiver: unpack.
      at = 0;
      KVF_RETURN_IF_ERROR(ForEachPlane(chunk, [&](const Piece& p) -> Status {
        for (int64_t r = 0; r < p.rows; ++r) {
          std::memcpy(dst.region(p.dst_region) + p.dst_offset + r * p.dst_pitch,
                      staging.data() + at, static_cast<size_t>(p.bytes));
          mark(p, r);
          at += p.bytes;
        }
        return Status::Ok();
      }));
    }
  }
  return Status::Ok();
}

}  // namespace kvferry

#include "transceiver/rma.h"

#include <fmt/format.h>

#include <algorithm>

#include "device/run_digest.h"

namespace kvferry {

StatusOr<LocalRma> RegisterForRma(Transport& transport, const BlockPool& pool, MemoryKind pool_kind,
                                  std::byte* staging, size_t staging_bytes,
                                  MemoryKind staging_kind) {
  LocalRma out;
  const size_t region_bytes = static_cast<size_t>(pool.layout().region_bytes());
  for (int32_t i = 0; i < pool.num_regions(); ++i) {
    auto reg = transport.RegisterMemory(pool.region(i), region_bytes, pool_kind);
    if (!reg.ok()) {
      return reg.status().WithContext(fmt::format("registering pool region {} ({} bytes, {})", i,
                                                  region_bytes, MemoryKindName(pool_kind)));
    }
    out.pool.push_back(std::move(reg).value());
  }
  auto reg = transport.RegisterMemory(staging, staging_bytes, staging_kind);
  if (!reg.ok()) {
    return reg.status().WithContext(fmt::format("registering staging ({} bytes, {})", staging_bytes,
                                                MemoryKindName(staging_kind)));
  }
  out.staging = std::move(reg).value();
  return out;
}

namespace {
RemoteRegion Describe(const MemoryRegistration& reg) {
  auto key = reg.PackedKey();
  return RemoteRegion{reg.address(), reg.size(), std::vector<std::byte>(key.begin(), key.end())};
}
}  // namespace

RmaTarget DescribeTarget(const LocalRma& rma, int64_t slot_bytes, uint32_t slots,
                         int64_t row_min_bytes) {
  RmaTarget t;
  for (const auto& reg : rma.pool) t.pool.push_back(Describe(*reg));
  t.staging = Describe(*rma.staging);
  t.slot_bytes = slot_bytes;
  t.slots = slots;
  t.row_min_bytes = row_min_bytes;
  return t;
}

int64_t PackedBytes(const Chunk& chunk, int64_t row_min_bytes) {
  int64_t n = 0;
  for (const Piece& p : chunk.pieces) {
    if (!RowsGoDirect(chunk, p, row_min_bytes)) n += p.total();
  }
  // Per-block scales come only with a conversion, which sends no rows direct: every row is packed.
  return chunk.scale_bytes > 0 ? chunk.packed_bytes() : n;
}

Status CheckRmaTarget(const FetchMsg& f) {
  const RmaTarget& t = f.rma_target;
  auto slice = SliceOf(f.shape, f.parallel, f.gen_rank);
  if (!slice.ok()) return slice.status().WithContext("rma target");
  auto layout = LayoutOf(f, RankPoolDims(f.shape, *slice, f.pool_blocks), f.shape.ElementBytes());
  if (!layout.ok()) return layout.status().WithContext("rma target");
  if (static_cast<int64_t>(t.pool.size()) != layout->num_regions()) {
    return Status::InvalidArgument(
        fmt::format("rma target: {} pool regions declared, the generation layout has {}",
                    t.pool.size(), layout->num_regions()));
  }
  auto check = [](const RemoteRegion& g, std::string_view what) -> Status {
    if (g.bytes > UINT64_MAX - g.address) {
      return Status::InvalidArgument(
          fmt::format("rma target: {} at {:#x} + {} bytes wraps around", what, g.address, g.bytes));
    }
    if (g.rkey.empty())
      return Status::InvalidArgument(fmt::format("rma target: {} has no remote key", what));
    return Status::Ok();
  };
  for (size_t i = 0; i < t.pool.size(); ++i) {
    KVF_RETURN_IF_ERROR(check(t.pool[i], fmt::format("pool region {}", i)));
    if (t.pool[i].bytes < static_cast<uint64_t>(layout->region_bytes())) {
      return Status::InvalidArgument(fmt::format(
          "rma target: pool region {} declares {} bytes, the generation layout needs {}", i,
          t.pool[i].bytes, layout->region_bytes()));
    }
  }
  KVF_RETURN_IF_ERROR(check(t.staging, "staging"));
  if (t.slots < 1 || t.slot_bytes < f.chunk_bytes ||
      static_cast<uint64_t>(t.slot_bytes) > t.staging.bytes / t.slots) {
    return Status::InvalidArgument(fmt::format(
        "rma target: {} staging slots of {} bytes in a staging region of {} bytes cannot hold "
        "chunks of {} bytes",
        t.slots, t.slot_bytes, t.staging.bytes, f.chunk_bytes));
  }
  if (t.row_min_bytes < 1) {
    return Status::InvalidArgument(
        fmt::format("rma target: row_min_bytes={} must be positive", t.row_min_bytes));
  }
  return Status::Ok();
}

Status PutDirectRows(Transport& transport, PeerId peer, const Chunk& chunk, const BlockPool& pool,
                     MemoryKind kind, const RmaTarget& target,
                     std::vector<std::unique_ptr<TransportOp>>& ops) {
  for (const Piece& p : chunk.pieces) {
    if (!RowsGoDirect(chunk, p, target.row_min_bytes)) continue;
    if (p.dst_region < 0 || static_cast<size_t>(p.dst_region) >= target.pool.size()) {
      return Status::Internal(
          fmt::format("piece for generation region {} of {}", p.dst_region, target.pool.size()));
    }
    const RemoteRegion& g = target.pool[p.dst_region];
    const uint64_t end = static_cast<uint64_t>(p.dst_offset) + static_cast<uint64_t>(p.dst_span());
    if (p.dst_offset < 0 || end > g.bytes) {
      return Status::InvalidArgument(fmt::format(
          "put of {} planes of {} rows of {} bytes at offset {} (pitches {}/{}) is outside "
          "generation region {} ({} bytes)",
          p.planes, p.rows, p.bytes, p.dst_offset, p.dst_plane_pitch, p.dst_pitch, p.dst_region,
          g.bytes));
    }
    for (int64_t q = 0; q < p.planes; ++q) {
      const std::byte* src = pool.region(p.src_region) + p.src_offset + q * p.src_plane_pitch;
      const uint64_t dst = g.address + p.dst_offset + q * p.dst_plane_pitch;
      for (int64_t r = 0; r < p.rows; ++r) {
        auto op = transport.Put(peer, src + r * p.src_pitch, static_cast<size_t>(p.bytes), kind,
                                dst + r * p.dst_pitch, g.rkey);
        if (!op.ok()) return op.status();
        ops.push_back(std::move(op).value());
      }
    }
  }
  return Status::Ok();
}

Status ChunkDigester::Reserve(Device& device, size_t segments) {
  out_.Reset();
  auto grown = device.Allocate(MemoryKind::kPinnedHost, std::max<size_t>(segments, 1024) * 8);
  if (!grown.ok()) return grown.status().WithContext("chunk digest buffer");
  out_ = std::move(grown).value();
  return Status::Ok();
}

StatusOr<uint64_t> ChunkDigester::Of(const Chunk& chunk, bool context_side, const BlockPool& pool,
                                     bool host, Device& device, Stream& stream, Deadline deadline) {
  runs_.clear();
  for (const Piece& p : chunk.pieces) {
    const std::byte* base = context_side ? pool.region(p.src_region) + p.src_offset
                                         : pool.region(p.dst_region) + p.dst_offset;
    const int64_t pitch = context_side ? p.src_pitch : p.dst_pitch;
    const int64_t plane_pitch = context_side ? p.src_plane_pitch : p.dst_plane_pitch;
    for (int64_t q = 0; q < p.planes; ++q) {  // a run per plane: the packed order of its rows
      runs_.push_back(DigestRun{base + q * plane_pitch, static_cast<size_t>(p.bytes),
                                static_cast<size_t>(p.rows), static_cast<size_t>(pitch)});
    }
  }
  return Sum(host, device, stream, deadline);
}

StatusOr<uint64_t> ChunkDigester::OfPacked(const Chunk& chunk, const std::byte* packed, bool host,
                                           Device& device, Stream& stream, Deadline deadline) {
  runs_.clear();
  for (const Piece& p : chunk.pieces) {
    for (int64_t q = 0; q < p.planes; ++q) {
      runs_.push_back(DigestRun{packed, static_cast<size_t>(p.bytes), static_cast<size_t>(p.rows),
                                static_cast<size_t>(p.bytes)});
      packed += p.bytes * p.rows;
    }
  }
  return Sum(host, device, stream, deadline);
}

StatusOr<uint64_t> ChunkDigester::Sum(bool host, Device& device, Stream& stream,
                                      Deadline deadline) {
  const size_t n = DigestSegmentCount(runs_);
  if (host) {
    host_.resize(n);
    internal::DigestOnHost(runs_, host_.data());
    return internal::CombineDigests(host_);
  }
  if (out_.size() < n * sizeof(uint64_t)) KVF_RETURN_IF_ERROR(Reserve(device, n));
  auto* out = reinterpret_cast<uint64_t*>(out_.data());
  KVF_RETURN_IF_ERROR(stream.Digest(runs_, out));
  KVF_RETURN_IF_ERROR(stream.Synchronize(deadline).WithContext("waiting for a chunk digest"));
  return internal::CombineDigests({out, n});
}

}  // namespace kvferry

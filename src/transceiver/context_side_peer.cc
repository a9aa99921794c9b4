#include "transceiver/context_side_peer.h"

#include <fmt/format.h>

namespace kvferry {

Status CheckPeerPool(std::span<PeerMapping* const> mapped, const RmaTarget& target) {
  for (size_t i = 0; i < mapped.size(); ++i) {
    if (i >= target.pool.size()) {
      return Status::InvalidArgument(fmt::format(
          "peer pool region {} has no target region ({} declared)", i, target.pool.size()));
    }
    if (mapped[i]->size() < target.pool[i].bytes) {
      return Status::InvalidArgument(
          fmt::format("peer pool region {} maps {} bytes, the target declares {}", i,
                      mapped[i]->size(), target.pool[i].bytes));
    }
  }
  return Status::Ok();
}

Status PeerCopies(const Chunk& c, std::span<PeerMapping* const> peer_pool, const BlockPool& pool,
                  std::vector<CopyDesc>& out) {
  for (const Piece& pc : c.pieces) {
    if (pc.dst_region < 0 || static_cast<size_t>(pc.dst_region) >= peer_pool.size()) {
      return Status::Internal(
          fmt::format("piece for generation region {} of {}", pc.dst_region, peer_pool.size()));
    }
    const PeerMapping& m = *peer_pool[pc.dst_region];
    const uint64_t last =
        static_cast<uint64_t>(pc.dst_offset) + static_cast<uint64_t>((pc.rows - 1) * pc.dst_pitch);
    if (pc.dst_offset < 0 || last + static_cast<uint64_t>(pc.bytes) > m.size()) {
      return Status::InvalidArgument(fmt::format(
          "copy of {} rows of {} bytes at offset {} (pitch {}) is outside generation region {} "
          "({} bytes mapped)",
          pc.rows, pc.bytes, pc.dst_offset, pc.dst_pitch, pc.dst_region, m.size()));
    }
    CopyDesc d{};
    d.dst = m.data() + pc.dst_offset;
    d.src = pool.region(pc.src_region) + pc.src_offset;
    d.bytes = static_cast<size_t>(pc.bytes);
    d.rows = static_cast<size_t>(pc.rows);
    d.dst_pitch = static_cast<size_t>(pc.dst_pitch);
    d.src_pitch = static_cast<size_t>(pc.src_pitch);
    out.push_back(d);
  }
  return Status::Ok();
}

StatusOr<uint32_t> CollectPeerBatch(const PairPlan& plan, size_t next, int32_t ready_end,
                                    bool one_chunk, std::span<PeerMapping* const> peer_pool,
                                    const BlockPool& pool, std::vector<CopyDesc>& out) {
  out.clear();
  uint32_t count = 0;
  int64_t bytes = 0;
  for (size_t i = next; i < plan.chunks.size() && plan.chunks[i].last_layer < ready_end &&
                        (count == 0 || (!one_chunk && bytes < kPeerBatchBytes));
       ++i) {
    KVF_RETURN_IF_ERROR(
        PeerCopies(plan.chunks[i], peer_pool, pool, out)
            .WithContext(fmt::format("chunk {} to generation rank {}", i, plan.gen_rank)));
    bytes += plan.chunks[i].bytes;
    ++count;
  }
  return count;
}

}  // namespace kvferry

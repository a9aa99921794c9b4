#include "transceiver/context_side_peer.h"

#include <fmt/format.h>

#include "transceiver/rma.h"

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
  for (size_t i = next;
       i < plan.chunks.size() && plan.chunks[i].last_layer < ready_end &&
       (count == 0 || (!one_chunk && bytes < kPeerBatchBytes && count < kPeerBatchChunks));
       ++i) {
    KVF_RETURN_IF_ERROR(
        PeerCopies(plan.chunks[i], peer_pool, pool, out)
            .WithContext(fmt::format("chunk {} to generation rank {}", i, plan.gen_rank)));
    bytes += plan.chunks[i].bytes;
    ++count;
  }
  return count;
}

StatusOr<bool> PeerSender::Launch(const PairPlan& plan, size_t& next, int32_t ready_end,
                                  const BlockPool& pool, Stream& stream, int64_t max_inflight,
                                  std::vector<CopyDesc>& scratch, EventPool& events,
                                  const Digester& digest) {
  bool launched = false;
  while (static_cast<int64_t>(copying_.size()) < max_inflight) {
    KVF_ASSIGN_OR_RETURN(uint32_t count, CollectPeerBatch(plan, next, ready_end, checksum_,
                                                          peer_pool_, pool, scratch));
    if (count == 0) break;
    Batch b;
    b.what.chunk = next;
    b.what.count = count;
    b.what.started = Clock::now();
    if (checksum_) {
      KVF_ASSIGN_OR_RETURN(b.what.checksum, digest(plan.chunks[next]));
      b.what.has_checksum = true;
    }
    next += count;
    Status st = stream.CopyBatch(scratch);
    b.done = events.Acquire();
    if (st.ok()) st = b.done ? stream.Record(*b.done) : Status::Internal("no device event");
    if (!st.ok())
      return st.WithContext(fmt::format("copying into generation rank {}'s pool", plan.gen_rank));
    copying_.push_back(std::move(b));
    launched = true;
  }
  return launched;
}

void PeerSender::Reap(std::vector<Landed>& out) {
  out.clear();
  while (!copying_.empty() && copying_.front().done->Query()) {
    const Batch& b = copying_.front();
    if (!b.what.has_checksum) unreported_.Add(b.what.chunk, b.what.count);
    out.push_back(b.what);
    copying_.pop_front();
  }
}

std::optional<LandedChunks> PeerSender::TakeReport() {
  // A CHUNK names at most 2^20 chunks (docs/wire_format.md): a range past half that goes out
  // even while batches are copying (a batch adds at most kPeerBatchChunks).
  constexpr uint32_t kReportNow = 1u << 19;
  if (unreported_.count == 0 || (!copying_.empty() && unreported_.count < kReportNow))
    return std::nullopt;
  LandedChunks r = unreported_;
  unreported_ = {};
  return r;
}

void PeerSender::Abandon() {
  copying_.clear();
  unreported_ = {};
}

}  // namespace kvferry

#include "transceiver/paths/data_path.h"

#include <fmt/format.h>

#include "transceiver/paths/pack.h"

namespace kvferry {

std::string_view DataPathName(DataPathKind kind) {
  switch (kind) {
    case DataPathKind::kTagged:
      return "tagged";
    case DataPathKind::kOneSided:
      return "one-sided";
    case DataPathKind::kPeerMemory:
      return "peer-memory";
  }
  return "?";
}

int64_t RecvPath::unpack_row_min() const { return kNoDirect; }

bool RecvPath::reported_all(const PathPair& p) const {
  if (next_post_ < p.plan.chunks.size()) return false;
  for (const RecvOp& o : inflight_) {
    if (!o.notified) return false;
  }
  return true;  // the ops gone landed, and a one-sided op lands only once notified
}

bool RecvPath::work_pending() const {
  for (const RecvOp& o : inflight_) {
    if (o.op || o.unpacked) return true;
  }
  return false;
}

void RecvPath::Cancel(Transport& transport) {
  for (RecvOp& o : inflight_) {
    if (o.op && !o.op->Done()) transport.Cancel(*o.op);
  }
}

bool RecvPath::Quiet(const PathRequest& r, const PathPair& p) const {
  return !one_sided() || p.state.final() || p.state.Is(PairPhase::kFetched) ||
         Clock::now() >= r.ended_at + abort_grace_;
}

bool RecvPath::DrainEnded(const PathRequest& r, const PathPair& p,
                          std::deque<RecvOp>::iterator& it) {
  if (it->op || (it->unpacked && !it->unpacked->Query()) || (!it->landed && !Quiet(r, p))) {
    ++it;
    return false;
  }
  it = inflight_.erase(it);  // gives back its slot and event
  return true;
}

Status RecvPath::Verify(PathHost& host, const PathRequest& r, const PathPair& p, const RecvOp& o) {
  if (!o.has_checksum) return Status::Ok();
  KVF_ASSIGN_OR_RETURN(const uint64_t sum, host.ChunkDigest(p.plan.chunks[o.chunk], false));
  if (sum == o.checksum) return Status::Ok();
  return Status::DataLoss(
      fmt::format("request {}: chunk {} from context rank {} fails its checksum ({:#018x} "
                  "arrived, {:#018x} sent)",
                  r.id, o.chunk, p.rank, sum, o.checksum));
}

bool RecvPath::Land(PathHost& host, PathRequest& r, PathPair& p) {
  bool busy = false;
  const auto& chunks = p.plan.chunks;
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    const Chunk& c = chunks[it->chunk];
    if (it->op && it->op->Done()) {
      Status st = it->op->status();
      const int64_t want = it->slot ? c.packed_bytes() : c.bytes;
      if (st.ok() && static_cast<int64_t>(it->op->bytes()) != want) {
        st = Status::DataLoss(
            fmt::format("chunk {} from context rank {}: {} bytes arrived, {} expected", it->chunk,
                        p.rank, it->op->bytes(), want));
      }
      it->op.reset();
      busy = true;
      if (!st.ok())
        host.Fail(r, st.WithContext(fmt::format("receiving from context rank {}", p.rank)));
      it->arrived = true;
    }
    if (r.ending) {
      busy |= DrainEnded(r, p, it);
      continue;
    }
    if (one_sided() && it->notified) it->arrived = true;
    if (it->arrived && !it->landed && !it->unpacked) {
      if (!it->slot) {
        it->landed = true;
      } else if (Status st =
                     QueueSlotCopy(host, c, it->slot, false, unpack_row_min(), it->unpacked);
                 !st.ok()) {
        host.Fail(r, st);
        continue;  // drained by the ending branch
      }
      busy = true;
    }
    if (it->unpacked && it->unpacked->Query()) {
      it->unpacked.Reset();
      it->slot.Reset();
      it->landed = true;
      busy = true;
    }
    if (it->landed && (!p.checksum || it->notified)) {
      if (Status st = Verify(host, r, p, *it); !st.ok()) {
        host.Fail(r, st);
        continue;
      }
      ++completed_;
      r.bytes += c.bytes;
      host.NoteChunk(r.id, c.bytes, it->started);
      it = inflight_.erase(it);
      busy = true;
      continue;
    }
    ++it;
  }
  return busy;
}

void RecvPath::OnChunk(PathHost& host, PathRequest& r, const PathPair& p, const ChunkMsg& k) {
  if (r.ending) return;
  uint32_t marked = 0;
  if (k.count == 1 || !k.has_checksum) {
    for (RecvOp& o : inflight_) {
      if (o.chunk < k.chunk || o.chunk - k.chunk >= k.count || o.notified) continue;
      o.notified = true;
      o.has_checksum = k.has_checksum;
      o.checksum = k.checksum;
      if (++marked == k.count) return;
    }
  }
  host.Fail(r, Status::InvalidArgument(fmt::format(
                   "request {}: context rank {} reported chunks [{}, +{}) in place ({} checksum), "
                   "of which {} are credited and not reported before",
                   r.id, p.rank, k.chunk, k.count, k.has_checksum ? "with a" : "no", marked)));
}

Status RecvPath::CheckComplete(const PathRequest& r, const PathPair& p, const ChunkMsg& k) const {
  if (!k.complete || p.state.final()) return Status::Ok();
  // In phase fetched a CHUNK saying complete stands for ACCEPT mode 2 as well: only where the
  // FETCH offered peer memory. After the answer, any one-sided pair (puts or copies) may fold.
  const bool fetched = p.state.Is(PairPhase::kFetched);
  const bool may = fetched ? offer_.peer_memory : one_sided();
  if (may && k.chunk + uint64_t{k.count} == p.plan.chunks.size()) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "request {}: context rank {} said complete with chunks [{}, +{}) of {} ({}): only the "
      "last CHUNK of a one-sided pair may (before ACCEPT, of a peer-memory pair)",
      r.id, p.rank, k.chunk, k.count, p.plan.chunks.size(),
      fetched ? (offer_.peer_memory ? "no ACCEPT yet, peer memory offered"
                                    : "no ACCEPT yet, no peer memory offered")
              : (one_sided() ? "one-sided" : "tagged")));
}

}  // namespace kvferry

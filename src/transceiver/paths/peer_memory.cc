#include "transceiver/paths/peer_memory.h"

namespace kvferry {

void PeerMemoryCopies::Flush(PathHost& host) {
  const std::vector<uint64_t> owners = launch_.owners();
  launched_ = true;  // a launch held from an earlier pass also gets its wake-up
  if (Status st = launch_.Flush(host.stream(), host.event_pool()); !st.ok()) {
    for (uint64_t id : owners)
      host.FailById(id, st.WithContext("copying into the generation ranks' pools"));
  }
}

StatusOr<bool> PeerMemorySend::Launch(PathHost& host, const PathRequest& r, const PathPair& p) {
  if (copies_.launch_full()) copies_.Flush(host);  // room for this pair's batches
  return sender_.Launch(
      p.plan, next_, r.ready_end, host.pool(), host.stream(), max_inflight_, host.scratch(),
      host.event_pool(), [&host](const Chunk& c) { return host.ChunkDigest(c, true); },
      copies_.merged(), r.id, p.conversion);
}

bool PeerMemorySend::Report(PathHost& host, PathRequest& r, const PathPair& p) {
  bool busy = false;
  std::vector<PeerSender::Landed>& landed = copies_.landed_;
  sender_.Reap(landed);
  for (const PeerSender::Landed& l : landed) {
    busy = true;
    if (r.ending) continue;
    for (uint32_t i = 0; i < l.count; ++i) {
      r.bytes += p.plan.chunks[l.chunk + i].bytes;
      host.NoteChunk(r.id, p.plan.chunks[l.chunk + i].bytes, l.started);
    }
    if (l.has_checksum) {
      host.SendMsg(p.peer, ChunkMsg{r.id, p.transfer_id, static_cast<uint32_t>(l.chunk), l.count,
                                    true, l.checksum});
    }
  }
  if (auto report = sender_.TakeReport(); report && !r.ending) {
    if (Folds(p) && report->first + report->count == p.plan.chunks.size()) {
      last_report_ = report;  // the side's Finish sends it, saying complete
    } else {
      host.SendMsg(p.peer, ChunkMsg{r.id, p.transfer_id, static_cast<uint32_t>(report->first),
                                    report->count, false, 0});
    }
  }
  return busy;
}

// The pair's PeerSender copies ready chunks straight into the mapped generation pool; landed
// chunks count here, and go out by CHUNK (checksummed ones each on their own, the rest as one
// range once nothing is copying).
bool PeerMemorySend::Advance(PathHost& host, PathRequest& r, PathPair& p) {
  bool busy = false;
  if (!r.ending) {
    auto launched = Launch(host, r, p);
    if (!launched.ok()) return host.Fail(r, launched.status()), true;
    busy = *launched;
    if (busy) copies_.NoteLaunched();  // the side queues the wake-up behind this pass's copies
  }
  return Report(host, r, p) || busy;
}

// Every chunk just waits for its CHUNK message (no slot, no credit).
bool PeerMemoryRecv::Post(PathHost& /*host*/, PathRequest& r, const PathPair& p) {
  if (r.ending || p.state.Is(PairPhase::kClosed) || next_post_ == p.plan.chunks.size())
    return false;
  for (; next_post_ < p.plan.chunks.size(); ++next_post_) {
    RecvOp o;
    o.chunk = next_post_;
    inflight_.push_back(std::move(o));
  }
  return true;
}

}  // namespace kvferry

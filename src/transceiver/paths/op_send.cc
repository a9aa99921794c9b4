#include "transceiver/paths/op_send.h"

namespace kvferry {

void OpSendPath::Cancel(Transport& transport) {
  for (SendOp& s : inflight_) {
    if (s.op && !s.op->Done()) transport.Cancel(*s.op);
  }
}

Status OpSendPath::SumSource(PathHost& host, const PathPair& p, const Chunk& c, SendOp& s) {
  if (!p.checksum || p.conversion) return Status::Ok();  // a converting pack is summed packed
  KVF_ASSIGN_OR_RETURN(s.checksum, host.ChunkDigest(c, true));
  s.has_checksum = true;
  return Status::Ok();
}

Status OpSendPath::SumPacked(PathHost& host, const PathPair& p, SendOp& s) {
  if (!p.checksum || !p.conversion) return Status::Ok();
  KVF_ASSIGN_OR_RETURN(s.checksum, host.PackedDigest(p.plan.chunks[s.chunk], s.slot));
  s.has_checksum = true;
  return Status::Ok();
}

void OpSendPath::ChunkSent(PathHost& host, PathRequest& r, const PathPair& p, const SendOp& s) {
  for (uint32_t i = 0; i < s.count; ++i) {
    r.bytes += p.plan.chunks[s.chunk + i].bytes;
    host.NoteChunk(r.id, p.plan.chunks[s.chunk + i].bytes, s.started);
  }
  if (!one_sided() && !s.has_checksum) return;
  if (Folds(p) && s.chunk + s.count == p.plan.chunks.size()) {
    // Sent saying complete once the request is (ContextSideImpl::Finish).
    last_report_ = LandedChunks{s.chunk, s.count, /*staged=*/static_cast<bool>(s.slot)};
    return;
  }
  host.SendMsg(p.peer, ChunkMsg{r.id, p.transfer_id, static_cast<uint32_t>(s.chunk), s.count,
                                s.has_checksum, s.checksum});
}

}  // namespace kvferry

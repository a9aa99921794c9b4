#include "transceiver/paths/tagged.h"

#include <fmt/format.h>

#include <algorithm>

#include "transceiver/paths/pack.h"

namespace kvferry {

void TaggedSend::Open(PathHost& host, const PathRequest& r, const PathPair& p) {
  if (!p.plan.chunks.empty()) host.SendMsg(p.peer, AcceptMsg{r.id, p.transfer_id, false, false});
}

// Tagged credits count posted receives; a one-sided credit (the generation rank credits
// one-sided before it knows this rank's answer) is not for this path.
Status TaggedSend::Credit(const PathPair& /*p*/, const CreditMsg& c) {
  if (c.slots.empty()) credit_ = std::max<size_t>(credit_, c.chunks);
  return Status::Ok();
}

StatusOr<bool> TaggedSend::Start(PathHost& host, const PathPair& p) {
  const Chunk& c = p.plan.chunks[next_];
  SendOp s;
  s.chunk = next_;
  const bool direct = c.direct && host.direct_ok();
  if (!direct) {
    s.slot = host.AcquireSlot();
    if (!s.slot) return false;
  }
  KVF_RETURN_IF_ERROR(SumSource(host, p, c, s));
  if (direct) {
    const Piece& pc = c.pieces.front();
    KVF_ASSIGN_OR_RETURN(
        s.op, host.transport().Send(p.peer, DataTag(p.transfer_id, next_),
                                    host.pool().region(pc.src_region) + pc.src_offset, c.bytes,
                                    host.pool_wire_kind()));
  } else {
    KVF_RETURN_IF_ERROR(QueueSlotCopy(host, c, s.slot, true, kNoDirect, s.packed, p.conversion));
  }
  inflight_.push_back(std::move(s));
  ++next_;
  return true;
}

bool TaggedSend::Advance(PathHost& host, PathRequest& r, PathPair& p) {
  bool busy = false;
  while (MayStart(r, p)) {
    auto started = Start(host, p);
    if (!started.ok()) return host.Fail(r, started.status()), true;
    if (!*started) break;
    busy = true;
  }
  return Reap(host, r, p) || busy;
}

bool TaggedSend::Reap(PathHost& host, PathRequest& r, const PathPair& p) {
  bool busy = false;
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    if (it->packed && it->packed->Query()) {
      it->packed.Reset();
      if (r.ending) {
        it = inflight_.erase(it);
        busy = true;
        continue;
      }
      if (Status st = SumPacked(host, p, *it); !st.ok()) {
        host.Fail(r, st);
        it = inflight_.erase(it);
        busy = true;
        continue;
      }
      auto op =
          host.transport().Send(p.peer, DataTag(p.transfer_id, it->chunk), host.SlotData(it->slot),
                                p.plan.chunks[it->chunk].packed_bytes(), host.staging_wire_kind());
      if (!op.ok()) {
        host.Fail(r, op.status());
      } else {
        it->op = std::move(op).value();
      }
      busy = true;
    }
    if (it->op && it->op->Done()) {
      if (!it->op->status().ok())
        host.Fail(
            r, it->op->status().WithContext(fmt::format("sending to generation rank {}", p.rank)));
      else
        ChunkSent(host, r, p, *it);
      it = inflight_.erase(it);
      busy = true;
      continue;
    }
    if (!it->op && !it->packed) {  // send could not be posted
      it = inflight_.erase(it);
      continue;
    }
    ++it;
  }
  return busy;
}

bool TaggedRecv::Post(PathHost& host, PathRequest& r, const PathPair& p) {
  bool busy = false;
  const auto& chunks = p.plan.chunks;
  while (!r.ending && !p.state.Is(PairPhase::kClosed) && next_post_ < chunks.size() &&
         static_cast<int64_t>(inflight_.size()) < max_inflight_) {
    const Chunk& c = chunks[next_post_];
    RecvOp o;
    o.chunk = next_post_;
    void* dst;
    MemoryKind kind;
    if (c.direct && host.direct_ok()) {
      const Piece& pc = c.pieces.front();
      dst = host.pool().region(pc.dst_region) + pc.dst_offset;
      kind = host.pool_wire_kind();
    } else {
      o.slot = host.AcquireSlot();
      if (!o.slot) break;
      dst = host.SlotData(o.slot);
      kind = host.staging_wire_kind();
    }
    const int64_t bytes = c.direct && host.direct_ok() ? c.bytes : c.packed_bytes();
    auto op = host.transport().Recv(p.peer, DataTag(p.transfer_id, next_post_), dst, bytes, kind);
    if (!op.ok()) {
      host.Fail(r, op.status());
      return true;
    }
    o.op = std::move(op).value();
    inflight_.push_back(std::move(o));
    ++next_post_;
    busy = true;
  }
  if (credited_ < next_post_ && !r.ending) {
    host.SendMsg(p.peer, CreditMsg{r.id, p.transfer_id, static_cast<uint32_t>(next_post_), {}});
    credited_ = next_post_;
  }
  return busy;
}

}  // namespace kvferry

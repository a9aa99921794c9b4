// The context side's data path per pair (ContextSideImpl, context_side_impl.h): tagged sends
// from the pool or a packed staging slot, one-sided puts into the generation pool and its
// credited staging slots, and copies into a mapped peer pool.
#include <fmt/format.h>

#include "transceiver/context_side_impl.h"

namespace kvferry {

// The checksum of a chunk's source bytes, when the pair asked for them; taken once the chunk can
// go (not again on every retry while staging slots are short).
Status ContextSideImpl::SumSource(const SendPair& p, const Chunk& c, SendOp& s) {
  if (!p.checksum) return Status::Ok();
  KVF_ASSIGN_OR_RETURN(s.checksum, ChunkDigest(c, true));
  s.has_checksum = true;
  return Status::Ok();
}

bool ContextSideImpl::AdvancePair(CtxRequest& r, SendPair& p) {
  if (p.mapped) return AdvancePeerPair(r, p);
  if (p.rma) return AdvanceRmaPair(r, p);
  bool busy = false;
  const auto& chunks = p.plan.chunks;
  while (!r.ending && p.next < chunks.size() && p.next < p.credit &&
         static_cast<int64_t>(p.inflight.size()) < options_.max_inflight) {
    const Chunk& c = chunks[p.next];
    if (c.last_layer >= r.ready_end) break;
    SendOp s;
    s.chunk = p.next;
    const bool direct = c.direct && direct_ok();
    if (!direct) {
      s.slot = AcquireSlot();
      if (!s.slot) break;
    }
    if (Status st = SumSource(p, c, s); !st.ok()) return Fail(r, st), true;
    if (direct) {
      const Piece& pc = c.pieces.front();
      auto op =
          transport_->Send(p.peer, DataTag(p.transfer_id, p.next),
                           PoolAddress(pc.src_region, pc.src_offset), c.bytes, pool_wire_kind());
      if (!op.ok()) return Fail(r, op.status()), true;
      s.op = std::move(op).value();
    } else {
      ChunkCopies(c, true, pool_, SlotData(s.slot), true, descs_);
      Status st = stream_->CopyBatch(descs_);
      s.packed = AcquireEvent();
      if (st.ok()) st = s.packed ? stream_->Record(*s.packed) : Status::Internal("no device event");
      if (!st.ok()) return Fail(r, st.WithContext("packing a chunk")), true;
    }
    p.inflight.push_back(std::move(s));
    ++p.next;
    busy = true;
  }
  for (auto it = p.inflight.begin(); it != p.inflight.end();) {
    if (it->packed && it->packed->Query()) {
      it->packed.Reset();
      if (r.ending) {
        it = p.inflight.erase(it);
        busy = true;
        continue;
      }
      auto op = transport_->Send(p.peer, DataTag(p.transfer_id, it->chunk), SlotData(it->slot),
                                 chunks[it->chunk].bytes, staging_wire_kind());
      if (!op.ok()) {
        Fail(r, op.status());
      } else {
        it->op = std::move(op).value();
      }
      busy = true;
    }
    if (it->op && it->op->Done()) {
      if (!it->op->status().ok())
        Fail(r, it->op->status().WithContext(
                    fmt::format("sending to generation rank {}", p.gen_rank)));
      else
        ChunkSent(r, p, *it);
      it = p.inflight.erase(it);
      busy = true;
      continue;
    }
    if (!it->op && !it->packed) {  // send could not be posted
      it = p.inflight.erase(it);
      continue;
    }
    ++it;
  }
  return busy;
}

// A chunk is in place at the generation rank (tagged: its send completed; one-sided: flushed).
void ContextSideImpl::ChunkSent(CtxRequest& r, SendPair& p, const SendOp& s) {
  for (uint32_t i = 0; i < s.count; ++i) {
    r.bytes += p.plan.chunks[s.chunk + i].bytes;
    NoteChunk(r.id, p.plan.chunks[s.chunk + i].bytes, s.started);
  }
  if (!p.rma && !s.has_checksum) return;
  if (Foldable(p) && s.chunk + s.count == p.plan.chunks.size()) {
    // The pair's last chunk: its CHUNK goes out saying complete once the request is (Finish).
    p.last_report = LandedChunks{s.chunk, s.count};
    return;
  }
  SendMsg(p.peer, ChunkMsg{r.id, p.transfer_id, static_cast<uint32_t>(s.chunk), s.count,
                           s.has_checksum, s.checksum});
}

// Peer memory (context_side_peer.h): the pair's PeerSender copies ready chunks straight into
// the mapped generation pool; landed chunks count here, and go out by CHUNK (checksummed ones
// each on their own, the rest as one range once nothing is copying).
bool ContextSideImpl::AdvancePeerPair(CtxRequest& r, SendPair& p) {
  bool busy = false;
  if (!r.ending) {
    if (peer_launch_.full()) FlushPeerLaunch();  // room for this pair's batches
    auto launched = p.mapped->Launch(
        p.plan, p.next, r.ready_end, pool_, *stream_, options_.max_inflight, descs_, event_pool(),
        [this](const Chunk& c) { return ChunkDigest(c, true); },
        options_.peer_merge_pairs ? &peer_launch_ : nullptr, r.id);
    if (!launched.ok()) return Fail(r, launched.status()), true;
    busy = *launched;
    peer_launched_ |= busy;  // Advance queues the wake-up behind this pass's copies
  }
  p.mapped->Reap(landed_);
  for (const PeerSender::Landed& l : landed_) {
    busy = true;
    if (r.ending) continue;
    for (uint32_t i = 0; i < l.count; ++i) {
      r.bytes += p.plan.chunks[l.chunk + i].bytes;
      NoteChunk(r.id, p.plan.chunks[l.chunk + i].bytes, l.started);
    }
    if (l.has_checksum) {
      SendMsg(p.peer, ChunkMsg{r.id, p.transfer_id, static_cast<uint32_t>(l.chunk), l.count, true,
                               l.checksum});
    }
  }
  if (auto report = p.mapped->TakeReport(); report && !r.ending) {
    if (Foldable(p) && report->first + report->count == p.plan.chunks.size()) {
      p.last_report = report;  // Finish sends it, saying complete
    } else {
      SendMsg(p.peer, ChunkMsg{r.id, p.transfer_id, static_cast<uint32_t>(report->first),
                               report->count, false, 0});
    }
  }
  return busy;
}

// Peer-memory batches are copying (each Advance that launched some queued WakeAtStreamEnd behind
// them, after the merged PeerLaunch flush) and no transport operation waits to be driven: the
// next thing this side must do is reap a batch, and a FETCH arriving meanwhile would queue its
// copies behind these.
std::chrono::microseconds ContextSideImpl::QuietNap() const {
  if (peer_copies_.copying() == 0 || !host_visible_pool() || device_.info().platform != "cpu")
    return {};
  for (const auto& [id, r] : requests_) {
    for (const auto& [rank, p] : r.pairs) {
      if (!p.inflight.empty()) return {};
    }
  }
  return options_.stream_nap;
}

// One-sided: rows put pool to pool, the packed rest put into the credited staging slot, one
// flush, then CHUNK.
bool ContextSideImpl::AdvanceRmaPair(CtxRequest& r, SendPair& p) {
  bool busy = false;
  const auto& chunks = p.plan.chunks;
  const RmaTarget& t = p.target;
  while (!r.ending && p.next < chunks.size() && p.next < p.credit &&
         static_cast<int64_t>(p.inflight.size()) < options_.max_inflight) {
    const Chunk& c = chunks[p.next];
    if (c.last_layer >= r.ready_end) break;
    const int64_t packed = PackedBytes(c, t.row_min_bytes);
    const uint32_t remote_slot = p.slots[p.next];
    if (packed > 0 && (remote_slot >= t.slots || packed > t.slot_bytes)) {
      Fail(r, Status::InvalidArgument(fmt::format(
                  "generation rank {} credited chunk {} ({} packed bytes) with staging slot {} "
                  "of {} ({} bytes each)",
                  p.gen_rank, p.next, packed, static_cast<int64_t>(remote_slot), t.slots,
                  t.slot_bytes)));
      return true;
    }
    SendOp s;
    s.chunk = p.next;
    if (packed > 0) {
      s.slot = AcquireSlot();
      if (!s.slot) break;
    }
    if (Status st = SumSource(p, c, s); !st.ok()) return Fail(r, st), true;
    if (packed > 0) {
      ChunkCopies(c, true, pool_, SlotData(s.slot), true, descs_, t.row_min_bytes);
      Status st = stream_->CopyBatch(descs_);
      s.packed = AcquireEvent();
      if (st.ok()) st = s.packed ? stream_->Record(*s.packed) : Status::Internal("no device event");
      if (!st.ok()) return Fail(r, st.WithContext("packing a chunk")), true;
    }
    Status st = PutDirectRows(*transport_, p.peer, c, pool_, pool_wire_kind(), t, s.puts);
    p.inflight.push_back(std::move(s));
    ++p.next;
    busy = true;
    if (!st.ok()) {
      Fail(r, st.WithContext(fmt::format("putting chunk {} to generation rank {}",
                                         p.inflight.back().chunk, p.gen_rank)));
      break;
    }
  }
  for (auto it = p.inflight.begin(); it != p.inflight.end();) {
    SendOp& s = *it;
    if (s.packed && s.packed->Query()) {
      s.packed.Reset();
      busy = true;
      if (!r.ending) {
        const uint32_t slot = p.slots[s.chunk];
        auto op = transport_->Put(
            p.peer, SlotData(s.slot), PackedBytes(chunks[s.chunk], t.row_min_bytes),
            staging_wire_kind(), t.staging.address + slot * t.slot_bytes, t.staging.rkey);
        if (op.ok())
          s.puts.push_back(std::move(op).value());
        else
          Fail(r, op.status().WithContext("putting a packed chunk"));
      }
    }
    if (!s.packed && !s.flush && !r.ending) {
      auto op = transport_->Flush(p.peer);
      if (op.ok())
        s.flush = std::move(op).value();
      else
        Fail(r, op.status().WithContext("flushing puts"));
      busy = true;
    }
    bool puts_done = true;
    for (const auto& op : s.puts) puts_done &= op->Done();
    if (s.packed || !puts_done || (s.flush ? !s.flush->Done() : !r.ending)) {
      ++it;
      continue;
    }
    Status st = s.flush ? s.flush->status() : Status::Ok();
    for (const auto& op : s.puts) {
      if (st.ok()) st = op->status();
    }
    if (!st.ok()) {
      Fail(r, st.WithContext(
                  fmt::format("putting chunk {} to generation rank {}", s.chunk, p.gen_rank)));
    } else if (!r.ending) {
      ChunkSent(r, p, s);
    }
    it = p.inflight.erase(it);
    busy = true;
  }
  return busy;
}

}  // namespace kvferry

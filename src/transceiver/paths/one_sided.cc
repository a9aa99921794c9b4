#include "transceiver/paths/one_sided.h"

#include <fmt/format.h>

#include "transceiver/paths/pack.h"
#include "transceiver/rma.h"

namespace kvferry {

void OneSidedSend::Open(PathHost& host, const PathRequest& r, const PathPair& p) {
  if (!p.plan.chunks.empty()) host.SendMsg(p.peer, AcceptMsg{r.id, p.transfer_id, true, false});
}

// One-sided credits name the staging slot of each newly credited chunk; a tagged credit (the
// generation rank credits again tagged after an ACCEPT saying tagged) is not for this path.
Status OneSidedSend::Credit(const PathPair& p, const CreditMsg& c) {
  if (c.slots.empty()) return Status::Ok();
  if (c.chunks != slots_.size() + c.slots.size() || c.chunks > p.plan.chunks.size()) {
    return Status::InvalidArgument(
        fmt::format("generation rank {} credited chunks up to {} with {} slots after {} of "
                    "{} chunks",
                    p.rank, c.chunks, c.slots.size(), slots_.size(), p.plan.chunks.size()));
  }
  slots_.insert(slots_.end(), c.slots.begin(), c.slots.end());
  credit_ = slots_.size();
  return Status::Ok();
}

StatusOr<bool> OneSidedSend::Start(PathHost& host, const PathPair& p) {
  const Chunk& c = p.plan.chunks[next_];
  const RmaTarget& t = target_;
  const int64_t packed = PackedBytes(c, t.row_min_bytes);
  const uint32_t remote_slot = slots_[next_];
  if (packed > 0 && (remote_slot >= t.slots || packed > t.slot_bytes)) {
    return Status::InvalidArgument(fmt::format(
        "generation rank {} credited chunk {} ({} packed bytes) with staging slot {} "
        "of {} ({} bytes each)",
        p.rank, next_, packed, static_cast<int64_t>(remote_slot), t.slots, t.slot_bytes));
  }
  SendOp s;
  s.chunk = next_;
  if (packed > 0) {
    s.slot = host.AcquireSlot();
    if (!s.slot) return false;
  }
  KVF_RETURN_IF_ERROR(SumSource(host, p, c, s));
  if (packed > 0)
    KVF_RETURN_IF_ERROR(
        QueueSlotCopy(host, c, s.slot, true, t.row_min_bytes, s.packed, p.conversion));
  Status st =
      PutDirectRows(host.transport(), p.peer, c, host.pool(), host.pool_wire_kind(), t, s.puts);
  inflight_.push_back(std::move(s));
  ++next_;
  if (!st.ok()) {
    // The puts posted so far stay in flight with the chunk (the request drains them).
    return st.WithContext(
        fmt::format("putting chunk {} to generation rank {}", inflight_.back().chunk, p.rank));
  }
  return true;
}

bool OneSidedSend::Advance(PathHost& host, PathRequest& r, PathPair& p) {
  bool busy = false;
  while (MayStart(r, p)) {
    const size_t before = inflight_.size();
    auto started = Start(host, p);
    if (!started.ok()) {
      host.Fail(r, started.status());
      // A chunk whose puts failed was started (its puts drain): reap as after any start; a chunk
      // refused before it started ends the pass.
      if (inflight_.size() == before) return true;
      busy = true;
      break;
    }
    if (!*started) break;
    busy = true;
  }
  return Reap(host, r, p) || busy;
}

bool OneSidedSend::Reap(PathHost& host, PathRequest& r, const PathPair& p) {
  bool busy = false;
  const auto& chunks = p.plan.chunks;
  const RmaTarget& t = target_;
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    SendOp& s = *it;
    if (s.packed && s.packed->Query()) {
      s.packed.Reset();
      busy = true;
      Status summed = r.ending ? Status::Ok() : SumPacked(host, p, s);
      if (!summed.ok()) {
        host.Fail(r, summed);
      } else if (!r.ending) {
        const uint32_t slot = slots_[s.chunk];
        auto op = host.transport().Put(
            p.peer, host.SlotData(s.slot), PackedBytes(chunks[s.chunk], t.row_min_bytes),
            host.staging_wire_kind(), t.staging.address + slot * t.slot_bytes, t.staging.rkey);
        if (op.ok())
          s.puts.push_back(std::move(op).value());
        else
          host.Fail(r, op.status().WithContext("putting a packed chunk"));
      }
    }
    if (!s.packed && !s.flush && !r.ending) {
      auto op = host.transport().Flush(p.peer);
      if (op.ok())
        s.flush = std::move(op).value();
      else
        host.Fail(r, op.status().WithContext("flushing puts"));
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
      host.Fail(r, st.WithContext(
                       fmt::format("putting chunk {} to generation rank {}", s.chunk, p.rank)));
    } else if (!r.ending) {
      ChunkSent(host, r, p, s);
    }
    it = inflight_.erase(it);
    busy = true;
  }
  return busy;
}

// A staging slot for each chunk with packed bytes, credited by number (none while the answer to
// a peer-memory offer is awaited).
bool OneSidedRecv::Post(PathHost& host, PathRequest& r, const PathPair& p) {
  if (awaits_answer(p)) return false;
  if (r.ending || p.state.Is(PairPhase::kClosed)) return false;
  const auto& chunks = p.plan.chunks;
  std::vector<uint32_t> slots;
  while (next_post_ < chunks.size() && static_cast<int64_t>(inflight_.size()) < max_inflight_) {
    RecvOp o;
    o.chunk = next_post_;
    if (PackedBytes(chunks[next_post_], row_min_) > 0) {
      o.slot = host.AcquireSlot();
      if (!o.slot) break;
    }
    slots.push_back(o.slot ? static_cast<uint32_t>(o.slot.index()) : kNoSlot);
    inflight_.push_back(std::move(o));
    ++next_post_;
  }
  if (slots.empty()) return false;
  host.SendMsg(p.peer,
               CreditMsg{r.id, p.transfer_id, static_cast<uint32_t>(next_post_), std::move(slots)});
  credited_ = next_post_;
  return true;
}

}  // namespace kvferry

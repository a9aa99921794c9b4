// BlockManager, the moving half: eviction and offload, demotion to the file tier, onboards, the
// watermarks, and retiring finished operations. Nothing here waits for a copy or for I/O: every
// batch becomes an Op that is retired by a later call once its TransferBatch has finished.
#include <fmt/format.h>

#include <algorithm>

#include "base/log.h"
#include "tiering/block_manager_impl.h"

namespace kvferry {

using tiering::Op;
using tiering::OpItem;
using tiering::OpKind;
using tiering::SlotLease;

void BlockManager::Impl::AddOp(Op op) {
  op.deadline = Clock::now() + opt.io_timeout;
  if (op.kind == OpKind::kDemote) demoting += static_cast<int64_t>(op.items.size());
  ops[tiering::LaneOf(op)].push_back(std::move(op));
}

void BlockManager::Impl::RetireAndSubmit() {
  RetireFinished();
  SubmitDeferred();
}

void BlockManager::Impl::Maintain() {
  RetireAndSubmit();
  RunWatermarks();
}

void BlockManager::Impl::RetireFinished() {
  // A lane's first unfinished op ends its polling: a call queries a few batches, not every one in
  // flight.
  for (int l = 0; l < tiering::kLanes; ++l) {
    std::deque<Op>& lane = ops[l];
    while (!lane.empty() && lane.front().batch.Query()) {
      Op op = std::move(lane.front());
      lane.pop_front();
      if (op.kind == OpKind::kDemote) demoting -= static_cast<int64_t>(op.items.size());
      Retire(op);
      RecycleOp(op);  // releases the leases the retirement did not hand on
    }
  }
  // Deadlines grow in submission order: only the oldest file ops can be past theirs.
  const Clock::time_point now = Clock::now();
  for (Op& op : ops[2]) {
    if (now <= op.deadline) break;
    if (op.abandoned) continue;
    // Past its deadline: counted and reported, but its slots and blocks stay leased until the
    // I/O has really ended (a slot whose write may still run must not be reused).
    op.abandoned = true;
    ++st.abandoned;
    Log(LogLevel::kWarn, "tiering: a file {} of {} blocks is past its {} ms deadline",
        op.kind == OpKind::kDemote || op.kind == OpKind::kSpill ? "write" : "read", op.items.size(),
        opt.io_timeout.count());
  }
}

void BlockManager::Impl::Retire(Op& op) {
  const std::vector<Status>& results = op.batch.items();
  auto result = [&](size_t i) {
    return i < results.size() ? results[i] : Status::Internal("transfer batch lost an item");
  };
  for (size_t i = 0; i < op.items.size(); ++i) {
    OpItem& it = op.items[i];
    const Status item = result(i);
    switch (op.kind) {
      case OpKind::kOffload:
        if (!item.ok()) {
          Log(LogLevel::kError, "tiering: offload of primary block {} failed: {}", it.src,
              item.ToString());
          if (IndexedAt(it.key, Tier::kHost, it.dst)) {
            Lru(Tier::kHost).Remove(it.dst);
            Drop(it.key, "offload failed: " + item.ToString());
            free_host.push_back(it.dst);
          }
        }
        break;
      case OpKind::kDemote: {
        tiering::Slot& h = SlotOf(Tier::kHost, it.src);
        h.busy = false;
        if (!IndexedAt(it.key, Tier::kHost, it.src)) {
          free_host.push_back(it.src);  // onboarded meanwhile: the file copy is not needed
          break;
        }
        const int32_t prio = index.At(it.key).priority;
        if (item.ok()) {
          Relocate(it.key, Tier::kFile, it.dst);
          file_leases[it.dst] = std::move(it.slot);
          Lru(Tier::kFile).Push(it.dst, prio);
          free_host.push_back(it.src);
          ++st.demoted;
        } else {
          Log(LogLevel::kWarn, "tiering: demotion of host block {} failed, it stays: {}", it.src,
              item.ToString());
          Lru(Tier::kHost).Push(it.src, prio);
          ++st.write_failures;
        }
        break;
      }
      case OpKind::kSpill:
        SlotOf(Tier::kFile, it.dst).busy = false;
        if (!IndexedAt(it.key, Tier::kFile, it.dst)) break;
        if (item.ok()) {
          file_leases[it.dst] = std::move(it.slot);
          Lru(Tier::kFile).Push(it.dst, index.At(it.key).priority);
          ++st.demoted;
        } else {
          Drop(it.key, "write to the file tier failed: " + item.ToString());
          ++st.write_failures;
        }
        break;
      case OpKind::kOnboard:
      case OpKind::kPartial: {
        if (op.from == Tier::kFile && op.kind == OpKind::kPartial) {
          // The candidate slot goes back to the index, if its key is still there.
          SlotOf(Tier::kFile, it.src).busy = false;
          if (IndexedAt(it.key, Tier::kFile, it.src)) {
            file_leases[it.src] = std::move(it.slot);
            Lru(Tier::kFile).Push(it.src, index.At(it.key).priority);
          }
        }
        if (op.from != Tier::kFile) break;  // host onboards: ordered by the streams
        tiering::Slot& d = SlotOf(Tier::kPrimary, it.dst);
        d.arriving = false;
        if (!item.ok()) {
          d.failed = true;
          d.why = item.ToString();
          ++st.corrupt_reads;
          if (op.kind == OpKind::kOnboard && IndexedAt(it.key, Tier::kPrimary, it.dst)) {
            Drop(it.key, fmt::format("onboard from the file tier failed: {}", item.ToString()));
          }
        }
        if (d.refs == 0) {  // a prefetch, or every sequence ended while it arrived
          if (d.has_key) {
            Lru(Tier::kPrimary).Push(it.dst, index.At(d.key).priority);
          } else {
            d.failed = false;
            free_primary.push_back(it.dst);
          }
        }
        break;
      }
    }
  }
}

void BlockManager::Impl::SubmitDeferred() {
  while (!deferred.empty() &&
         static_cast<int64_t>(deferred.front().items.size()) <= tm->file_staging_free()) {
    Op op = std::move(deferred.front());
    deferred.pop_front();
    StartFileRead(std::move(op));
  }
}

void BlockManager::Impl::SubmitFileRead(Op op) {
  if (static_cast<int64_t>(op.items.size()) > tm->file_staging_free() || !deferred.empty()) {
    deferred.push_back(std::move(op));  // in order: never ahead of earlier deferred reads
    return;
  }
  StartFileRead(std::move(op));
}

void BlockManager::Impl::StartFileRead(Op op) {
  std::vector<BlockMove>& moves = scratch.read_moves;
  moves.clear();
  for (const OpItem& it : op.items) moves.emplace_back(it.src, it.dst, it.tokens, it.key);
  auto batch = Submit([&] { return tm->Move(Tier::kFile, Tier::kPrimary, moves); });
  if (!batch.ok()) {
    // A programming error (ids were checked): every item fails, nothing is in flight.
    Log(LogLevel::kError, "tiering: file read not queued: {}", batch.status().ToString());
    op.batch = TransferBatch();
    for (OpItem& it : op.items) {
      tiering::Slot& d = SlotOf(Tier::kPrimary, it.dst);
      d.arriving = false;
      d.failed = true;
      d.why = batch.status().ToString();
    }
    return;
  }
  op.batch = *batch;
  op.bytes = static_cast<int64_t>(op.items.size()) * block_bytes;
  AddOp(std::move(op));
}

void BlockManager::Impl::RunWatermarks() {
  if (opt.free_high_pct <= 0) return;
  const int64_t np = tm->tier_blocks(Tier::kPrimary);
  const int64_t have = static_cast<int64_t>(free_primary.size());
  // Ahead of the next allocation: at least as many free blocks as the largest recent one needed,
  // so an AddSequence with many host hits finds them free instead of evicting on its thread.
  recent_need[recent_at++ % recent_need.size()] = need_now;
  need_now = 0;
  const int64_t ahead = std::min(*std::max_element(recent_need.begin(), recent_need.end()), np / 2);
  if (have < std::max(Mark(np, opt.free_low_pct), ahead) && Lru(Tier::kPrimary).size() > 0) {
    std::vector<int64_t> victims;
    const int64_t want = std::max(Mark(np, opt.free_high_pct), ahead) - have;
    while (static_cast<int64_t>(victims.size()) < want) {
      const int64_t v = Lru(Tier::kPrimary).PopVictim();
      if (v < 0) break;
      victims.push_back(v);
    }
    EvictPrimary(victims);
    for (int64_t v : victims) {
      SlotOf(Tier::kPrimary, v).has_key = false;
      free_primary.push_back(v);
    }
    st.background_evictions += static_cast<int64_t>(victims.size());
  }
  if (file == nullptr || !tm->has_tier(Tier::kHost)) return;
  const int64_t nh = tm->tier_blocks(Tier::kHost);
  const int64_t host_free = static_cast<int64_t>(free_host.size()) + demoting;
  if (host_free < Mark(nh, opt.free_low_pct)) Demote(Mark(nh, opt.free_high_pct) - host_free);
}

void BlockManager::Impl::Demote(int64_t count) {
  while (count > 0 && Lru(Tier::kHost).size() > 0) {
    const int64_t n = std::min({count, tm->file_staging_free(), tm->file_staging_blocks()});
    if (n <= 0) return;  // staging busy: the next call continues
    Op op = NewOp(OpKind::kDemote, Tier::kHost);
    std::vector<BlockMove> moves;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t h = Lru(Tier::kHost).Peek();
      if (h < 0) break;
      SlotLease slot = AcquireSlot();
      if (!slot) break;            // every slot is leased by I/O in flight
      Lru(Tier::kHost).Remove(h);  // AcquireSlot may have dropped other keys, not this one
      const BlockKey key = SlotOf(Tier::kHost, h).key;
      SlotOf(Tier::kHost, h).busy = true;
      moves.emplace_back(h, slot.id(), 0, key);
      op.items.push_back(OpItem{key, h, slot.id(), 0, std::move(slot)});
    }
    if (moves.empty()) return;
    auto batch = Submit([&] { return tm->Move(Tier::kHost, Tier::kFile, moves); });
    if (!batch.ok()) {
      Log(LogLevel::kError, "tiering: demotion not queued: {}", batch.status().ToString());
      for (const OpItem& it : op.items) {
        SlotOf(Tier::kHost, it.src).busy = false;
        Lru(Tier::kHost).Push(it.src, index.At(it.key).priority);
      }
      return;  // the leases go back with `op`
    }
    op.batch = *batch;
    op.bytes = static_cast<int64_t>(moves.size()) * block_bytes;
    count -= static_cast<int64_t>(moves.size());
    AddOp(std::move(op));
  }
}

SlotLease BlockManager::Impl::AcquireSlot() {
  auto s = file->Allocate();
  if (s.ok()) return SlotLease(file, *s);
  const int64_t v = Lru(Tier::kFile).PopVictim();
  if (v < 0) return {};
  Drop(SlotOf(Tier::kFile, v).key, "evicted from the file tier, the last tier");  // releases v
  s = file->Allocate();
  return s.ok() ? SlotLease(file, *s) : SlotLease();
}

int64_t BlockManager::Impl::FreeHostBlock() {
  if (free_host.empty()) {
    // Nothing demoted in time: the host tier's own victim makes room (never a wait for a disk).
    const int64_t h = Lru(Tier::kHost).PopVictim();
    if (h < 0) return -1;
    Drop(SlotOf(Tier::kHost, h).key, file ? "evicted from the host tier before its demotion"
                                          : "evicted from the host tier, the last tier");
    return h;
  }
  const int64_t h = free_host.back();
  free_host.pop_back();
  return h;
}

std::vector<int64_t> BlockManager::Impl::Spill(std::span<const int64_t> victims) {
  std::vector<int64_t> left;
  size_t at = 0;
  while (at < victims.size()) {
    const int64_t n = std::min({static_cast<int64_t>(victims.size() - at), tm->file_staging_free(),
                                tm->file_staging_blocks()});
    if (n <= 0) break;
    Op op = NewOp(OpKind::kSpill, Tier::kPrimary);
    std::vector<BlockMove> moves;
    for (int64_t i = 0; i < n; ++i, ++at) {
      SlotLease slot = AcquireSlot();
      if (!slot) {
        left.push_back(victims[at]);
        continue;
      }
      const BlockKey key = SlotOf(Tier::kPrimary, victims[at]).key;
      moves.emplace_back(victims[at], slot.id(), 0, key);
      op.items.push_back(OpItem{key, victims[at], slot.id(), 0, std::move(slot)});
    }
    if (moves.empty()) continue;
    if (opt.compute != nullptr) (void)tm->WaitForCompute(*opt.compute);
    auto batch = Submit([&] { return tm->Move(Tier::kPrimary, Tier::kFile, moves); });
    if (!batch.ok()) {
      Log(LogLevel::kError, "tiering: spill to the file tier not queued: {}",
          batch.status().ToString());
      for (const OpItem& it : op.items) left.push_back(it.src);
      continue;
    }
    for (const OpItem& it : op.items) {
      Relocate(it.key, Tier::kFile, it.dst);  // not readable until written: busy
      SlotOf(Tier::kFile, it.dst).busy = true;
    }
    op.batch = *batch;
    op.bytes = static_cast<int64_t>(moves.size()) * block_bytes;
    AddOp(std::move(op));
  }
  left.insert(left.end(), victims.begin() + static_cast<std::ptrdiff_t>(at), victims.end());
  return left;
}

void BlockManager::Impl::EvictPrimary(std::span<const int64_t> victims) {
  std::vector<BlockMove>& moves = scratch.evict_moves;
  moves.clear();
  std::vector<int64_t> to_file;
  for (int64_t v : victims) {
    const BlockKey key = SlotOf(Tier::kPrimary, v).key;
    if (!tm->has_tier(Tier::kHost)) {
      Drop(key, "evicted from the primary tier, the last tier");
      continue;
    }
    const int32_t prio = index.At(key).priority;
    if (prio < opt.offload_min_priority) {
      Drop(key, "evicted from the primary tier; its priority is below offload_min_priority");
      continue;
    }
    if (free_host.empty() && file != nullptr) {
      to_file.push_back(v);  // the host tier is full: straight to the file tier
      continue;
    }
    const int64_t h = FreeHostBlock();
    if (h < 0) {
      Drop(key, "evicted from the primary tier; every host block is leased");
      continue;
    }
    moves.emplace_back(v, h, 0, key);
  }
  for (int64_t v : Spill(to_file)) {  // no staging or slot free: the host victim makes room
    const BlockKey key = SlotOf(Tier::kPrimary, v).key;
    const int64_t h = FreeHostBlock();
    if (h < 0) {
      Drop(key, "evicted from the primary tier; every host block and file slot is leased");
      continue;
    }
    moves.emplace_back(v, h, 0, key);
  }
  if (moves.empty()) return;
  if (opt.compute != nullptr) {
    Status s = tm->WaitForCompute(*opt.compute);
    if (!s.ok()) Log(LogLevel::kError, "tiering: WaitForCompute failed: {}", s.ToString());
  }
  auto batch = Submit([&] { return tm->Offload(Tier::kHost, moves); });
  Op op = NewOp(OpKind::kOffload, Tier::kPrimary);
  op.items.reserve(moves.size());
  for (const BlockMove& m : moves) {
    if (!batch.ok()) {  // a programming error: keep the books straight anyway
      Drop(m.key, batch.status().ToString());
      free_host.push_back(m.dst);
      continue;
    }
    Relocate(m.key, Tier::kHost, m.dst);
    Lru(Tier::kHost).Push(m.dst, index.At(m.key).priority);
    ++st.offloaded;
    op.items.push_back(OpItem{m.key, m.src, m.dst, 0, {}});
  }
  if (!batch.ok()) return;
  op.batch = *batch;
  op.bytes = static_cast<int64_t>(moves.size()) * block_bytes;
  AddOp(std::move(op));
}

Status BlockManager::Impl::AllocatePrimary(int64_t n, std::vector<int64_t>& out) {
  const int64_t avail = static_cast<int64_t>(free_primary.size()) + Lru(Tier::kPrimary).size();
  if (n > avail) {
    return Status::ResourceExhausted(fmt::format(
        "block manager: need {} primary blocks, {} are free or evictable (the other {} are "
        "referenced or being onboarded)",
        n, avail, tm->tier_blocks(Tier::kPrimary) - avail));
  }
  need_now = std::max(need_now, n);
  std::vector<int64_t>& victims = scratch.victims;
  victims.clear();
  for (int64_t i = 0; i < n; ++i) {
    int64_t b;
    if (!free_primary.empty()) {
      b = free_primary.back();
      free_primary.pop_back();
    } else {
      b = Lru(Tier::kPrimary).PopVictim();
      victims.push_back(b);
    }
    out.push_back(b);
  }
  st.inline_evictions += static_cast<int64_t>(victims.size());
  EvictPrimary(victims);
  for (int64_t b : out) {
    tiering::Slot& s = SlotOf(Tier::kPrimary, b);
    s.has_key = false;
    s.refs = 1;
    s.failed = false;
    s.why.clear();
  }
  return Status::Ok();
}

void BlockManager::Impl::Onboard(Tier from, std::span<const BlockMove> moves,
                                 std::span<SlotLease> leases, bool prefetch) {
  if (moves.empty()) return;
  if (from == Tier::kHost) {
    auto batch = Submit([&] { return tm->Onboard(Tier::kHost, moves); });
    Op op = NewOp(OpKind::kOnboard, Tier::kHost);
    op.prefetch = prefetch;
    op.items.reserve(moves.size());
    for (const BlockMove& mv : moves) {
      if (!batch.ok()) {  // programming error: the key stays in the host tier
        Lru(Tier::kHost).Push(mv.src, index.At(mv.key).priority);
        continue;
      }
      Relocate(mv.key, Tier::kPrimary, mv.dst);
      if (!SlotOf(Tier::kHost, mv.src).busy) free_host.push_back(mv.src);  // else: at demotion end
      op.items.push_back(OpItem{mv.key, mv.src, mv.dst, 0, {}});
    }
    if (!batch.ok()) return;
    op.batch = *batch;
    op.bytes = static_cast<int64_t>(moves.size()) * block_bytes;
    AddOp(std::move(op));
    return;
  }
  const size_t chunk = static_cast<size_t>(std::max<int64_t>(tm->file_staging_blocks(), 1));
  for (size_t at = 0; at < moves.size(); at += chunk) {
    Op op = NewOp(OpKind::kOnboard, Tier::kFile);
    op.prefetch = prefetch;
    for (size_t i = at; i < std::min(moves.size(), at + chunk); ++i) {
      const BlockMove& mv = moves[i];
      Relocate(mv.key, Tier::kPrimary, mv.dst);
      SlotOf(Tier::kPrimary, mv.dst).arriving = true;
      op.items.push_back(OpItem{mv.key, mv.src, mv.dst, 0, std::move(leases[i])});
    }
    SubmitFileRead(std::move(op));
  }
}

}  // namespace kvferry

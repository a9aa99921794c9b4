#include "transceiver/paths/peer_copies.h"

#include <fmt/format.h>

#include <algorithm>

#include "transceiver/rma.h"

namespace kvferry {
namespace {
int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// One launch of `copies` on `stream` and the pooled event that marks its end (the submit phase of
// the profile).
StatusOr<EventLease> SubmitCopies(Stream& stream, EventPool& events,
                                  std::span<const CopyDesc> copies, ProgressProfile* profile,
                                  std::optional<Conversion> conversion = std::nullopt) {
  ProfileScope timed(profile, ProfilePhase::kCopySubmit);
  KVF_RETURN_IF_ERROR(conversion ? stream.ConvertBatch(copies, *conversion)
                                 : stream.CopyBatch(copies));
  EventLease done = events.Acquire();
  if (!done) return Status::Internal("no device event");
  KVF_RETURN_IF_ERROR(stream.Record(*done));
  return done;
}
}  // namespace

bool ExtendRows(CopyDesc& prev, const CopyDesc& next) {
  if (prev.rows < 1 || next.rows < 1 || prev.bytes != next.bytes) return false;
  if (prev.planes > 1 || next.planes > 1) return false;
  // A one-row descriptor takes the pitches of the one it joins (its own are unused).
  const size_t dp = prev.rows > 1 ? prev.dst_pitch : next.rows > 1 ? next.dst_pitch : prev.bytes;
  const size_t sp = prev.rows > 1 ? prev.src_pitch : next.rows > 1 ? next.src_pitch : prev.bytes;
  if ((next.rows > 1 && (next.dst_pitch != dp || next.src_pitch != sp)) || dp < prev.bytes ||
      sp < prev.bytes)
    return false;
  if (static_cast<const std::byte*>(next.dst) !=
          static_cast<std::byte*>(prev.dst) + prev.rows * dp ||
      static_cast<const std::byte*>(next.src) !=
          static_cast<const std::byte*>(prev.src) + prev.rows * sp)
    return false;
  prev.rows += next.rows;
  prev.dst_pitch = dp;
  prev.src_pitch = sp;
  return true;
}

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
                  std::vector<CopyDesc>& out, bool converts, const PeerMapping* peer_scales) {
  for (const Piece& pc : c.pieces) {
    if (pc.dst_region < 0 || static_cast<size_t>(pc.dst_region) >= peer_pool.size()) {
      return Status::Internal(
          fmt::format("piece for generation region {} of {}", pc.dst_region, peer_pool.size()));
    }
    const PeerMapping& m = *peer_pool[pc.dst_region];
    const uint64_t end =
        static_cast<uint64_t>(pc.dst_offset) + static_cast<uint64_t>(pc.dst_span());
    if (pc.dst_offset < 0 || end > m.size()) {
      return Status::InvalidArgument(fmt::format(
          "copy of {} planes of {} rows of {} bytes at offset {} (pitches {}/{}) is outside "
          "generation region {} ({} bytes mapped)",
          pc.planes, pc.rows, pc.bytes, pc.dst_offset, pc.dst_plane_pitch, pc.dst_pitch,
          pc.dst_region, m.size()));
    }
    CopyDesc d{};
    d.dst = m.data() + pc.dst_offset;
    d.src = pool.region(pc.src_region) + pc.src_offset;
    d.bytes = static_cast<size_t>(pc.bytes);
    d.rows = static_cast<size_t>(pc.rows);
    d.dst_pitch = static_cast<size_t>(pc.dst_pitch);
    d.src_pitch = static_cast<size_t>(pc.src_pitch);
    d.planes = static_cast<size_t>(pc.planes);
    d.dst_plane_pitch = static_cast<size_t>(pc.dst_plane_pitch);
    d.src_plane_pitch = static_cast<size_t>(pc.src_plane_pitch);
    d.src_scale = pc.src_scale;  // used when the copy converts (ConvertBatch)
    d.dst_scale = pc.dst_scale;
    if (pc.src_scale_at >= 0) d.src_scales = pool.block_scales() + pc.src_scale_at;
    if (pc.dst_scale_at >= 0) {
      if (peer_scales == nullptr ||
          static_cast<uint64_t>(pc.dst_scale_at + pc.planes) * 4 > peer_scales->size()) {
        return Status::InvalidArgument(fmt::format(
            "per-block scales {} to {} are outside the generation pool's ({} bytes mapped)",
            pc.dst_scale_at, pc.dst_scale_at + pc.planes, peer_scales ? peer_scales->size() : 0));
      }
      d.dst_scales = reinterpret_cast<float*>(peer_scales->data()) + pc.dst_scale_at;
    }
    // Only within one region at each end (a copy engine copies within one allocation); never
    // when converting (ExtendRows takes a row's bytes for both ends).
    if (!converts && !out.empty() && static_cast<std::byte*>(out.back().dst) >= m.data() &&
        static_cast<const std::byte*>(out.back().src) >= pool.region(pc.src_region) &&
        ExtendRows(out.back(), d))
      continue;
    out.push_back(d);
  }
  return Status::Ok();
}

StatusOr<uint32_t> CollectPeerBatch(const PairPlan& plan, size_t next, int32_t ready_end,
                                    bool one_chunk, std::span<PeerMapping* const> peer_pool,
                                    const BlockPool& pool, std::vector<CopyDesc>& out,
                                    int64_t max_bytes, bool converts,
                                    const PeerMapping* peer_scales) {
  out.clear();
  uint32_t count = 0;
  int64_t bytes = 0;
  for (size_t i = next;
       i < plan.chunks.size() && plan.chunks[i].last_layer < ready_end &&
       (count == 0 || (!one_chunk && bytes < max_bytes && count < kPeerBatchChunks));
       ++i) {
    KVF_RETURN_IF_ERROR(
        PeerCopies(plan.chunks[i], peer_pool, pool, out, converts, peer_scales)
            .WithContext(fmt::format("chunk {} to generation rank {}", i, plan.gen_rank)));
    bytes += plan.chunks[i].bytes;
    ++count;
  }
  return count;
}

StatusOr<bool> PeerSender::Launch(const PairPlan& plan, size_t& next, int32_t ready_end,
                                  const BlockPool& pool, Stream& stream, int64_t max_inflight,
                                  std::vector<CopyDesc>& scratch, EventPool& events,
                                  const Digester& digest, PeerLaunch* merged, uint64_t owner,
                                  std::optional<Conversion> conversion) {
  if (conversion) merged = nullptr;  // a merged launch copies as it is
  bool launched = false;
  while (static_cast<int64_t>(copying_.size()) < max_inflight &&
         (merged == nullptr || !merged->full())) {
    KVF_ASSIGN_OR_RETURN(uint32_t count, CollectPeerBatch(plan, next, ready_end, checksum_,
                                                          peer_pool_, pool, scratch, batch_bytes_,
                                                          conversion.has_value(), peer_scales_));
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
    int64_t bytes = 0;
    for (const CopyDesc& d : scratch)
      bytes += static_cast<int64_t>(d.bytes * std::max<size_t>(d.rows, 1) *
                                    std::max<size_t>(d.planes, 1));
    if (merged != nullptr) {  // copied by the caller's PeerLaunch::Flush
      b.ticket = merged->Add(owner, scratch, bytes);
      copying_.push_back(std::move(b));
      launched = true;
      continue;
    }
    auto done = SubmitCopies(stream, events, scratch, profile_, conversion);
    if (!done.ok()) {
      return done.status().WithContext(
          fmt::format("copying into generation rank {}'s pool", plan.gen_rank));
    }
    b.ticket = completions_.Add(std::move(*done), bytes);
    if (profile_) profile_->Count(ProfileCounter::kBatches);
    copying_.push_back(std::move(b));
    launched = true;
  }
  return launched;
}

uint64_t PeerLaunch::Add(uint64_t owner, std::span<const CopyDesc> copies, int64_t bytes) {
  if (parts_.empty() || parts_.back().owner != owner) parts_.push_back({owner, descs_.size()});
  descs_.insert(descs_.end(), copies.begin(), copies.end());
  parts_.back().end = descs_.size();
  parts_.back().bytes += bytes;
  bytes_ += bytes;
  return completions_.next_ticket();
}

std::vector<uint64_t> PeerLaunch::owners() const {
  std::vector<uint64_t> out;
  for (const Part& p : parts_) {
    if (std::find(out.begin(), out.end(), p.owner) == out.end()) out.push_back(p.owner);
  }
  return out;
}

Status PeerLaunch::Flush(Stream& stream, EventPool& events) {
  if (descs_.empty()) return Status::Ok();
  auto done = SubmitCopies(stream, events, descs_, profile_);
  const int64_t bytes = bytes_;
  Discard();
  if (!done.ok()) return done.status();
  completions_.Add(std::move(*done), bytes);
  if (profile_) profile_->Count(ProfileCounter::kBatches);
  return Status::Ok();
}

void PeerLaunch::Discard(uint64_t owner) {
  if (std::none_of(parts_.begin(), parts_.end(), [&](const Part& p) { return p.owner == owner; }))
    return;
  std::vector<CopyDesc> kept;
  std::vector<Part> parts;
  for (const Part& p : parts_) {
    if (p.owner == owner) {
      bytes_ -= p.bytes;
      continue;
    }
    parts.push_back({p.owner, kept.size(), 0, p.bytes});
    kept.insert(kept.end(), descs_.begin() + static_cast<ptrdiff_t>(p.begin),
                descs_.begin() + static_cast<ptrdiff_t>(p.end));
    parts.back().end = kept.size();
  }
  descs_ = std::move(kept);
  parts_ = std::move(parts);
}

void PeerLaunch::Discard() {
  descs_.clear();
  parts_.clear();
  bytes_ = 0;
}

void PeerSender::Reap(std::vector<Landed>& out) {
  out.clear();
  while (!copying_.empty() && completions_.Finished(copying_.front().ticket)) {
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

uint64_t PeerCompletions::Add(EventLease done, int64_t bytes) {
  const int64_t now = NowNs();
  Open o;
  o.done = std::move(done);
  o.meter = profile_ ? profile_->Launched(now) : 0;
  o.enqueued = now;
  o.bytes = std::max<int64_t>(bytes, 0);
  o.not_before = now + o.bytes / kPeerCopyBytesPerNs;
  open_.push_back(std::move(o));
  return finished_ + open_.size() - 1;
}

bool PeerCompletions::Poll() {
  if (open_.empty()) return false;
  int64_t now = NowNs();
  if (now < open_.front().not_before) return false;  // it cannot have finished yet
  ProfileScope timed(profile_, ProfilePhase::kEventQuery);
  const uint64_t before = finished_;
  while (!open_.empty()) {
    if (!open_.front().done->Query()) {
      seen_copying_ = now;
      break;
    }
    now = NowNs();
    if (profile_) profile_->Landed(open_.front().meter, now);
    open_.pop_front();  // the lease gives the event back
    ++finished_;
    if (open_.empty()) break;
    // The next one started after the last query that saw this one copying (and after it was
    // enqueued); it may have finished already (then it is queried now).
    Open& next = open_.front();
    next.not_before = std::max(next.enqueued, seen_copying_) + next.bytes / kPeerCopyBytesPerNs;
    seen_copying_ = 0;
    if (now < next.not_before) break;
  }
  return finished_ != before;
}

}  // namespace kvferry

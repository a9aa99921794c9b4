// What the tagged and one-sided send paths share: the chunks in flight as transport operations
// (and the packs into staging slots before them), and how a chunk that went is counted and
// reported.
#pragma once

#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "transceiver/paths/data_path.h"

namespace kvferry {

// A chunk the context rank sends: in flight from its start until the generation rank has it.
struct SendOp {
  size_t chunk = 0;
  uint32_t count = 1;                              // chunks [chunk, chunk + count)
  StagingLease slot;                               // staging slot; empty for a direct chunk
  EventLease packed;                               // pending pack into the slot
  std::unique_ptr<TransportOp> op;                 // pending send (tagged path)
  std::vector<std::unique_ptr<TransportOp>> puts;  // one-sided: rows and the packed slot
  std::unique_ptr<TransportOp> flush;              // one-sided: posted once every put is
  bool has_checksum = false;
  uint64_t checksum = 0;
  Clock::time_point started = Clock::now();  // metrics: the chunk's latency
};

class OpSendPath : public SendPath {
 public:
  explicit OpSendPath(int64_t max_inflight) : max_inflight_(max_inflight) {}
  size_t outstanding() const override { return inflight_.size(); }
  void Cancel(Transport& transport) override;
  // Their slots and events go back with them (a pending pack is ordered on the stream before any
  // later use of its slot).
  void Abandon() override { inflight_.clear(); }
  const LandedChunks* held_report() const override {
    return last_report_ ? &*last_report_ : nullptr;
  }
  void DropHeldReport() override { last_report_.reset(); }

 protected:
  // The next chunk may start: credited, within the in-flight bound, its layers ready.
  bool MayStart(const PathRequest& r, const PathPair& p) const {
    return !r.ending && next_ < p.plan.chunks.size() && next_ < credit_ &&
           static_cast<int64_t>(inflight_.size()) < max_inflight_ &&
           p.plan.chunks[next_].last_layer < r.ready_end;
  }
  // The checksum of a chunk's source bytes, when the pair asked for them; taken once the chunk
  // can go (not again on every retry while staging slots are short).
  // A pair that converts is summed from the packed chunk instead (SumPacked).
  static Status SumSource(PathHost& host, const PathPair& p, const Chunk& c, SendOp& s);
  // The checksum of a converting pair's chunk, from its staging slot once the pack completed:
  // the converted bytes, as the generation rank sums them in its pool (docs/conversion.md).
  static Status SumPacked(PathHost& host, const PathPair& p, SendOp& s);
  // A chunk is in place at the generation rank (tagged: its send completed; one-sided: flushed):
  // counted, and reported by CHUNK where the path or a checksum needs one. A one-sided pair
  // without checksums holds its last CHUNK instead (Folds): the side's Finish sends it saying the
  // request is complete, and neither DONE nor COMPLETE is exchanged (wire version 10), unless it
  // came packed and the request waits for others (wire version 11, ReportStagedChunks).
  void ChunkSent(PathHost& host, PathRequest& r, const PathPair& p, const SendOp& s);
  // The pair's last CHUNK says complete: one-sided (its chunks are in the generation rank's
  // memory once flushed; only unpacking staged rows is left, the generation rank's own work)
  // without checksums.
  bool Folds(const PathPair& p) const {
    return one_sided() && !p.checksum && !p.plan.chunks.empty();
  }

  const int64_t max_inflight_;
  size_t credit_ = 0;  // the receiver has posted chunks [0, credit_)
  std::deque<SendOp> inflight_;
  std::optional<LandedChunks> last_report_;  // the held last CHUNK (Folds)
};

}  // namespace kvferry

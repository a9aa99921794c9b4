// The peer-memory path (one host, transfer.peer_memory): the generation rank offers its pool
// regions as Device::ExportMemory handles in its FETCH; a context rank that maps them
// (PeerMappings::Map) copies every piece straight into the generation pool with its own stream
// (paths/peer_copies.h: batches, merged launches, one completion tracker). No transport puts, no
// staging, no credits: the generation rank posts nothing, and learns what landed from CHUNK
// messages (coalesced: one per run of batches that landed while nothing else copied). The pair's
// first CHUNK answers its FETCH (no ACCEPT); without checksums its last CHUNK, held until the
// request is complete on every rank, says so (neither DONE nor COMPLETE is exchanged).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "device/peer_memory.h"
#include "transceiver/engine/progress_profile.h"
#include "transceiver/paths/data_path.h"
#include "transceiver/paths/peer_copies.h"

namespace kvferry {

// A generation pool's regions mapped by a context rank (PeerMappings::Map): raw pointers for the
// copies, and the references that keep them mapped while the pair that uses them lives.
struct MappedPeerPool {
  std::vector<PeerMapping*> regions;
  PeerMapping* scales = nullptr;  // the generation pool's per-block scales, when offered
  std::vector<std::shared_ptr<PeerMapping>> holds;
};

// The peer-memory copies of every pair of a context side: the completion tracker of its stream
// and the launch the pairs' ready batches join (transfer.peer_merge_pairs). Progress thread only.
class PeerMemoryCopies {
 public:
  PeerMemoryCopies(ProgressProfile* profile, int64_t batch_bytes, int64_t hold_launches,
                   bool merge_pairs)
      : completions_(profile),
        launch_(completions_, batch_bytes, profile, hold_launches),
        merge_pairs_(merge_pairs) {}
  // Notes the batches that finished; true when any did.
  bool Poll() { return completions_.Poll(); }
  size_t copying() const { return completions_.copying(); }
  PeerCompletions& completions() { return completions_; }
  // The launch ready batches join (null: each pair launches its own).
  PeerLaunch* merged() { return merge_pairs_ ? &launch_ : nullptr; }
  bool launch_full() const { return launch_.full(); }
  // Drops the waiting batches of a request that ended (its senders abandoned them).
  void Discard(uint64_t request_id) { launch_.Discard(request_id); }
  // The waiting batches should go out now (PeerLaunch::due).
  template <class AwaitsPairs>
  bool due(AwaitsPairs awaits_pairs) const {
    return launch_.due(awaits_pairs);
  }
  // Copies the waiting batches; a failure fails the requests they belong to.
  void Flush(PathHost& host);
  // A pair launched copies since the last call (the side queues a wake-up behind them).
  void NoteLaunched() { launched_ = true; }
  bool TakeLaunched() { return std::exchange(launched_, false); }

 private:
  PeerCompletions completions_;  // every PeerSender's batches on the side's stream
  PeerLaunch launch_;
  const bool merge_pairs_;
  bool launched_ = false;
  std::vector<PeerSender::Landed> landed_;  // reused
  friend class PeerMemorySend;
};

class PeerMemorySend final : public SendPath {
 public:
  // `mapped`: the generation pool, mapped (the pair holds the mappings while it lives).
  PeerMemorySend(MappedPeerPool mapped, bool checksum, PeerMemoryCopies& copies,
                 ProgressProfile* profile, int64_t batch_bytes, int64_t max_inflight)
      : sender_(std::move(mapped.regions), checksum, copies.completions(), profile, batch_bytes,
                mapped.scales),
        holds_(std::move(mapped.holds)),
        copies_(copies),
        max_inflight_(max_inflight) {}
  DataPathKind kind() const override { return DataPathKind::kPeerMemory; }
  bool one_sided() const override { return true; }
  // Its first CHUNK answers the FETCH.
  void Open(PathHost& /*host*/, const PathRequest& /*r*/, const PathPair& /*p*/) override {}
  // Copies land in the destination blocks: no staging, no credit needed.
  Status Credit(const PathPair& /*p*/, const CreditMsg& /*c*/) override { return Status::Ok(); }
  bool Advance(PathHost& host, PathRequest& r, PathPair& p) override;
  size_t outstanding() const override { return sender_.copying(); }
  bool transport_pending() const override { return false; }
  void Abandon() override { sender_.Abandon(); }
  const LandedChunks* held_report() const override {
    return last_report_ ? &*last_report_ : nullptr;
  }
  void DropHeldReport() override { last_report_.reset(); }

 private:
  // Launches the pair's ready batches (into the merged launch where there is one).
  StatusOr<bool> Launch(PathHost& host, const PathRequest& r, const PathPair& p);
  // Counts the batches that landed and reports them by CHUNK.
  bool Report(PathHost& host, PathRequest& r, const PathPair& p);
  // Without checksums the pair's last CHUNK says complete.
  static bool Folds(const PathPair& p) { return !p.checksum && !p.plan.chunks.empty(); }

  PeerSender sender_;
  std::vector<std::shared_ptr<PeerMapping>> holds_;
  PeerMemoryCopies& copies_;
  const int64_t max_inflight_;
  // The pair's last CHUNK, held until the request is complete on every rank, so that it can say
  // so (Folds).
  std::optional<LandedChunks> last_report_;
};

class PeerMemoryRecv final : public RecvPath {
 public:
  using RecvPath::RecvPath;
  DataPathKind kind() const override { return DataPathKind::kPeerMemory; }
  bool one_sided() const override { return true; }
  bool folds(const PathPair& p) const override { return !p.checksum && !p.plan.chunks.empty(); }
  bool awaits_messages(const PathPair& /*p*/) const override { return true; }
  void Start(PathHost& host, PathRequest& r, const PathPair& p) override { Post(host, r, p); }
  bool Post(PathHost& host, PathRequest& r, const PathPair& p) override;
};

}  // namespace kvferry

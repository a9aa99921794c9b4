// The context (sending) side's implementation class, shared by its source files:
// context_side.cc (requests, FETCH and the control messages, ending) and context_side_send.cc (a
// pair's data path: tagged sends, one-sided puts, peer memory copies). Internal to the
// transceiver layer; everything here runs on the engine's progress thread unless a method says
// otherwise (the public ContextSide calls reach it through Engine::Call).
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "transceiver/context_side_peer.h"
#include "transceiver/engine.h"
#include "transceiver/leases.h"
#include "transceiver/pair_state.h"
#include "transceiver/pending_fetches.h"
#include "transceiver/rma.h"

namespace kvferry {

struct SendOp {
  size_t chunk = 0;
  uint32_t count = 1;                              // chunks [chunk, chunk + count) (peer memory)
  StagingLease slot;                               // staging slot; empty for a direct chunk
  EventLease packed;                               // pending pack into the slot
  std::unique_ptr<TransportOp> op;                 // pending send (tagged path)
  std::vector<std::unique_ptr<TransportOp>> puts;  // one-sided: rows and the packed slot
  std::unique_ptr<TransportOp> flush;              // one-sided: posted once every put is
  bool has_checksum = false;
  uint64_t checksum = 0;
  Clock::time_point started = Clock::now();  // metrics: the chunk's latency
};

struct SendPair {
  int32_t gen_rank = 0;
  PeerId peer = kAnyPeer;
  uint32_t transfer_id = 0;
  PairPlan plan;
  size_t next = 0;                      // next chunk to start
  size_t credit = 0;                    // the receiver has posted chunks [0, credit)
  PairState state{PairSide::kContext};  // accepted (sending), done (DONE received), closed
  bool rma = false;                     // one-sided puts into target (else tagged sends)
  // One-sided by copies into the mapped generation pool (context_side_peer.h); null otherwise.
  std::unique_ptr<PeerSender> mapped;
  // The mapped regions `mapped` copies into, kept mapped while the pair lives
  // (Engine::MapPeerPool).
  std::vector<std::shared_ptr<PeerMapping>> peer_holds;
  bool checksum = false;
  RmaTarget target;
  std::vector<uint32_t> slots;  // one-sided: the generation staging slot credited per chunk
  std::deque<SendOp> inflight;
  // One-sided without checksums (Foldable): the pair's last CHUNK, held until the request is
  // complete on every rank, so that it can say so (Finish).
  std::optional<LandedChunks> last_report;
  bool drained() const {
    return next == plan.chunks.size() && inflight.empty() && (!mapped || mapped->copying() == 0);
  }
};

struct CtxRequest {
  uint64_t id = 0;
  bool layer_wise = false;  // planned one layer per piece, so each layer moves once it is ready
  std::vector<int64_t> blocks;
  int64_t tokens = 0;
  AccessToken token{};
  int32_t ready_end = 0;  // global layers [0, ready_end) of this stage are ready
  std::vector<std::pair<int32_t, std::shared_ptr<Event>>> layer_events;
  Clock::time_point start;
  Deadline deadline;
  uint64_t gen_instance = 0;
  bool heard = false;  // a FETCH was accepted: gen_instance and expected are known
  // The generation ranks that FETCH from this rank (planner.h GenRanksFetching), ascending.
  std::vector<int32_t> expected;
  std::vector<PairPlan> plan;         // this rank's pairs, cached from the first FETCH
  bool planned = false;               // an empty plan (this rank sends nothing) is a plan too
  FetchMsg plan_key;                  // the FETCH the cached plan was made for (blocks, split)
  std::map<int32_t, SendPair> pairs;  // by generation rank
  int64_t bytes = 0;
  TransferState state = TransferState::kInit;
  Status reason;
  // The other context ranks of the DP group that said their part is done (SIBLING, code 0).
  std::set<int32_t> siblings_done;
  bool told_siblings = false;  // this rank's SIBLING "done" went out
  bool ending = false;         // a terminal state is decided; waiting for operations to finish
  Clock::time_point ended_at;
};

// Runs on the engine's progress thread except the public calls, which reach it through Call, and
// MarkReady, which claims its id and builds the handle on the caller's thread and posts the rest.
class ContextSideImpl final : public ContextSide, public Engine {
 public:
  using Engine::Engine;
  ~ContextSideImpl() override { Stop(); }

  std::string address() const override { return address_; }
  void InitAddress() { address_ = transport_->LocalAddress(); }

  Status SetInstanceAddresses(std::vector<std::string> addresses) override;

  StatusOr<std::vector<std::byte>> MarkReady(uint64_t id, std::span<const int64_t> blocks,
                                             int64_t tokens) override {
    return Begin(id, blocks, tokens, true);
  }
  StatusOr<std::vector<std::byte>> BeginLayerWise(uint64_t id, std::span<const int64_t> blocks,
                                                  int64_t tokens) override {
    return Begin(id, blocks, tokens, false);
  }

  Status MarkLayersReady(uint64_t id, int32_t local_layers) override;
  Status MarkLayerReadyOn(uint64_t id, int32_t local_layer, std::shared_ptr<Event> event) override;

  std::vector<TransferStatus> Poll(size_t at_least, Deadline deadline) override {
    return PollStatuses(at_least, deadline);
  }
  StatusOr<TransferStatus> Query(uint64_t id) const override { return QueryStatus(id); }
  TransceiverStats stats() const override { return Stats(); }
  TransceiverMetrics metrics() const override { return Metrics("context"); }
  std::vector<RequestTimeline> timelines() const override { return Timelines(); }

  Status Cancel(uint64_t id) override;

 protected:
  void OnControl(PeerId from, ControlMsg msg) override;
  bool Advance() override;
  void OnTick(Clock::time_point now) override;
  bool InFlight() const override {
    // A live request's next step (a FETCH, a peer's answer, a copy's end) is due soon: poll for
    // it (the loop naps again transfer.spin_us after the last progress).
    return !requests_.empty();
  }
  std::chrono::microseconds QuietNap() const override;
  bool QuietNapHearsPeers() const override { return false; }
  bool OnStop() override;

 private:
  // Requests, FETCH, credits and ending (context_side.cc).
  StatusOr<std::vector<std::byte>> Begin(uint64_t id, std::span<const int64_t> blocks,
                                         int64_t tokens, bool all_ready);
  // Begin's part on the progress thread: the request goes live and takes the FETCHes that came
  // before it.
  void Open(CtxRequest r);
  void OnFetch(PeerId from, FetchMsg f, std::vector<CreditMsg> credits);
  // Another context rank of the DP group is done with the request, or ended it.
  void OnSibling(const SiblingMsg& m);
  void ApplyCredit(CtxRequest& r, SendPair& p, const CreditMsg& c);
  void Reject(PeerId peer, const FetchMsg& f, const Status& why);
  // Counts a dropped unauthenticated message and logs the first and every 1000th (a flood
  // costs no log line each).
  void NoteUnauthenticated(std::string_view what);
  // Applies a protocol event to the pair (pair_state.h): true when the caller acts on it. An
  // event the protocol has no step for fails the request, naming the event and the phase.
  bool Step(CtxRequest& r, SendPair& p, PairEvent event);
  // A pair is done when its generation rank holds every chunk: DONE received, or (Foldable) every
  // copy landed; a pair with no chunks is done once its FETCH is taken.
  bool PairDone(const SendPair& p) const;
  int DoneCount(const CtxRequest& r) const;
  // Every expected generation rank fetched and every pair is done: this rank's part.
  bool LocalDone(const CtxRequest& r) const;
  // Sends SIBLING "done" to the other context ranks of the DP group once LocalDone.
  void TellSiblings(CtxRequest& r);
  // The other context rank `rank`'s connection (made on first use); an error ends the request.
  StatusOr<PeerId> SiblingPeer(int32_t rank, Deadline deadline);
  // A one-sided pair without checksums ends with its last CHUNK saying complete (wire version
  // 6, 8; 10 for transport puts as well as peer-memory copies): neither DONE nor COMPLETE is
  // exchanged for it. Its chunks are in the generation rank's memory once they landed (copies)
  // or were flushed (puts); only unpacking the staged rows is left, the generation rank's own
  // work.
  bool Foldable(const SendPair& p) const { return p.rma && !p.checksum && !p.plan.chunks.empty(); }
  bool Finished(CtxRequest& r);
  // Reports the terminal state; a complete request's pairs get their last CHUNK saying complete
  // (Foldable) or COMPLETE.
  void Finish(CtxRequest& r);
  void Fail(CtxRequest& r, const Status& why) { End(r, TransferState::kError, why, true); }
  // `tell_peers`: ABORT to the pairs and SIBLING to the other context ranks (not to them when
  // `tell_siblings` is false: a SIBLING ended it, and its sender told every rank).
  void End(CtxRequest& r, TransferState state, Status why, bool tell_peers,
           bool tell_siblings = true);
  CtxRequest* Find(uint64_t id);
  SendPair* FindPair(uint64_t id, PeerId from, uint32_t transfer_id);

  // A pair's data path (context_side_send.cc).
  bool AdvancePair(CtxRequest& r, SendPair& p);
  void ChunkSent(CtxRequest& r, SendPair& p, const SendOp& s);
  Status SumSource(const SendPair& p, const Chunk& c, SendOp& s);
  bool AdvancePeerPair(CtxRequest& r, SendPair& p);
  // Copies the waiting batches of peer_launch_; a failure ends the requests they belong to.
  void FlushPeerLaunch();
  // Request `id` still awaits the FETCH of another pair here (PeerLaunch::due).
  bool AwaitsPairs(uint64_t id) const;
  bool AdvanceRmaPair(CtxRequest& r, SendPair& p);

  std::string address_;
  // The ids a public call may start: MarkReady claims one on its caller's thread (no wait for the
  // progress thread); it stays taken while the request lives and for the next 4096 requests
  // after it ended (a replayed handle, a reused id).
  mutable Mutex ids_mu_;
  std::vector<std::string> addresses_ GUARDED_BY(ids_mu_);
  std::set<uint64_t> live_ids_ GUARDED_BY(ids_mu_);  // claimed, not yet released
  std::deque<uint64_t> recent_ GUARDED_BY(ids_mu_);  // released, newest last
  std::set<uint64_t> recent_set_ GUARDED_BY(ids_mu_);
  bool Released(uint64_t id) const {
    MutexLock lock(ids_mu_);
    return recent_set_.count(id) > 0;
  }
  void Release(uint64_t id);
  std::map<uint64_t, CtxRequest> requests_;  // progress thread
  PendingFetches pending_;                   // progress thread
  std::vector<CopyDesc> descs_;              // reused
  std::vector<PeerSender::Landed> landed_;   // reused
  PeerCompletions peer_copies_{profile()};   // every PeerSender's batches on stream_
  // The pairs' batches found ready, launched together (transfer.peer_merge_pairs, PeerLaunch).
  PeerLaunch peer_launch_{peer_copies_, options_.peer_batch_bytes, profile(),
                          options_.peer_hold_launches};
  bool peer_launched_ = false;   // this Advance pass launched peer-memory copies
  bool rma_said_ = false;        // logged once why a one-sided fetch is served tagged
  bool peer_said_ = false;       // logged once why offered peer memory is not used
  int64_t unauthenticated_ = 0;  // FETCHes dropped for a token that authenticates nothing
  // The other context ranks of this rank's DP group, ascending, and their connections.
  const std::vector<int32_t> siblings_ = SiblingRanks(pool_);
  static std::vector<int32_t> SiblingRanks(const BlockPool& pool);
  struct SiblingLink {
    PeerId peer = kAnyPeer;
    // Transports that detect crashed peers: a receive the sibling never matches, failed by the
    // transport when it loses the sibling (as a generation rank watches its context ranks): the
    // requests still waiting for that rank's SIBLING end at once rather than at their deadlines.
    std::unique_ptr<TransportOp> watch;
    std::byte watch_buf[1];
  };
  std::map<int32_t, SiblingLink> sibling_links_;
  // Ends the live requests that wait for a sibling whose watch failed, and forgets its link.
  void CheckSiblingWatches();
};

}  // namespace kvferry

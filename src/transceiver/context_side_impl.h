// The context (sending) side's implementation class, shared by its source files:
// context_side.cc (requests, the control messages, ending) and context_side_fetch.cc (a FETCH
// taken: checked, planned, its pair's data path chosen, paths/choose.h). Each pair moves its
// chunks through its SendPath (paths/). Internal to the transceiver layer; everything here runs on
// the engine's progress thread unless a method says otherwise (the public ContextSide calls reach
// it through the loop's Call).
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kvferry/transceiver.h"
#include "transceiver/engine/engine.h"
#include "transceiver/pair_state.h"
#include "transceiver/paths/choose.h"
#include "transceiver/paths/data_path.h"
#include "transceiver/paths/peer_memory.h"
#include "transceiver/pending_fetches.h"

namespace kvferry {

// One (request, generation rank) pair: rank, peer, transfer id, plan and phase (PathPair), and
// the path its chunks take.
struct SendPair : PathPair {
  SendPair() : PathPair(PairSide::kContext) {}  // accepted (sending), done, closed
  std::unique_ptr<SendPath> path;
  // Its last CHUNK went out not saying complete (ReportStagedChunks): every chunk is in place at
  // the generation rank, and the pair gets COMPLETE when the request completes.
  bool reported = false;
  bool drained() const { return path->drained(*this); }
};

// id, ready layers, bytes moved and ending are the PathRequest its pairs' paths see.
struct CtxRequest : PathRequest {
  bool layer_wise = false;  // planned one layer per piece, so each layer moves once it is ready
  std::vector<int64_t> blocks;
  int64_t tokens = 0;
  AccessToken token{};
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
  TransferState state = TransferState::kInit;
  Status reason;
  // The other context ranks of the DP group that said their part is done (SIBLING, code 0).
  std::set<int32_t> siblings_done;
  bool told_siblings = false;  // this rank's SIBLING "done" went out
};

// Runs on the engine's progress thread except the public calls, which reach it through the loop's
// Call, and MarkReady, which claims its id and builds the handle on the caller's thread and posts
// the rest.
class ContextSideImpl final : public SideSurface<ContextSide, ContextSideImpl>, EngineSide {
 public:
  static constexpr std::string_view kName = "context";
  ContextSideImpl(Device& device, const BlockPool& pool, EngineOptions options,
                  std::unique_ptr<Transport> transport)
      : engine_(device, pool, options, std::move(transport), *this) {}
  ~ContextSideImpl() override { engine_.Stop(); }

  Status Start() { return engine_.Start(); }

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

  Status Cancel(uint64_t id) override;

  // The parts (tests read them).
  Engine& engine() { return engine_; }

 private:
  friend class SideSurface<ContextSide, ContextSideImpl>;

  // EngineSide: the progress loop's steps (context_side.cc).
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

  // Requests, FETCH, credits and ending (context_side.cc).
  StatusOr<std::vector<std::byte>> Begin(uint64_t id, std::span<const int64_t> blocks,
                                         int64_t tokens, bool all_ready);
  // Begin's part on the progress thread: the request goes live and takes the FETCHes that came
  // before it.
  void Open(CtxRequest r);
  // A FETCH (context_side_fetch.cc): authenticated, checked, planned, its pair accepted on the
  // path chosen for it, or refused.
  void OnFetch(PeerId from, FetchMsg f, std::vector<CreditMsg> credits);
  // The token authenticates the FETCH's handle (else it is dropped unanswered).
  bool Authenticated(const FetchMsg& f);
  // A FETCH for a request this rank does not know (yet): kept while it may still come, or refused.
  void HoldUnknown(PeerId peer, FetchMsg f, std::vector<CreditMsg> credits);
  // Why request `r` can't take FETCH `f` (its fields against the request's), or OK.
  Status CheckFetch(const CtxRequest& r, const FetchMsg& f) const;
  // Whether the pair FETCH `f` asks for converts dtypes (the generation instance's differs).
  bool Converts(const FetchMsg& f) const;
  // Plans the request's pairs with the FETCH's inputs (cached while they stay the same), and
  // checks that its generation rank has something to fetch here.
  Status Plan(CtxRequest& r, const FetchMsg& f);
  // Takes the pair on `path`: it goes live, answers the FETCH and applies credits that came first.
  void AcceptPair(CtxRequest& r, PeerId peer, const FetchMsg& f, std::unique_ptr<SendPath> path,
                  const std::vector<CreditMsg>& credits);
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
  // A pair is done when its generation rank holds every chunk: DONE received, or (one-sided
  // without checksums) every copy or put landed; a pair with no chunks is done once its FETCH is
  // taken.
  bool PairDone(const SendPair& p) const;
  int DoneCount(const CtxRequest& r) const;
  // Every expected generation rank fetched and every pair is done: this rank's part.
  bool LocalDone(const CtxRequest& r) const;
  // Sends SIBLING "done" to the other context ranks of the DP group once LocalDone.
  void TellSiblings(CtxRequest& r);
  // The other context rank `rank`'s connection (made on first use); an error ends the request.
  StatusOr<PeerId> SiblingPeer(int32_t rank, Deadline deadline);
  bool Finished(CtxRequest& r);
  // A held last CHUNK whose packed rows sit in a generation staging slot goes out now, not saying
  // complete, while the request waits for other pairs or context ranks (wire version 11): held,
  // it kept that slot from the generation rank's other pairs, which could be the very pairs the
  // request waits for (vLLM prefill TP2 -> decode TP1: every slot held by rank 0, rank 1 never
  // credited, every request at its deadline).
  void ReportStagedChunks(CtxRequest& r);
  // Reports the terminal state; a complete request's pairs get their last CHUNK saying complete
  // (one-sided without checksums, not reported yet) or COMPLETE.
  void Finish(CtxRequest& r);
  // EngineSide: a pair's path failed the request (r is one of this side's CtxRequests).
  void Fail(PathRequest& r, Status why) override {
    End(static_cast<CtxRequest&>(r), TransferState::kError, std::move(why), true);
  }
  void FailById(uint64_t id, const Status& why) override {
    if (CtxRequest* r = Find(id); r != nullptr && !r->ending) Fail(*r, why);
  }
  // `tell_peers`: ABORT to the pairs and SIBLING to the other context ranks (not to them when
  // `tell_siblings` is false: a SIBLING ended it, and its sender told every rank).
  void End(CtxRequest& r, TransferState state, Status why, bool tell_peers,
           bool tell_siblings = true);
  CtxRequest* Find(uint64_t id);
  SendPair* FindPair(uint64_t id, PeerId from, uint32_t transfer_id);

  // Request `id` still awaits the FETCH of another pair here (PeerLaunch::due).
  bool AwaitsPairs(uint64_t id) const;

  Engine engine_;  // first: it goes last, after Stop ended every request
  const EngineOptions& options_ = engine_.options();
  const BlockPool& pool_ = engine_.pool();
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
  // The peer-memory pairs' copies: one completion tracker, the batches found ready launched
  // together (transfer.peer_merge_pairs, PeerLaunch).
  PeerMemoryCopies peer_copies_{engine_.profile(), options_.peer_batch_bytes,
                                options_.peer_hold_launches, options_.peer_merge_pairs};
  // Chooses each pair's data path once (paths/choose.h).
  SendPathChooser chooser_{
      engine_.local_paths(),
      SendSettings{options_.max_inflight, options_.peer_batch_bytes, options_.peer_memory},
      peer_copies_, engine_.profile(), [this](const std::vector<std::vector<std::byte>>& handles) {
        return engine_.peer_mappings().Map(handles);
      }};
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

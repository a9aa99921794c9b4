// The generation (receiving) side: a handle and destination blocks in; FETCH to the context ranks
// that send this rank something (planner.h CtxRanksToFetch); receives posted (and credited) within
// the staging bound; packed chunks unpacked into the pool; DONE to each context rank once its
// chunks are in place (none where its last CHUNK says complete). Each pair's chunks move through
// its RecvPath (paths/), chosen by what the FETCH offered and then by the context rank's answer
// (paths/choose.h).
#include <fmt/format.h>

#include <algorithm>
#include <deque>

#include "base/log.h"
#include "transceiver/engine/engine.h"
#include "transceiver/pair_state.h"
#include "transceiver/paths/choose.h"
#include "transceiver/paths/data_path.h"

namespace kvferry {
namespace {

// The chunk number of the watch receive of a one-sided pair (never a data chunk's tag: plans of
// a pair stay far below 2^20 - 1 chunks).
constexpr uint64_t kWatchChunk = (uint64_t{1} << kChunkTagBits) - 1;

// One (request, context rank) pair: rank, peer, transfer id, plan and phase (PathPair), the path
// its chunks take, and the watch of its context rank.
//   phases: fetched, accepted (ACCEPT received), done (DONE sent), completed (COMPLETE received:
//   every generation rank is done), closed (rejected, aborted or lost by the context rank)
struct RecvPair : PathPair {
  RecvPair() : PathPair(PairSide::kGeneration) {}
  std::unique_ptr<RecvPath> path;
  // One-sided: a receive the context rank never matches, posted so that its death fails an op
  // here (no data op of ours names it).
  std::unique_ptr<TransportOp> watch;
  std::byte watch_buf[1]{};
};

// id, bytes moved and ending are the PathRequest its pairs' paths see.
struct GenRequest : PathRequest {
  Clock::time_point start;
  Deadline deadline;
  std::deque<RecvPair> pairs;  // deque: elements never move
  TransferState state = TransferState::kInit;
  Status reason;
  RecvSettings path_settings;  // what its pairs' paths are made with (paths/choose.h)
};

class GenerationSideImpl final : public SideSurface<GenerationSide, GenerationSideImpl>,
                                 EngineSide {
 public:
  static constexpr std::string_view kName = "generation";
  GenerationSideImpl(Device& device, const BlockPool& pool, EngineOptions options,
                     std::unique_ptr<Transport> transport)
      : engine_(device, pool, options, std::move(transport), *this) {}
  ~GenerationSideImpl() override { engine_.Stop(); }

  Status Start() { return engine_.Start(); }

  Status Fetch(std::span<const std::byte> handle_bytes, std::span<const int64_t> blocks,
               int64_t reused_blocks) override {
    KVF_ASSIGN_OR_RETURN(ContextHandle h, DecodeHandle(handle_bytes));
    // What this rank plans with, as the context ranks will check it (FETCH).
    const HandleDigest digest = HandleDigestOf(handle_bytes);
    PlanInput in;
    in.ctx = static_cast<const InstanceDesc&>(h);
    in.gen = engine_.SelfDesc();
    in.prompt_tokens = h.prompt_tokens;
    in.ctx_blocks = h.blocks;
    in.gen_blocks.assign(blocks.begin(), blocks.end());
    in.gen_reused_blocks = reused_blocks;
    // Chunking both sides agree on: packed chunks fit both sides' staging slots; direct chunks
    // only when both can move bytes straight from and into their pools.
    in.chunk_bytes = std::min(options_.chunk_bytes, h.chunk_bytes);
    // A conversion (dtypes or scales) sends no chunk pool to pool: the context side converts on
    // the way.
    const bool converts = Converts(in.ctx, in.gen);
    in.direct_min_bytes =
        h.ctx_direct && engine_.direct_ok() && !converts ? options_.direct_min_bytes : kNoDirect;
    in.layer_wise = h.layer_wise;
    in.max_plan_bytes = engine_.plan_budget();
    in.max_chunks = engine_.plan_chunk_cap();
    // Incompatible shapes, too few blocks and bad ids are the caller's errors: report them now.
    KVF_ASSIGN_OR_RETURN(std::vector<PairPlan> plan, PlanForGenRank(in, pool_.slice().rank));
    KVF_ASSIGN_OR_RETURN(std::vector<int32_t> ctx_ranks, CtxRanksToFetch(in, pool_.slice().rank));
    // The rest runs on the progress thread, and this call does not wait for it (a blocking call
    // cost a wake-up of the caller per request); what fails there (a context rank unreachable)
    // ends the request through Poll.
    KVF_RETURN_IF_ERROR(
        engine_.statuses().Reserve(h.request_id, "is already being fetched on this rank"));
    engine_.loop().Post([this, h = std::move(h), in = std::move(in), plan = std::move(plan),
                         ctx_ranks = std::move(ctx_ranks), reused_blocks, digest,
                         start = Clock::now()] {
      StartFetch(h, digest, in, plan, ctx_ranks, reused_blocks, start);
    });
    return Status::Ok();
  }

  // Fetch's part on the progress thread: the request's pairs, a FETCH to each of `ctx_ranks`.
  void StartFetch(const ContextHandle& h, const HandleDigest& digest, const PlanInput& in,
                  const std::vector<PairPlan>& plan, const std::vector<int32_t>& ctx_ranks,
                  int64_t reused_blocks, Clock::time_point start) {
    GenRequest r;
    r.id = h.request_id;
    r.start = start;
    r.deadline = r.start + options_.timeout;
    FetchMsg f;
    f.request_id = h.request_id;
    f.token = h.token;
    f.handle_digest = digest;
    f.gen_instance = options_.instance_id;
    f.gen_rank = pool_.slice().rank;
    static_cast<InstanceDesc&>(f) = in.gen;
    f.prompt_tokens = h.prompt_tokens;
    f.reused_blocks = reused_blocks;
    f.chunk_bytes = in.chunk_bytes;
    f.direct_min_bytes = in.direct_min_bytes;
    f.blocks = in.gen_blocks;
    f.reply_address = engine_.address();
    f.checksum = options_.checksum;
    const bool converts = Converts(in.ctx, in.gen);
    DescribeOffer(engine_.local_paths(), options_.chunk_bytes,
                  static_cast<uint32_t>(options_.staging_chunks), RowMin(h.ctx_direct && !converts),
                  f);
    const PathOffer offer = OfferOf(engine_.local_paths());
    r.path_settings = Settings(f);
    // Only the context ranks with something to send us hear from us (wire version 8), and, from
    // the group's first rank, those with nothing to send anyone (planner.h CtxRanksToFetch): the
    // context ranks learn from each other when every pair is done.
    for (int32_t c : ctx_ranks) {
      RecvPair p;
      p.rank = c;
      p.transfer_id = NextTransferId();
      p.path = RecvPathForOffer(offer, r.path_settings);
      engine_.NotePathUsed(p.path->kind());
      p.checksum = f.checksum;
      for (const PairPlan& pp : plan) {
        if (pp.ctx_rank == c) p.plan = pp;
      }
      auto peer = [&] {
        ProfileScope timed(engine_.profile(), ProfilePhase::kConnect);
        return engine_.transport().Connect(h.addresses[c], r.deadline);
      }();
      if (peer.ok()) {
        if (auto refused = engine_.PeerRefusal(*peer)) peer = *refused;
      }
      if (!peer.ok()) {
        Status why =
            peer.status().WithContext(fmt::format("request {}: context rank {}", h.request_id, c));
        // The context ranks already asked would hold the request's blocks leased until their
        // deadline: tell them it is off.
        for (const RecvPair& sent : r.pairs) {
          engine_.SendMsg(sent.peer,
                          AbortMsg{r.id, sent.transfer_id, static_cast<uint8_t>(why.code()),
                                   std::string(why.message())});
        }
        engine_.statuses().Set(
            TransferStatus{r.id, TransferState::kError, std::move(why), 0,
                           std::chrono::duration<double>(Clock::now() - start).count()});
        return;
      }
      p.peer = *peer;
      f.transfer_id = p.transfer_id;
      engine_.SendMsg(p.peer, f);
      r.pairs.push_back(std::move(p));
    }
    r.state = TransferState::kInProgress;
    engine_.statuses().Set(TransferStatus{r.id, r.state, Status::Ok(), 0, 0});
    requests_.emplace(r.id, std::move(r));
  }

  Status Cancel(uint64_t id) override {
    return engine_.loop().Call([&]() -> Status {
      auto it = requests_.find(id);
      if (it == requests_.end())
        return Status::NotFound(fmt::format("request {} is not live on this generation rank", id));
      End(it->second, TransferState::kCancelled,
          Status::Cancelled("cancelled by the generation side"), true);
      return Status::Ok();
    });
  }

 private:
  friend class SideSurface<GenerationSide, GenerationSideImpl>;

  // EngineSide: the progress loop's steps.
  void OnControl(PeerId from, ControlMsg msg) override {
    if (auto* a = std::get_if<AcceptMsg>(&msg)) {
      if (auto [r, p] = FindPair(from, a->request_id, a->transfer_id);
          p && Step(*r, *p, PairEvent::kAccept))
        OnAccept(*r, *p, *a);
    } else if (auto* k = std::get_if<ChunkMsg>(&msg)) {
      if (auto [r, p] = FindPair(from, k->request_id, k->transfer_id); p) OnChunk(*r, *p, *k);
    } else if (auto* c = std::get_if<CompleteMsg>(&msg)) {
      if (auto [r, p] = FindPair(from, c->request_id, c->transfer_id); p) OnComplete(*r, *p);
    } else if (auto* j = std::get_if<RejectMsg>(&msg)) {
      if (auto [r, p] = FindPair(from, j->request_id, j->transfer_id);
          p && Step(*r, *p, PairEvent::kReject)) {
        End(*r, TransferState::kError,
            PeerStatus(j->code, fmt::format("context rank {} refused: {}", p->rank, j->reason)),
            true);
      }
    } else if (auto* b = std::get_if<AbortMsg>(&msg)) {
      if (auto [r, p] = FindPair(from, b->request_id, b->transfer_id);
          p && Step(*r, *p, PairEvent::kAbort)) {
        End(*r, TransferState::kError,
            PeerStatus(b->code, fmt::format("context rank {} aborted: {}", p->rank, b->reason)),
            true);
      }
    }
  }

  // A context rank whose wire versions do not meet ours: every request it is part of fails now,
  // naming it, rather than at its deadline.
  void OnPeerRefused(PeerId peer, const Status& why) override {
    for (auto& [id, r] : requests_) {
      for (RecvPair& p : r.pairs) {
        if (p.peer != peer || p.state.final()) continue;
        End(r, TransferState::kError,
            why.WithContext(fmt::format("request {}: context rank {}", r.id, p.rank)), true);
        break;
      }
    }
  }

  // The pair (request `id`, transfer `tid`) of peer `from`, or nulls: a pair hears only from its
  // own context rank, so another peer can't accept, complete or end someone else's transfer
  // (transfer ids are small numbers, easily guessed).
  std::pair<GenRequest*, RecvPair*> FindPair(PeerId from, uint64_t id, uint32_t tid) {
    auto it = requests_.find(id);
    if (it == requests_.end()) return {nullptr, nullptr};
    for (RecvPair& p : it->second.pairs) {
      if (p.transfer_id == tid && p.peer == from) return {&it->second, &p};
    }
    return {nullptr, nullptr};
  }

  // A CHUNK saying complete ends the pair (the context rank stopped copying), also when this
  // request is ending already. In phase fetched any CHUNK also stands for ACCEPT with peer memory
  // (wire version 7).
  void OnChunk(GenRequest& r, RecvPair& p, const ChunkMsg& k) {
    const PairEvent e = k.complete ? PairEvent::kChunkComplete : PairEvent::kChunk;
    const bool accepts = p.state.Is(PairPhase::kFetched);
    if (Status st = p.path->CheckComplete(r, p, k); !st.ok()) {
      End(r, TransferState::kError, st, true);
    } else if (Step(r, p, e)) {
      if (accepts) OnAccept(r, p, AcceptMsg{k.request_id, k.transfer_id, true, true});
      p.path->OnChunk(engine_, r, p, k);
    }
  }

  // COMPLETE answers every pair's DONE, ours included: one before it is an error (a pair with no
  // chunks sends none, and takes COMPLETE as its only answer). A pair that folds says no DONE:
  // COMPLETE follows its last CHUNK when that came on its own (wire version 11).
  // A pair of version 10 has no such step: COMPLETE there fails the request, as it did.
  void OnComplete(GenRequest& r, RecvPair& p) {
    if (p.state.Is(PairPhase::kAccepted) && p.path->folds(p) && engine_.PairVersion(p.peer) >= 11) {
      if (p.path->reported_all(p)) {
        Step(r, p, PairEvent::kCompleteAfterChunks);
        return;
      }
      End(r, TransferState::kError,
          Status::InvalidArgument(fmt::format(
              "request {}: context rank {} said COMPLETE before its last CHUNK", r.id, p.rank)),
          true);
    } else if (p.state.Is(PairPhase::kFetched) && !p.plan.chunks.empty()) {
      End(r, TransferState::kError,
          Status::InvalidArgument(
              fmt::format("request {}: context rank {} said COMPLETE before any of its {} chunks",
                          r.id, p.rank, p.plan.chunks.size())),
          true);
    } else {
      Step(r, p, PairEvent::kComplete);
    }
  }

  bool Advance() override {
    bool busy = false;
    for (auto it = requests_.begin(); it != requests_.end();) {
      GenRequest& r = it->second;
      bool local_done = true, all_done = true, drained = true;
      for (RecvPair& p : r.pairs) {
        busy |= AdvancePair(r, p);
        // (A closed pair ended the request: local_done counts only while it is not ending.) A
        // pair with no chunks is not answered by ACCEPT: it is done from the start.
        const bool in_place = (!p.state.Is(PairPhase::kFetched) || p.plan.chunks.empty()) &&
                              p.path->completed() == p.plan.chunks.size();
        local_done &= in_place;
        // Every chunk of the pair is in place: DONE, unless its last CHUNK says complete (peer
        // memory without checksums) or it has none (COMPLETE answers it alone).
        if (!r.ending && in_place && p.state.Is(PairPhase::kAccepted) && !p.path->folds(p) &&
            Step(r, p, PairEvent::kDoneSent)) {
          engine_.SendMsg(p.peer, DoneMsg{r.id, p.transfer_id, p.plan.bytes});
          busy = true;
        }
        all_done &= p.state.Is(PairPhase::kCompleted);
        // The watch stays until nothing of ours waits for this context rank to stop putting.
        if (p.watch && !p.watch->Done() &&
            (p.state.Is(PairPhase::kCompleted) || (r.ending && p.path->idle())))
          engine_.transport().Cancel(*p.watch);
        drained &= p.path->idle() && (!p.watch || p.watch->Done());
      }
      if ((r.ending && drained) || (!r.ending && all_done && local_done)) {
        double secs = std::chrono::duration<double>(Clock::now() - r.start).count();
        if (!r.ending) r.state = TransferState::kComplete;
        engine_.statuses().Set(TransferStatus{r.id, r.state, r.reason, r.bytes, secs});
        it = requests_.erase(it);
        busy = true;
      } else {
        ++it;
      }
    }
    return busy;
  }

  void OnTick(Clock::time_point now) override {
    for (auto& [id, r] : requests_) {
      if (r.ending || now < r.deadline) continue;
      int done = 0, silent = -1;
      bool unanswered = false;
      for (const RecvPair& p : r.pairs) {
        if (p.state.Is(PairPhase::kCompleted)) {
          ++done;
        } else if (silent < 0) {
          silent = p.rank;
          unanswered = p.state.Is(PairPhase::kFetched);
        }
      }
      End(r, TransferState::kTimedOut,
          Status::DeadlineExceeded(fmt::format(
              "request {}: not received within {} ms ({} of {} context ranks done; context rank "
              "{} still owes data or an answer{})",
              id, options_.timeout.count(), done, r.pairs.size(), silent,
              unanswered ? "; no answer to the FETCH: a context rank leaves unanswered a "
                           "FETCH whose token does not authenticate its handle (forged, altered, "
                           "or another instance's)"
                         : "")),
          true);
    }
  }

  bool InFlight() const override {
    // A live request's next step (a FETCH, a peer's answer, a copy's end) is due soon: poll for
    // it (the loop naps again transfer.spin_us after the last progress).
    return !requests_.empty();
  }

  // CPU device: every live pair waits for a message (CHUNK, ACCEPT or COMPLETE) with no operation
  // of ours in flight: nothing to drive, only a message to notice, late by at most the nap, or
  // not at all where it wakes this thread (QuietNapHearsPeers). (On a GPU the copies take no core:
  // poll as before.)
  std::chrono::microseconds QuietNap() const override {
    if (requests_.empty() || !engine_.cpu_device()) return {};
    // With one request live a message ends the nap at once: then pairs whose context rank puts
    // wait asleep too (its puts need nothing from us where the transport writes our memory
    // itself, and wake us where it emulates them by messages). A 128-token request by UCX puts on
    // the 2-core machine otherwise noticed its CHUNK up to a 50 us poll (about 100 us with the
    // default timer slack; more under load) late. Tagged pairs that said DONE poll for COMPLETE
    // as before: sleeping there measured slower (bench transfer, tagged, 128 tokens, p50 1.16 ms
    // against 0.94 ms at load 20; 1.7 against 1.2 with two busy threads).
    const bool alone = requests_.size() == 1;
    for (const auto& [id, r] : requests_) {
      if (r.ending) return {};
      for (const RecvPair& p : r.pairs) {
        if (p.state.final()) continue;
        // A FETCH that offered peer memory is answered by its first CHUNK after the copies, and
        // a pair with no chunks waits only for COMPLETE: waiting for a message too.
        const bool waits =
            p.path->awaits_messages(p) || p.plan.chunks.empty() || (alone && p.path->one_sided());
        if (!waits || p.path->work_pending()) return {};
      }
    }
    return options_.peer_wait_nap;
  }

  // One request live: its CHUNK or COMPLETE wakes this thread at once (its latency). Several:
  // the naps take their messages together, and the context ranks send without waking it
  // (TP2->TP4, 4k tokens: 1.9 ms of control CPU per request instead of 2.4).
  bool QuietNapHearsPeers() const override { return requests_.size() <= 1; }

  bool OnStop() override {
    for (auto& [id, r] : requests_) {
      if (!r.ending)
        End(r, TransferState::kCancelled, Status::Cancelled("generation side shutting down"), true);
    }
    Advance();
    return requests_.empty();
  }

 private:
  uint32_t NextTransferId() {
    const int bits = std::min(32, engine_.transport().caps().tag_bits - kChunkTagBits);
    const uint64_t mask = bits >= 32 ? 0xFFFFFFFFull : ((1ull << bits) - 1);
    next_transfer_ = static_cast<uint32_t>((next_transfer_ + 1) & mask);
    return next_transfer_;
  }

  int64_t RowMin(bool ctx_direct) const {
    return ctx_direct ? options_.rma_row_min_bytes : kNoDirect;
  }

  // What the pairs of FETCH `f` need to make and change their paths.
  RecvSettings Settings(const FetchMsg& f) const {
    return RecvSettings{options_.max_inflight, options_.abort_grace, f.rma_target.row_min_bytes};
  }

  // EngineSide: a pair's path failed the request (r is one of this side's GenRequests).
  void Fail(PathRequest& r, Status why) override {
    End(static_cast<GenRequest&>(r), TransferState::kError, std::move(why), true);
  }
  void FailById(uint64_t id, const Status& why) override {
    auto it = requests_.find(id);
    if (it != requests_.end() && !it->second.ending) Fail(it->second, why);
  }

  // The pair's path posts and lands; a context rank that writes into this rank's memory is
  // watched, since no operation of ours would notice its death.
  bool AdvancePair(GenRequest& r, RecvPair& p) {
    bool busy = p.path->Post(engine_, r, p);
    if (p.path->one_sided() && !p.watch && !r.ending && !p.state.final()) {
      auto op = engine_.transport().Recv(p.peer, DataTag(p.transfer_id, kWatchChunk), p.watch_buf,
                                         sizeof(p.watch_buf), MemoryKind::kHost);
      if (op.ok()) p.watch = std::move(op).value();
    }
    if (p.watch && p.watch->Done() && !p.watch->status().ok() &&
        p.watch->status().code() != StatusCode::kCancelled &&
        Step(r, p, PairEvent::kPeerLost)) {  // closed: it can no longer put
      End(r, TransferState::kError,
          Status::Unavailable(fmt::format("context rank {} is unreachable ({})", p.rank,
                                          p.watch->status().message())),
          true);
      busy = true;
    }
    return p.path->Land(engine_, r, p) || busy;
  }

  // The context rank answered (ACCEPT, or a first CHUNK standing for ACCEPT with peer memory):
  // the pair's path changes where the answer says so (paths/choose.h RecvPathForAnswer).
  void OnAccept(GenRequest& r, RecvPair& p, const AcceptMsg& a) {
    auto next = RecvPathForAnswer(*p.path, a, r.path_settings, p.rank);
    if (!next.ok()) return End(r, TransferState::kError, next.status(), true);
    if (!*next) return;
    p.path = std::move(next).value();  // the old path's slots go back: nothing was put
    engine_.NotePathUsed(p.path->kind());
    p.path->Start(engine_, r, p);  // CHUNK messages may follow in the same drain
  }

  // Applies a protocol event to the pair (pair_state.h): true when the caller acts on it. An
  // event the protocol has no step for fails the request, naming the event and the phase.
  bool Step(GenRequest& r, RecvPair& p, PairEvent event) {
    auto step = p.state.On(event);
    if (!step.ok()) {
      End(r, TransferState::kError,
          step.status().WithContext(fmt::format("request {}: context rank {}", r.id, p.rank)),
          true);
      return false;
    }
    return *step == PairStep::kMove || *step == PairStep::kWithin;
  }

  void End(GenRequest& r, TransferState state, Status why, bool tell_peers) {
    if (r.ending) return;
    r.ending = true;
    r.ended_at = Clock::now();
    r.state = state;
    r.reason = std::move(why);
    for (RecvPair& p : r.pairs) {
      p.path->Cancel(engine_.transport());
      if (tell_peers && !p.state.final()) {
        engine_.SendMsg(p.peer, AbortMsg{r.id, p.transfer_id, static_cast<uint8_t>(r.reason.code()),
                                         std::string(r.reason.message())});
      }
    }
  }

  Engine engine_;  // first: it goes last, after Stop ended every request
  const EngineOptions& options_ = engine_.options();
  const BlockPool& pool_ = engine_.pool();
  std::map<uint64_t, GenRequest> requests_;  // progress thread
  uint32_t next_transfer_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<GenerationSide>> GenerationSide::Create(
    Device& device, const BlockPool& pool, const TransceiverOptions& options) {
  KVF_ASSIGN_OR_RETURN(auto transport, MakeTransport(options, device));
  return Create(device, pool, options, std::move(transport));
}

StatusOr<std::unique_ptr<GenerationSide>> GenerationSide::Create(
    Device& device, const BlockPool& pool, const TransceiverOptions& options,
    std::unique_ptr<Transport> transport) {
  if (!transport) return Status::InvalidArgument("GenerationSide: null transport");
  KVF_RETURN_IF_ERROR(CheckSideScales("GenerationSide", options.kv_scales, pool));
  auto side = std::make_unique<GenerationSideImpl>(device, pool, ResolveOptions(options, device),
                                                   std::move(transport));
  KVF_RETURN_IF_ERROR(side->Start());
  return std::unique_ptr<GenerationSide>(std::move(side));
}

}  // namespace kvferry

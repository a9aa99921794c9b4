// The context (sending) side: requests marked ready, fetches from generation ranks, chunks packed
// and sent as credit and layer readiness allow, leases held until every peer said DONE.
#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <set>

#include "base/log.h"
#include "transceiver/context_side_peer.h"
#include "transceiver/engine.h"
#include "transceiver/pending_fetches.h"
#include "transceiver/rma.h"

namespace kvferry {
namespace {

struct SendOp {
  size_t chunk = 0;
  uint32_t count = 1;                              // chunks [chunk, chunk + count) (peer memory)
  int slot = -1;                                   // staging slot, -1 for a direct chunk
  Event* packed = nullptr;                         // pending pack into the slot
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
  size_t next = 0;          // next chunk to start
  size_t credit = 0;        // the receiver has posted chunks [0, credit)
  bool done = false;        // DONE received
  bool peer_ended = false;  // ABORT received: the peer needs no ABORT back
  bool rma = false;         // one-sided puts into target (else tagged sends)
  // One-sided by copies into the mapped generation pool (context_side_peer.h); null otherwise.
  std::unique_ptr<PeerSender> mapped;
  bool checksum = false;
  RmaTarget target;
  std::vector<uint32_t> slots;  // one-sided: the generation staging slot credited per chunk
  std::deque<SendOp> inflight;
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
  int expected_gen = -1;              // generation ranks that will FETCH (known at the first FETCH)
  std::vector<PairPlan> plan;         // this rank's pairs, cached from the first FETCH
  bool planned = false;               // an empty plan (this rank sends nothing) is a plan too
  FetchMsg plan_key;                  // the FETCH the cached plan was made for (blocks, split)
  std::map<int32_t, SendPair> pairs;  // by generation rank
  int64_t bytes = 0;
  TransferState state = TransferState::kInit;
  Status reason;
  bool ending = false;  // a terminal state is decided; waiting for operations to finish
  Clock::time_point ended_at;
};

bool SamePlanInputs(const FetchMsg& a, const FetchMsg& b) {
  return a.shape == b.shape && a.parallel.tp == b.parallel.tp && a.parallel.pp == b.parallel.pp &&
         a.parallel.stage_layers == b.parallel.stage_layers &&
         a.parallel.dp_size == b.parallel.dp_size && a.parallel.dp_rank == b.parallel.dp_rank &&
         a.layout == b.layout && a.pool_blocks == b.pool_blocks &&
         a.reused_blocks == b.reused_blocks && a.blocks == b.blocks &&
         a.chunk_bytes == b.chunk_bytes && a.direct_min_bytes == b.direct_min_bytes;
}

class ContextSideImpl final : public ContextSide, public Engine, private EventLender {
 public:
  using Engine::Engine;
  ~ContextSideImpl() override { Stop(); }

  std::string address() const override { return address_; }
  void InitAddress() { address_ = transport_->LocalAddress(); }

  Status SetInstanceAddresses(std::vector<std::string> addresses) override {
    if (static_cast<int32_t>(addresses.size()) != pool_.spec().parallel.world_size()) {
      return Status::InvalidArgument(fmt::format("{} addresses for an instance of {} ranks",
                                                 addresses.size(),
                                                 pool_.spec().parallel.world_size()));
    }
    return Call([&] {
      addresses_ = std::move(addresses);
      return Status::Ok();
    });
  }

  StatusOr<std::vector<std::byte>> MarkReady(uint64_t id, std::span<const int64_t> blocks,
                                             int64_t tokens) override {
    return Begin(id, blocks, tokens, true);
  }
  StatusOr<std::vector<std::byte>> BeginLayerWise(uint64_t id, std::span<const int64_t> blocks,
                                                  int64_t tokens) override {
    return Begin(id, blocks, tokens, false);
  }

  Status MarkLayersReady(uint64_t id, int32_t local_layers) override {
    return Call([&]() -> Status {
      CtxRequest* r = Find(id);
      if (!r)
        return Status::NotFound(fmt::format("request {} is not live on this context rank", id));
      if (local_layers < 0 || local_layers > pool_.slice().layer_count) {
        return Status::InvalidArgument(fmt::format("local_layers={} is outside [0, {}]",
                                                   local_layers, pool_.slice().layer_count));
      }
      r->ready_end = std::max(r->ready_end, pool_.slice().layer_begin + local_layers);
      return Status::Ok();
    });
  }

  Status MarkLayerReadyOn(uint64_t id, int32_t local_layer, std::shared_ptr<Event> event) override {
    if (!event) return Status::InvalidArgument("MarkLayerReadyOn: null event");
    return Call([&]() -> Status {
      CtxRequest* r = Find(id);
      if (!r)
        return Status::NotFound(fmt::format("request {} is not live on this context rank", id));
      if (local_layer < 0 || local_layer >= pool_.slice().layer_count) {
        return Status::InvalidArgument(fmt::format("local_layer={} is outside [0, {})", local_layer,
                                                   pool_.slice().layer_count));
      }
      r->layer_events.emplace_back(pool_.slice().layer_begin + local_layer + 1, std::move(event));
      return Status::Ok();
    });
  }

  std::vector<TransferStatus> Poll(size_t at_least, Deadline deadline) override {
    return PollStatuses(at_least, deadline);
  }
  StatusOr<TransferStatus> Query(uint64_t id) const override { return QueryStatus(id); }
  TransceiverStats stats() const override { return Stats(); }
  TransceiverMetrics metrics() const override { return Metrics("context"); }
  std::vector<RequestTimeline> timelines() const override { return Timelines(); }

  Status Cancel(uint64_t id) override {
    return Call([&]() -> Status {
      CtxRequest* r = Find(id);
      if (!r)
        return Status::NotFound(fmt::format("request {} is not live on this context rank", id));
      End(*r, TransferState::kCancelled, Status::Cancelled("cancelled by the context side"), true);
      return Status::Ok();
    });
  }

 protected:
  void OnControl(PeerId from, ControlMsg msg) override {
    if (auto* f = std::get_if<FetchMsg>(&msg)) return OnFetch(from, std::move(*f), {});
    if (auto* c = std::get_if<CreditMsg>(&msg)) {
      if (SendPair* p = FindPair(c->request_id, from, c->transfer_id)) {
        ApplyCredit(requests_.at(c->request_id), *p, *c);
      } else {
        pending_.AddCredit(from, *c);
      }
      return;
    }
    if (auto* d = std::get_if<DoneMsg>(&msg)) {
      if (SendPair* p = FindPair(d->request_id, from, d->transfer_id)) p->done = true;
      return;
    }
    if (auto* a = std::get_if<AbortMsg>(&msg)) {
      pending_.Drop(from, a->request_id, a->transfer_id);
      if (SendPair* p = FindPair(a->request_id, from, a->transfer_id)) {
        CtxRequest& r = requests_.at(a->request_id);
        p->done = true;  // it will not send DONE
        p->peer_ended = true;
        // The other generation ranks can't complete without this one: tell them now rather
        // than leave them to their deadlines.
        End(r, TransferState::kError,
            PeerStatus(a->code,
                       fmt::format("generation rank {} aborted: {}", p->gen_rank, a->reason)),
            true);
      }
      return;
    }
    Log(LogLevel::kWarn, "context side: unexpected control message from peer {}", from);
  }

  bool Advance() override {
    bool busy = false;
    for (auto it = requests_.begin(); it != requests_.end();) {
      CtxRequest& r = it->second;
      for (auto& [layer_end, ev] : r.layer_events) {
        if (ev && ev->Query()) {
          r.ready_end = std::max(r.ready_end, layer_end);
          ev.reset();
        }
      }
      std::erase_if(r.layer_events, [](const auto& e) { return !e.second; });
      for (auto& [g, p] : r.pairs) busy |= AdvancePair(r, p);
      if (Finished(r)) {
        Finish(r);
        recent_.push_back(r.id);
        recent_set_.insert(r.id);
        if (recent_.size() > 4096) {
          recent_set_.erase(recent_.front());
          recent_.pop_front();
        }
        it = requests_.erase(it);
        busy = true;
      } else {
        ++it;
      }
    }
    return busy;
  }

  void OnTick(Clock::time_point now) override {
    for (const PendingFetch& pf : pending_.Expired(now)) {
      Reject(pf.from, pf.fetch,
             Status::NotFound(fmt::format(
                 "request {} is unknown to context rank {} (never marked ready, or its handle is "
                 "forged)",
                 pf.fetch.request_id, pool_.slice().rank)));
    }
    for (auto& [id, r] : requests_) {
      if (!r.ending && now >= r.deadline) {
        End(r, TransferState::kTimedOut,
            Status::DeadlineExceeded(fmt::format(
                "request {}: not delivered within {} ms ({} of {} generation ranks done)", id,
                options_.timeout.count(), DoneCount(r), r.expected_gen)),
            true);
      }
    }
  }

  bool InFlight() const override {
    // A live request's next step (a FETCH, a peer's answer, a copy's end) is due soon: poll for
    // it (the loop naps again transfer.spin_us after the last progress).
    return !requests_.empty();
  }

  bool OnStop() override {
    for (auto& [id, r] : requests_) {
      if (!r.ending)
        End(r, TransferState::kCancelled, Status::Cancelled("context side shutting down"), true);
    }
    Advance();
    return requests_.empty();
  }

 private:
  StatusOr<std::vector<std::byte>> Begin(uint64_t id, std::span<const int64_t> blocks,
                                         int64_t tokens, bool all_ready) {
    const KvShape& shape = pool_.shape();
    if (tokens < 1)
      return Status::InvalidArgument(fmt::format("prompt_tokens={} must be positive", tokens));
    const int64_t needed =
        tokens / shape.tokens_per_block + (tokens % shape.tokens_per_block != 0 ? 1 : 0);
    if (static_cast<int64_t>(blocks.size()) < needed) {
      return Status::InvalidArgument(fmt::format("{} tokens need {} blocks of {} tokens; {} given",
                                                 tokens, needed, shape.tokens_per_block,
                                                 blocks.size()));
    }
    for (int64_t b : blocks) {
      if (b < 0 || b >= pool_.blocks()) {
        return Status::InvalidArgument(
            fmt::format("block id {} is outside the pool's [0, {})", b, pool_.blocks()));
      }
    }
    return Call([&]() -> StatusOr<std::vector<std::byte>> {
      if (addresses_.empty())
        return Status::InvalidArgument("SetInstanceAddresses must be called before MarkReady");
      if (requests_.count(id) || recent_set_.count(id)) {
        return Status::InvalidArgument(
            fmt::format("request {} was already marked ready on this rank", id));
      }
      CtxRequest r;
      r.id = id;
      r.blocks.assign(blocks.begin(), blocks.begin() + needed);
      r.tokens = tokens;
      r.token = MakeAccessToken(options_.secret, id, r.blocks, tokens);
      r.ready_end = all_ready ? pool_.shape().layers : 0;
      r.layer_wise = !all_ready;
      r.start = Clock::now();
      r.deadline = r.start + options_.timeout;
      ContextHandle h;
      h.request_id = id;
      h.token = r.token;
      h.shape = pool_.shape();
      h.parallel = SelfDesc().parallel;
      h.layout = pool_.spec().layout;
      h.pool_blocks = pool_.blocks();
      h.prompt_tokens = tokens;
      h.layer_wise = !all_ready;
      h.ctx_direct = direct_ok();
      h.chunk_bytes = options_.chunk_bytes;
      h.blocks = r.blocks;
      h.addresses = addresses_;
      requests_.emplace(id, std::move(r));
      SetStatus(TransferStatus{id, TransferState::kInit, Status::Ok(), 0, 0});
      // Fetches that arrived before this rank knew the request.
      for (PendingFetch& pf : pending_.Take(id))
        OnFetch(pf.from, std::move(pf.fetch), std::move(pf.credits));
      return EncodeHandle(h);
    });
  }

  void OnFetch(PeerId from, FetchMsg f, std::vector<CreditMsg> credits) {
    const PeerId peer = from;  // the transport connects back to a control sender by itself
    CtxRequest* r = Find(f.request_id);
    if (!r) {
      if (recent_set_.count(f.request_id)) {
        return Reject(
            peer, f,
            Status::InvalidArgument(fmt::format(
                "request {} was already delivered and released (replayed handle)", f.request_id)));
      }
      if (pending_.full()) {
        return Reject(peer, f,
                      Status::Unavailable(fmt::format(
                          "request {} is unknown to context rank {} and {} fetches for unknown "
                          "requests are already waiting (the limit)",
                          f.request_id, pool_.slice().rank, PendingFetches::kMaxFetches)));
      }
      pending_.Add(PendingFetch{peer, std::move(f), std::move(credits),
                                Clock::now() + options_.unknown_request_wait});
      return;
    }
    if (r->ending)
      return Reject(
          peer, f,
          Status::Cancelled(fmt::format("request {} is ending: {}", r->id, r->reason.ToString())));
    if (f.token != r->token) {
      return Reject(
          peer, f,
          Status::InvalidArgument(fmt::format(
              "request {}: the access token does not match (forged or altered handle)", r->id)));
    }
    if (r->expected_gen >= 0 && f.gen_instance != r->gen_instance) {
      return Reject(
          peer, f,
          Status::InvalidArgument(fmt::format("request {} is already being fetched by another "
                                              "generation instance (replayed handle)",
                                              r->id)));
    }
    if (r->pairs.count(f.gen_rank)) {
      return Reject(peer, f,
                    Status::InvalidArgument(fmt::format(
                        "request {}: generation rank {} already fetched it (replayed handle)",
                        r->id, f.gen_rank)));
    }
    if (f.chunk_bytes < 1 || f.chunk_bytes > options_.chunk_bytes ||
        (!direct_ok() && f.direct_min_bytes != kNoDirect)) {
      return Reject(
          peer, f,
          Status::InvalidArgument(fmt::format(
              "request {}: fetch asks for chunks of {} bytes (direct from {}); this context "
              "rank stages at most {} and {} send from its pool",
              r->id, f.chunk_bytes, f.direct_min_bytes, options_.chunk_bytes,
              direct_ok() ? "can" : "can't")));
    }
    if (f.prompt_tokens != r->tokens) {
      return Reject(peer, f,
                    Status::InvalidArgument(
                        fmt::format("request {}: fetch asks for {} tokens, the context holds {}",
                                    r->id, f.prompt_tokens, r->tokens)));
    }
    const bool rma = f.rma && rma_ok();
    if (rma) {
      if (Status st = CheckRmaTarget(f); !st.ok()) return Reject(peer, f, st);
    } else if (f.rma && !rma_said_) {
      rma_said_ = true;
      Log(LogLevel::kInfo, "context side: tagged data path, not one-sided: {}", rma_why());
    }
    std::vector<PeerMapping*> peer_pool;
    if (rma && options_.peer_memory != EngineOptions::PeerMemory::kOff &&
        !f.rma_target.peer_pool.empty()) {
      auto mapped = MapPeerPool(f.rma_target.peer_pool);
      Status st = mapped.ok() ? CheckPeerPool(*mapped, f.rma_target) : mapped.status();
      if (st.ok()) {
        peer_pool = std::move(mapped).value();
      } else if (!peer_said_) {
        peer_said_ = true;
        Log(LogLevel::kInfo, "context side: transport puts, not peer memory copies: {}",
            st.ToString());
      }
    }
    if (!r->planned || !SamePlanInputs(r->plan_key, f)) {
      PlanInput in;
      in.ctx = SelfDesc();
      in.gen = InstanceDesc{f.shape, f.parallel, f.layout, f.pool_blocks};
      in.prompt_tokens = r->tokens;
      in.ctx_blocks = r->blocks;
      in.gen_blocks = f.blocks;
      in.gen_reused_blocks = f.reused_blocks;
      in.chunk_bytes = f.chunk_bytes;
      in.direct_min_bytes = f.direct_min_bytes;
      in.layer_wise = r->layer_wise;
      in.max_plan_bytes = plan_budget();
      in.max_chunks = plan_chunk_cap();
      auto plan = PlanForCtxRank(in, pool_.slice().rank);
      if (!plan.ok()) return Reject(peer, f, plan.status());
      r->plan = std::move(plan).value();
      r->plan_key = f;
      r->planned = true;
    }
    if (r->expected_gen < 0) {
      r->gen_instance = f.gen_instance;
      r->expected_gen = (f.parallel.tp / f.parallel.dp_size) * f.parallel.pp;
    }
    SendPair p;
    p.gen_rank = f.gen_rank;
    p.peer = peer;
    p.transfer_id = f.transfer_id;
    p.rma = rma;
    if (!peer_pool.empty()) NotePeerMemoryUsed();
    p.checksum = f.checksum;
    if (!peer_pool.empty())
      p.mapped = std::make_unique<PeerSender>(std::move(peer_pool), p.checksum);
    if (rma) p.target = std::move(f.rma_target);
    for (const PairPlan& pp : r->plan) {
      if (pp.gen_rank == f.gen_rank) p.plan = pp;
    }
    r->state = TransferState::kInProgress;
    SetStatus(TransferStatus{r->id, r->state, Status::Ok(), r->bytes, 0});
    SendMsg(peer, AcceptMsg{r->id, f.transfer_id, rma, p.mapped != nullptr});
    SendPair& added = r->pairs.emplace(f.gen_rank, std::move(p)).first->second;
    for (const CreditMsg& c : credits) ApplyCredit(*r, added, c);
  }

  // Tagged credits count posted receives; one-sided ones name the staging slot of each newly
  // credited chunk. A pair takes only the kind of its path (the generation rank credits
  // one-sided before it knows this rank's answer, and again tagged after ACCEPT says tagged).
  void ApplyCredit(CtxRequest& r, SendPair& p, const CreditMsg& c) {
    if (p.mapped) return;  // copies land in the destination blocks: no staging, no credit needed
    if (!p.rma) {
      if (c.slots.empty()) p.credit = std::max<size_t>(p.credit, c.chunks);
      return;
    }
    if (c.slots.empty()) return;
    if (c.chunks != p.slots.size() + c.slots.size() || c.chunks > p.plan.chunks.size()) {
      return Fail(r,
                  Status::InvalidArgument(fmt::format(
                      "generation rank {} credited chunks up to {} with {} slots after {} of "
                      "{} chunks",
                      p.gen_rank, c.chunks, c.slots.size(), p.slots.size(), p.plan.chunks.size())));
    }
    p.slots.insert(p.slots.end(), c.slots.begin(), c.slots.end());
    p.credit = p.slots.size();
  }

  void Reject(PeerId peer, const FetchMsg& f, const Status& why) {
    Log(LogLevel::kInfo, "context side: refused fetch of request {} from generation rank {}: {}",
        f.request_id, f.gen_rank, why.ToString());
    SendMsg(peer, RejectMsg{f.request_id, f.transfer_id, static_cast<uint8_t>(why.code()),
                            std::string(why.message())});
  }

  bool AdvancePair(CtxRequest& r, SendPair& p) {
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
      if (p.checksum) {
        auto sum = ChunkDigest(c, true);
        if (!sum.ok()) return Fail(r, sum.status()), true;
        s.has_checksum = true;
        s.checksum = *sum;
      }
      if (c.direct && direct_ok()) {
        const Piece& pc = c.pieces.front();
        auto op =
            transport_->Send(p.peer, DataTag(p.transfer_id, p.next),
                             PoolAddress(pc.src_region, pc.src_offset), c.bytes, pool_wire_kind());
        if (!op.ok()) return Fail(r, op.status()), true;
        s.op = std::move(op).value();
      } else {
        s.slot = AcquireSlot();
        if (s.slot < 0) break;
        ChunkCopies(c, true, pool_, SlotData(s.slot), true, descs_);
        Status st = stream_->CopyBatch(descs_);
        s.packed = AcquireEvent();
        if (st.ok())
          st = s.packed ? stream_->Record(*s.packed) : Status::Internal("no device event");
        if (!st.ok()) {
          ReleaseSlot(s.slot);
          if (s.packed) ReleaseEvent(s.packed);
          return Fail(r, st.WithContext("packing a chunk")), true;
        }
      }
      p.inflight.push_back(std::move(s));
      ++p.next;
      busy = true;
    }
    for (auto it = p.inflight.begin(); it != p.inflight.end();) {
      if (it->packed && it->packed->Query()) {
        ReleaseEvent(it->packed);
        it->packed = nullptr;
        if (r.ending) {
          ReleaseSlot(it->slot);
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
        if (it->slot >= 0) ReleaseSlot(it->slot);
        it = p.inflight.erase(it);
        busy = true;
        continue;
      }
      if (!it->op && !it->packed) {  // send could not be posted
        if (it->slot >= 0) ReleaseSlot(it->slot);
        it = p.inflight.erase(it);
        continue;
      }
      ++it;
    }
    return busy;
  }

  // A chunk is in place at the generation rank (tagged: its send completed; one-sided: flushed).
  void ChunkSent(CtxRequest& r, SendPair& p, const SendOp& s) {
    for (uint32_t i = 0; i < s.count; ++i) {
      r.bytes += p.plan.chunks[s.chunk + i].bytes;
      NoteChunk(r.id, p.plan.chunks[s.chunk + i].bytes, s.started);
    }
    if (p.rma || s.has_checksum) {
      SendMsg(p.peer, ChunkMsg{r.id, p.transfer_id, static_cast<uint32_t>(s.chunk), s.count,
                               s.has_checksum, s.checksum});
    }
  }

  // Peer memory (context_side_peer.h): the pair's PeerSender copies ready chunks straight into
  // the mapped generation pool; landed chunks count here, and go out by CHUNK (checksummed ones
  // each on their own, the rest as one range once nothing is copying).
  bool AdvancePeerPair(CtxRequest& r, SendPair& p) {
    bool busy = false;
    if (!r.ending) {
      auto launched = p.mapped->Launch(p.plan, p.next, r.ready_end, pool_, *stream_,
                                       options_.max_inflight, descs_, *this);
      if (!launched.ok()) return Fail(r, launched.status()), true;
      busy = *launched;
    }
    p.mapped->Reap(*this, landed_);
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
      SendMsg(p.peer, ChunkMsg{r.id, p.transfer_id, static_cast<uint32_t>(report->first),
                               report->count, false, 0});
    }
    return busy;
  }
  Event* Lend() override { return AcquireEvent(); }
  void Return(Event* event) override { ReleaseEvent(event); }
  StatusOr<uint64_t> Digest(const Chunk& chunk) override { return ChunkDigest(chunk, true); }

  // One-sided: rows put pool to pool, the packed rest put into the credited staging slot, one
  // flush, then CHUNK.
  bool AdvanceRmaPair(CtxRequest& r, SendPair& p) {
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
        if (s.slot < 0) break;
        ChunkCopies(c, true, pool_, SlotData(s.slot), true, descs_, t.row_min_bytes);
        Status st = stream_->CopyBatch(descs_);
        s.packed = AcquireEvent();
        if (st.ok())
          st = s.packed ? stream_->Record(*s.packed) : Status::Internal("no device event");
        if (!st.ok()) {
          ReleaseSlot(s.slot);
          if (s.packed) ReleaseEvent(s.packed);
          return Fail(r, st.WithContext("packing a chunk")), true;
        }
      }
      if (p.checksum) {
        auto sum = ChunkDigest(c, true);
        if (!sum.ok()) {
          if (s.slot >= 0) ReleaseSlot(s.slot);
          if (s.packed) ReleaseEvent(s.packed);
          return Fail(r, sum.status()), true;
        }
        s.has_checksum = true;
        s.checksum = *sum;
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
        ReleaseEvent(s.packed);
        s.packed = nullptr;
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
      if (s.slot >= 0) ReleaseSlot(s.slot);
      it = p.inflight.erase(it);
      busy = true;
    }
    return busy;
  }

  int DoneCount(const CtxRequest& r) const {
    int n = 0;
    for (const auto& [g, p] : r.pairs) n += p.done && p.drained();
    return n;
  }

  bool Finished(CtxRequest& r) {
    if (r.ending) {
      size_t stuck = 0;
      for (const auto& [g, p] : r.pairs)
        stuck += p.inflight.size() + (p.mapped ? p.mapped->copying() : 0);
      if (stuck == 0) return true;
      // UCX and MPI can't take back a send a dead peer never matches. Sends only read the
      // blocks, so after a grace period the request ends anyway; the abandoned operations are
      // dropped (the transport completes them when it lets go of them).
      if (Clock::now() < r.ended_at + options_.abort_grace) return false;
      Log(LogLevel::kWarn,
          "context side: request {} ends with {} sends still held by the transport", r.id, stuck);
      for (auto& [g, p] : r.pairs) {
        for (SendOp& op : p.inflight) {
          // A pending pack is ordered on the stream before any later use of its slot.
          if (op.slot >= 0) ReleaseSlot(op.slot);
          if (op.packed) ReleaseEvent(op.packed);
        }
        p.inflight.clear();
        if (p.mapped) p.mapped->Abandon(*this);
      }
      return true;
    }
    return r.expected_gen >= 0 && static_cast<int>(r.pairs.size()) == r.expected_gen &&
           DoneCount(r) == r.expected_gen;
  }

  void Finish(CtxRequest& r) {
    double secs = std::chrono::duration<double>(Clock::now() - r.start).count();
    if (!r.ending) {
      r.state = TransferState::kComplete;
      r.reason = Status::Ok();
      for (auto& [g, p] : r.pairs) SendMsg(p.peer, CompleteMsg{r.id, p.transfer_id});
    } else {
      // One-sided pairs: no more puts from here; the generation rank may reuse its slots.
      for (auto& [g, p] : r.pairs) {
        if (p.rma) {
          SendMsg(p.peer, AbortMsg{r.id, p.transfer_id, static_cast<uint8_t>(r.reason.code()),
                                   "context rank stopped: " + std::string(r.reason.message())});
        }
      }
    }
    SetStatus(TransferStatus{r.id, r.state, r.reason, r.bytes, secs});
  }

  void Fail(CtxRequest& r, const Status& why) { End(r, TransferState::kError, why, true); }

  // Decides the terminal state; operations still in flight are cancelled and drained before the
  // request is reported (its blocks stay leased until then).
  void End(CtxRequest& r, TransferState state, Status why, bool tell_peers) {
    if (r.ending) return;
    r.ending = true;
    r.ended_at = Clock::now();
    r.state = state;
    r.reason = std::move(why);
    for (auto& [g, p] : r.pairs) {
      for (SendOp& s : p.inflight) {
        if (s.op && !s.op->Done()) transport_->Cancel(*s.op);
      }
      // Generation ranks that said DONE wait for COMPLETE, which will not come: they are told too.
      if (tell_peers && !p.peer_ended) {
        SendMsg(p.peer, AbortMsg{r.id, p.transfer_id, static_cast<uint8_t>(r.reason.code()),
                                 std::string(r.reason.message())});
      }
    }
  }

  CtxRequest* Find(uint64_t id) {
    auto it = requests_.find(id);
    return it == requests_.end() ? nullptr : &it->second;
  }

  // Transfer ids are chosen by each generation rank: unique only together with the sender.
  SendPair* FindPair(uint64_t id, PeerId from, uint32_t transfer_id) {
    CtxRequest* r = Find(id);
    if (!r) return nullptr;
    for (auto& [g, p] : r->pairs) {
      if (p.peer == from && p.transfer_id == transfer_id) return &p;
    }
    return nullptr;
  }

  std::string address_;
  std::vector<std::string> addresses_;       // progress thread
  std::map<uint64_t, CtxRequest> requests_;  // progress thread
  PendingFetches pending_;                   // progress thread
  std::deque<uint64_t> recent_;              // recently finished ids, for replay detection
  std::set<uint64_t> recent_set_;
  std::vector<CopyDesc> descs_;             // reused
  std::vector<PeerSender::Landed> landed_;  // reused
  bool rma_said_ = false;                   // logged once why a one-sided fetch is served tagged
  bool peer_said_ = false;                  // logged once why offered peer memory is not used
};

}  // namespace

StatusOr<std::unique_ptr<ContextSide>> ContextSide::Create(Device& device, const BlockPool& pool,
                                                           const TransceiverOptions& options) {
  KVF_ASSIGN_OR_RETURN(auto transport, MakeTransport(options, device));
  return Create(device, pool, options, std::move(transport));
}

StatusOr<std::unique_ptr<ContextSide>> ContextSide::Create(Device& device, const BlockPool& pool,
                                                           const TransceiverOptions& options,
                                                           std::unique_ptr<Transport> transport) {
  if (!transport) return Status::InvalidArgument("ContextSide: null transport");
  if (pool.spec().layout == LayoutKind::kCustom) {
    return Status::InvalidArgument(fmt::format(
        "ContextSide: pool layout {} is custom: a transfer needs a named layout every rank derives "
        "from its dims (PoolLayout presets)",
        pool.layout().ToString()));
  }
  auto side = std::make_unique<ContextSideImpl>(device, pool, ResolveOptions(options),
                                                std::move(transport));
  side->InitAddress();
  KVF_RETURN_IF_ERROR(side->Start());
  return std::unique_ptr<ContextSide>(std::move(side));
}

}  // namespace kvferry

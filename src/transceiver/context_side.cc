// The context (sending) side: requests marked ready, fetches from generation ranks, chunks moved by
// each pair's data path (paths/) as credit and layer readiness allow, leases held until every pair
// of the request, on every context rank of the DP group, is done (SIBLING). The class is declared
// in context_side_impl.h; taking a FETCH is in context_side_fetch.cc.
#include <fmt/format.h>

#include <algorithm>

#include "base/log.h"
#include "transceiver/context_side_impl.h"

namespace kvferry {
namespace {

// The chunk number of the receive that watches another context rank (a tag no rank sends).
constexpr uint64_t kSiblingWatchChunk = (uint64_t{1} << kChunkTagBits) - 1;

}  // namespace

std::vector<int32_t> ContextSideImpl::SiblingRanks(const BlockPool& pool) {
  std::vector<int32_t> out;
  const ParallelConfig& par = pool.spec().parallel;
  for (int32_t r = 0; r < par.world_size(); ++r) {
    auto s = SliceOf(pool.shape(), par, r);
    if (s.ok() && s->dp_group == pool.slice().dp_group && r != pool.slice().rank) out.push_back(r);
  }
  return out;
}

Status ContextSideImpl::SetInstanceAddresses(std::vector<std::string> addresses) {
  if (static_cast<int32_t>(addresses.size()) != pool_.spec().parallel.world_size()) {
    return Status::InvalidArgument(fmt::format("{} addresses for an instance of {} ranks",
                                               addresses.size(),
                                               pool_.spec().parallel.world_size()));
  }
  MutexLock lock(ids_mu_);
  addresses_ = std::move(addresses);
  return Status::Ok();
}

void ContextSideImpl::Release(uint64_t id) {
  MutexLock lock(ids_mu_);
  live_ids_.erase(id);
  recent_.push_back(id);
  recent_set_.insert(id);
  if (recent_.size() > 4096) {
    recent_set_.erase(recent_.front());
    recent_.pop_front();
  }
}

Status ContextSideImpl::MarkLayersReady(uint64_t id, int32_t local_layers) {
  return engine_.loop().Call([&]() -> Status {
    CtxRequest* r = Find(id);
    if (!r) return Status::NotFound(fmt::format("request {} is not live on this context rank", id));
    if (local_layers < 0 || local_layers > pool_.slice().layer_count) {
      return Status::InvalidArgument(fmt::format("local_layers={} is outside [0, {}]", local_layers,
                                                 pool_.slice().layer_count));
    }
    r->ready_end = std::max(r->ready_end, pool_.slice().layer_begin + local_layers);
    return Status::Ok();
  });
}

Status ContextSideImpl::MarkLayerReadyOn(uint64_t id, int32_t local_layer,
                                         std::shared_ptr<Event> event) {
  if (!event) return Status::InvalidArgument("MarkLayerReadyOn: null event");
  return engine_.loop().Call([&]() -> Status {
    CtxRequest* r = Find(id);
    if (!r) return Status::NotFound(fmt::format("request {} is not live on this context rank", id));
    if (local_layer < 0 || local_layer >= pool_.slice().layer_count) {
      return Status::InvalidArgument(
          fmt::format("local_layer={} is outside [0, {})", local_layer, pool_.slice().layer_count));
    }
    r->layer_events.emplace_back(pool_.slice().layer_begin + local_layer + 1, std::move(event));
    return Status::Ok();
  });
}

Status ContextSideImpl::Cancel(uint64_t id) {
  return engine_.loop().Call([&]() -> Status {
    CtxRequest* r = Find(id);
    if (!r) return Status::NotFound(fmt::format("request {} is not live on this context rank", id));
    End(*r, TransferState::kCancelled, Status::Cancelled("cancelled by the context side"), true);
    return Status::Ok();
  });
}

void ContextSideImpl::OnControl(PeerId from, ControlMsg msg) {
  if (auto* f = std::get_if<FetchMsg>(&msg)) return OnFetch(from, std::move(*f), {});
  if (auto* c = std::get_if<CreditMsg>(&msg)) {
    if (SendPair* p = FindPair(c->request_id, from, c->transfer_id)) {
      CtxRequest& r = requests_.at(c->request_id);
      if (Step(r, *p, PairEvent::kCredit)) ApplyCredit(r, *p, *c);
    } else {
      pending_.AddCredit(from, *c);
    }
    return;
  }
  if (auto* d = std::get_if<DoneMsg>(&msg)) {
    // A DONE follows the pair's answer: one for no live pair is late (the request ended) or stray.
    if (SendPair* p = FindPair(d->request_id, from, d->transfer_id))
      Step(requests_.at(d->request_id), *p, PairEvent::kDone);
    return;
  }
  if (auto* b = std::get_if<SiblingMsg>(&msg)) return OnSibling(*b);
  if (auto* a = std::get_if<AbortMsg>(&msg)) {
    pending_.Drop(from, a->request_id, a->transfer_id);
    if (SendPair* p = FindPair(a->request_id, from, a->transfer_id)) {
      CtxRequest& r = requests_.at(a->request_id);
      if (!Step(r, *p, PairEvent::kAbort)) return;  // a repeated ABORT
      // The other generation ranks can't complete without this one: tell them now rather
      // than leave them to their deadlines.
      End(r, TransferState::kError,
          PeerStatus(a->code, fmt::format("generation rank {} aborted: {}", p->rank, a->reason)),
          true);
    }
    return;
  }
  Log(LogLevel::kWarn, "context side: unexpected control message from peer {}", from);
}

bool ContextSideImpl::Advance() {
  bool busy = peer_copies_.Poll();
  for (auto it = requests_.begin(); it != requests_.end();) {
    CtxRequest& r = it->second;
    for (auto& [layer_end, ev] : r.layer_events) {
      if (ev && ev->Query()) {
        r.ready_end = std::max(r.ready_end, layer_end);
        ev.reset();
      }
    }
    std::erase_if(r.layer_events, [](const auto& e) { return !e.second; });
    for (auto& [g, p] : r.pairs) busy |= p.path->Advance(engine_, r, p);
    if (r.ending) peer_copies_.Discard(r.id);  // its senders abandoned its waiting batches
    TellSiblings(r);
    if (Finished(r)) {
      Finish(r);
      Release(r.id);
      it = requests_.erase(it);
      busy = true;
    } else {
      if (!r.ending) ReportStagedChunks(r);
      ++it;
    }
  }
  // The batches found ready in this iteration (all pairs, all requests) go out together, or wait
  // for the stream to drain to fewer than transfer.peer_hold_launches launches, or for the other
  // pairs of their requests (PeerLaunch::due).
  if (peer_copies_.due([this](uint64_t id) { return AwaitsPairs(id); })) {
    peer_copies_.Flush(engine_);
    busy = true;
  }
  if (peer_copies_.TakeLaunched())
    engine_.WakeAtStreamEnd();  // after every copy this pass submitted
  return busy;
}

bool ContextSideImpl::AwaitsPairs(uint64_t id) const {
  auto it = requests_.find(id);
  return it != requests_.end() && it->second.pairs.size() < it->second.expected.size();
}

// Peer-memory batches are copying (each Advance that launched some queued WakeAtStreamEnd behind
// them, after the merged PeerLaunch flush) and no transport operation waits to be driven: the
// next thing this side must do is reap a batch, and a FETCH arriving meanwhile would queue its
// copies behind these.
std::chrono::microseconds ContextSideImpl::QuietNap() const {
  if (peer_copies_.copying() == 0 || !engine_.host_visible_pool() || !engine_.cpu_device())
    return {};
  for (const auto& [id, r] : requests_) {
    for (const auto& [rank, p] : r.pairs) {
      if (p.path->transport_pending()) return {};
    }
  }
  return options_.stream_nap;
}

void ContextSideImpl::OnTick(Clock::time_point now) {
  CheckSiblingWatches();
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
          Status::DeadlineExceeded(
              fmt::format("request {}: not delivered within {} ms ({} of {} generation ranks "
                          "done here, {} of {} other context ranks done)",
                          id, options_.timeout.count(), DoneCount(r), r.expected.size(),
                          r.siblings_done.size(), siblings_.size())),
          true);
    }
  }
  engine_.peer_mappings().Sweep(now);
}

bool ContextSideImpl::OnStop() {
  for (auto& [id, r] : requests_) {
    if (!r.ending)
      End(r, TransferState::kCancelled, Status::Cancelled("context side shutting down"), true);
  }
  Advance();
  if (!requests_.empty()) return false;
  bool watched = false;
  for (auto& [rank, link] : sibling_links_) {
    if (link.watch && !link.watch->Done()) {
      engine_.transport().Cancel(*link.watch);
      watched = true;
    }
  }
  return !watched;
}

StatusOr<std::vector<std::byte>> ContextSideImpl::Begin(uint64_t id,
                                                        std::span<const int64_t> blocks,
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
  CtxRequest r;
  r.id = id;
  r.blocks.assign(blocks.begin(), blocks.begin() + needed);
  r.tokens = tokens;
  r.ready_end = all_ready ? shape.layers : 0;
  r.layer_wise = !all_ready;
  r.start = Clock::now();
  r.deadline = r.start + options_.timeout;
  ContextHandle h;
  h.request_id = id;
  static_cast<InstanceDesc&>(h) = engine_.SelfDesc();  // shape, split, layout, pool, scales
  h.prompt_tokens = tokens;
  h.layer_wise = !all_ready;
  h.ctx_direct = engine_.direct_ok();
  h.chunk_bytes = options_.chunk_bytes;
  h.blocks = r.blocks;
  {
    MutexLock lock(ids_mu_);
    if (addresses_.empty())
      return Status::InvalidArgument("SetInstanceAddresses must be called before MarkReady");
    if (live_ids_.count(id) || recent_set_.count(id)) {
      return Status::InvalidArgument(
          fmt::format("request {} was already marked ready on this rank", id));
    }
    live_ids_.insert(id);
    h.addresses = addresses_;
  }
  auto [bytes, token] = SealHandle(std::move(h), options_.secret);
  r.token = token;
  // Can't fail: an id not claimed above is not live in the status table either.
  if (Status st = engine_.statuses().Reserve(id, "is live on this rank"); !st.ok()) {
    MutexLock lock(ids_mu_);
    live_ids_.erase(id);
    return st;
  }
  // The rest runs on the progress thread, and this call does not wait for it (a blocking call
  // cost a wake-up of the caller per request). Public calls about the request reach the progress
  // thread after it, and a FETCH that overtakes it waits with the pending ones.
  engine_.loop().Post(
      [this, r = std::make_shared<CtxRequest>(std::move(r))] { Open(std::move(*r)); });
  return std::move(bytes);
}

void ContextSideImpl::Open(CtxRequest r) {
  const uint64_t id = r.id;
  requests_.emplace(id, std::move(r));
  engine_.statuses().Set(
      TransferStatus{id, TransferState::kInit, Status::Ok(), 0, 0});  // the metrics' start
  // Fetches that arrived before this rank knew the request.
  for (PendingFetch& pf : pending_.Take(id))
    OnFetch(pf.from, std::move(pf.fetch), std::move(pf.credits));
  for (const SiblingMsg& m : pending_.TakeSiblings(id)) OnSibling(m);
}

void ContextSideImpl::OnSibling(const SiblingMsg& m) {
  CtxRequest* r = Find(m.request_id);
  if (!r) {
    // Another rank may be done before this one's MarkReady: keep it as long as a FETCH waits.
    if (!Released(m.request_id))
      pending_.AddSibling(m, Clock::now() + options_.unknown_request_wait);
    return;
  }
  const bool sibling = std::binary_search(siblings_.begin(), siblings_.end(), m.ctx_rank);
  if (!sibling || m.token != MakeSiblingToken(options_.secret, r->token, m.ctx_rank, m.code)) {
    Log(LogLevel::kWarn,
        "context side: dropped a SIBLING for request {} claiming context rank {}: {}", m.request_id,
        m.ctx_rank, sibling ? "its token does not match" : "not another rank of this DP group");
    return;
  }
  if (m.code == 0) {
    r->siblings_done.insert(m.ctx_rank);
    return;
  }
  End(*r, TransferState::kError,
      PeerStatus(m.code, fmt::format("context rank {} ended it: {}", m.ctx_rank, m.reason)), true,
      false);
}

StatusOr<PeerId> ContextSideImpl::SiblingPeer(int32_t rank, Deadline deadline) {
  if (auto it = sibling_links_.find(rank); it != sibling_links_.end()) return it->second.peer;
  std::string address;
  {
    MutexLock lock(ids_mu_);
    address = addresses_.at(static_cast<size_t>(rank));
  }
  auto peer = [&] {
    ProfileScope timed(engine_.profile(), ProfilePhase::kConnect);
    return engine_.transport().Connect(address, deadline);
  }();
  if (!peer.ok()) return peer.status().WithContext(fmt::format("context rank {}", rank));
  SiblingLink& link = sibling_links_[rank];
  link.peer = *peer;
  if (engine_.transport().caps().detects_crashed_peers) {
    // Context ranks send each other control messages only: no data tag is ever sent here.
    auto watch = engine_.transport().Recv(*peer, DataTag(0, kSiblingWatchChunk), link.watch_buf,
                                          sizeof(link.watch_buf), MemoryKind::kHost);
    if (watch.ok()) link.watch = std::move(watch).value();
  }
  return *peer;
}

void ContextSideImpl::CheckSiblingWatches() {
  for (auto it = sibling_links_.begin(); it != sibling_links_.end();) {
    const TransportOp* w = it->second.watch.get();
    if (!w || !w->Done() || w->status().ok() || w->status().code() == StatusCode::kCancelled) {
      ++it;
      continue;
    }
    const int32_t rank = it->first;
    const Status why = Status::Unavailable(
        fmt::format("context rank {} is unreachable: {}", rank, w->status().message()));
    it = sibling_links_.erase(it);
    for (auto& [id, r] : requests_) {
      if (!r.ending && !r.siblings_done.count(rank)) End(r, TransferState::kError, why, true);
    }
  }
}

void ContextSideImpl::TellSiblings(CtxRequest& r) {
  if (r.ending || r.told_siblings || !LocalDone(r)) return;
  r.told_siblings = true;
  for (int32_t s : siblings_) {
    auto peer = SiblingPeer(s, r.deadline);
    if (!peer.ok()) return Fail(r, peer.status());
    const int32_t me = pool_.slice().rank;
    engine_.SendMsg(*peer,
                    SiblingMsg{r.id, MakeSiblingToken(options_.secret, r.token, me, 0), me, 0, {}});
  }
}

bool ContextSideImpl::Step(CtxRequest& r, SendPair& p, PairEvent event) {
  auto step = p.state.On(event);
  if (!step.ok()) {
    Fail(r, step.status().WithContext(fmt::format("request {}: generation rank {}", r.id, p.rank)));
    return false;
  }
  return *step == PairStep::kMove || *step == PairStep::kWithin;
}

bool ContextSideImpl::PairDone(const SendPair& p) const {
  if (!p.drained()) return false;
  if (p.state.Is(PairPhase::kDone)) return true;
  return p.state.Is(PairPhase::kAccepted) &&
         (p.plan.chunks.empty() || p.path->held_report() != nullptr || p.reported);
}

int ContextSideImpl::DoneCount(const CtxRequest& r) const {
  int n = 0;
  for (const auto& [g, p] : r.pairs) n += PairDone(p);
  return n;
}

bool ContextSideImpl::LocalDone(const CtxRequest& r) const {
  return r.heard && r.pairs.size() == r.expected.size() &&
         DoneCount(r) == static_cast<int>(r.expected.size());
}

bool ContextSideImpl::Finished(CtxRequest& r) {
  if (r.ending) {
    size_t stuck = 0;
    for (const auto& [g, p] : r.pairs) stuck += p.path->outstanding();
    if (stuck == 0) return true;
    // UCX and MPI can't take back a send a dead peer never matches. Sends only read the
    // blocks, so after a grace period the request ends anyway; the abandoned operations are
    // dropped (the transport completes them when it lets go of them).
    if (Clock::now() < r.ended_at + options_.abort_grace) return false;
    Log(LogLevel::kWarn, "context side: request {} ends with {} sends still held by the transport",
        r.id, stuck);
    for (auto& [g, p] : r.pairs) p.path->Abandon();
    return true;
  }
  return LocalDone(r) && r.siblings_done.size() == siblings_.size();
}

void ContextSideImpl::ReportStagedChunks(CtxRequest& r) {
  for (auto& [g, p] : r.pairs) {
    const LandedChunks* held = p.path->held_report();
    // A generation rank of version 10 would refuse the COMPLETE that follows: it waits for the
    // CHUNK saying complete (its staging slot stays taken meanwhile, as in version 10).
    if (!held || !held->staged || engine_.PairVersion(p.peer) < 11) continue;
    engine_.SendMsg(p.peer, ChunkMsg{r.id, p.transfer_id, static_cast<uint32_t>(held->first),
                                     held->count, false, 0});
    p.path->DropHeldReport();
    p.reported = true;
  }
}

void ContextSideImpl::Finish(CtxRequest& r) {
  double secs = std::chrono::duration<double>(Clock::now() - r.start).count();
  if (!r.ending) {
    r.state = TransferState::kComplete;
    r.reason = Status::Ok();
    for (auto& [g, p] : r.pairs) {
      const LandedChunks* held = p.path->held_report();
      if (!held) {
        engine_.SendMsg(p.peer, CompleteMsg{r.id, p.transfer_id});
        continue;
      }
      ChunkMsg last{r.id, p.transfer_id, static_cast<uint32_t>(held->first), held->count, false, 0};
      last.complete = true;
      engine_.SendMsg(p.peer, last);
      p.path->DropHeldReport();
      Step(r, p, PairEvent::kCompleteFolded);
    }
  } else {
    // One-sided pairs: no more puts from here; the generation rank may reuse its slots.
    for (auto& [g, p] : r.pairs) {
      if (p.path->one_sided()) {
        engine_.SendMsg(p.peer,
                        AbortMsg{r.id, p.transfer_id, static_cast<uint8_t>(r.reason.code()),
                                 "context rank stopped: " + std::string(r.reason.message())});
      }
    }
  }
  engine_.statuses().Set(TransferStatus{r.id, r.state, r.reason, r.bytes, secs});
}

// Decides the terminal state; operations still in flight are cancelled and drained before the
// request is reported (its blocks stay leased until then).
void ContextSideImpl::End(CtxRequest& r, TransferState state, Status why, bool tell_peers,
                          bool tell_siblings) {
  if (r.ending) return;
  r.ending = true;
  r.ended_at = Clock::now();
  r.state = state;
  r.reason = std::move(why);
  if (tell_peers && tell_siblings) {
    // The other context ranks' generation ranks can't complete without this one's: they end too.
    const int32_t me = pool_.slice().rank;
    const auto code = static_cast<uint8_t>(r.reason.code());
    const SiblingMsg m{r.id, MakeSiblingToken(options_.secret, r.token, me, code), me, code,
                       std::string(r.reason.message())};
    for (int32_t s : siblings_) {
      if (auto peer = SiblingPeer(s, Clock::now() + options_.timeout); peer.ok())
        engine_.SendMsg(*peer, m);
    }
  }
  for (auto& [g, p] : r.pairs) {
    p.path->Cancel(engine_.transport());
    // Generation ranks that said DONE wait for COMPLETE, which will not come: they are told too.
    if (tell_peers && !p.state.Is(PairPhase::kClosed)) {
      engine_.SendMsg(p.peer, AbortMsg{r.id, p.transfer_id, static_cast<uint8_t>(r.reason.code()),
                                       std::string(r.reason.message())});
    }
  }
}

CtxRequest* ContextSideImpl::Find(uint64_t id) {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : &it->second;
}

// Transfer ids are chosen by each generation rank: unique only together with the sender.
SendPair* ContextSideImpl::FindPair(uint64_t id, PeerId from, uint32_t transfer_id) {
  CtxRequest* r = Find(id);
  if (!r) return nullptr;
  for (auto& [g, p] : r->pairs) {
    if (p.peer == from && p.transfer_id == transfer_id) return &p;
  }
  return nullptr;
}

StatusOr<std::unique_ptr<ContextSide>> ContextSide::Create(Device& device, const BlockPool& pool,
                                                           const TransceiverOptions& options) {
  KVF_ASSIGN_OR_RETURN(auto transport, MakeTransport(options, device));
  return Create(device, pool, options, std::move(transport));
}

StatusOr<std::unique_ptr<ContextSide>> ContextSide::Create(Device& device, const BlockPool& pool,
                                                           const TransceiverOptions& options,
                                                           std::unique_ptr<Transport> transport) {
  if (!transport) return Status::InvalidArgument("ContextSide: null transport");
  KVF_RETURN_IF_ERROR(CheckSideScales("ContextSide", options.kv_scales, pool));
  if (std::all_of(options.instance_secret.begin(), options.instance_secret.end(),
                  [](uint8_t b) { return b == 0; })) {
    return Status::InvalidArgument(
        "ContextSide: instance_secret is all zero (the default), which anyone could use to forge "
        "handles: rank 0 of the context instance makes one with NewInstanceSecret() and the other "
        "ranks take it (PublishInstanceSecret / FetchInstanceSecret, kvferry/rendezvous.h)");
  }
  auto side = std::make_unique<ContextSideImpl>(device, pool, ResolveOptions(options, device),
                                                std::move(transport));
  KVF_RETURN_IF_ERROR(side->Start());
  return std::unique_ptr<ContextSide>(std::move(side));
}

}  // namespace kvferry

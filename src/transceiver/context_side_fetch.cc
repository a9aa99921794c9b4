// The context side takes a FETCH (ContextSideImpl, context_side_impl.h): authenticated, matched to
// its request (or held until the request is known), checked against it, its pair's data path
// chosen (paths/choose.h), planned, and its pair accepted, or refused with REJECT.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "base/log.h"
#include "transceiver/context_side_impl.h"

namespace kvferry {

void ContextSideImpl::OnFetch(PeerId from, FetchMsg f, std::vector<CreditMsg> credits) {
  const PeerId peer = from;  // the transport connects back to a control sender by itself
  if (!Authenticated(f)) return;
  CtxRequest* r = Find(f.request_id);
  if (!r) return HoldUnknown(peer, std::move(f), std::move(credits));
  if (Status st = CheckFetch(*r, f); !st.ok()) return Reject(peer, f, st);
  auto path = chooser_.Choose(f, Converts(f));
  if (!path.ok()) return Reject(peer, f, path.status());
  if (Status st = Plan(*r, f); !st.ok()) return Reject(peer, f, st);
  AcceptPair(*r, peer, f, std::move(path).value(), credits);
}

// Before anything else, and before any answer (the first one connects the transport back to the
// sender's address): a FETCH whose token is not this instance's MAC of the handle digest it
// carries came from no handle of this instance, or from one altered on the way (its layout, a
// flag, an address). It is dropped unanswered; the sender's deadline ends its request.
bool ContextSideImpl::Authenticated(const FetchMsg& f) {
  if (f.token == HandleToken(options_.secret, f.handle_digest)) return true;
  NoteUnauthenticated(fmt::format(
      "context side: dropped a fetch of request {} from generation rank {}: its token does not "
      "authenticate its handle (forged, altered, or another instance's)",
      f.request_id, f.gen_rank));
  return false;
}

void ContextSideImpl::HoldUnknown(PeerId peer, FetchMsg f, std::vector<CreditMsg> credits) {
  if (Released(f.request_id)) {
    return Reject(peer, f,
                  Status::InvalidArgument(fmt::format(
                      "request {} already ended on this rank and was released (a replayed "
                      "handle, or a FETCH later than the request's deadline)",
                      f.request_id)));
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
}

Status ContextSideImpl::CheckFetch(const CtxRequest& r, const FetchMsg& f) const {
  if (r.ending) {
    return Status::Cancelled(fmt::format("request {} is ending: {}", r.id, r.reason.ToString()));
  }
  if (f.token != r.token) {
    return Status::InvalidArgument(
        fmt::format("request {}: the access token is of another handle of this instance (a "
                    "handle altered to name another request, or context ranks of one instance "
                    "with different custom layout strides)",
                    r.id));
  }
  if (r.heard && f.gen_instance != r.gen_instance) {
    return Status::InvalidArgument(fmt::format(
        "request {} is already being fetched by another generation instance (replayed handle)",
        r.id));
  }
  if (r.pairs.count(f.gen_rank)) {
    return Status::InvalidArgument(fmt::format(
        "request {}: generation rank {} already fetched it (replayed handle)", r.id, f.gen_rank));
  }
  if (f.chunk_bytes < 1 || f.chunk_bytes > options_.chunk_bytes ||
      (!engine_.direct_ok() && f.direct_min_bytes != kNoDirect)) {
    return Status::InvalidArgument(
        fmt::format("request {}: fetch asks for chunks of {} bytes (direct from {}); this "
                    "context rank stages at most {} and {} send from its pool",
                    r.id, f.chunk_bytes, f.direct_min_bytes, options_.chunk_bytes,
                    engine_.direct_ok() ? "can" : "can't"));
  }
  if (f.prompt_tokens != r.tokens) {
    return Status::InvalidArgument(
        fmt::format("request {}: fetch asks for {} tokens, the context holds {}", r.id,
                    f.prompt_tokens, r.tokens));
  }
  return Status::Ok();
}

Status ContextSideImpl::Plan(CtxRequest& r, const FetchMsg& f) {
  if (!r.planned || r.plan_key.plan_inputs() != f.plan_inputs()) {
    PlanInput in;
    in.ctx = engine_.SelfDesc();
    in.gen = f;  // the generation instance the FETCH describes (an InstanceDesc)
    in.prompt_tokens = r.tokens;
    in.ctx_blocks = r.blocks;
    in.gen_blocks = f.blocks;
    in.gen_reused_blocks = f.reused_blocks;
    in.chunk_bytes = f.chunk_bytes;
    in.direct_min_bytes = f.direct_min_bytes;
    in.layer_wise = r.layer_wise;
    in.max_plan_bytes = engine_.plan_budget();
    in.max_chunks = engine_.plan_chunk_cap();
    if (!r.heard) {
      KVF_ASSIGN_OR_RETURN(r.expected, GenRanksFetching(in, pool_.slice().rank));
    }
    auto plan = [&] {
      ProfileScope timed(engine_.profile(), ProfilePhase::kPlan);
      return PlanForCtxRank(in, pool_.slice().rank);
    }();
    if (!plan.ok()) return plan.status();
    r.plan = std::move(plan).value();
    r.plan_key = f;
    r.planned = true;
  }
  // Wire version 8: only the generation ranks with something to fetch from this rank ask.
  if (!std::binary_search(r.expected.begin(), r.expected.end(), f.gen_rank)) {
    return Status::InvalidArgument(fmt::format(
        "request {}: generation rank {} has nothing to fetch from context rank {} (it fetches "
        "from generation ranks {})",
        r.id, f.gen_rank, pool_.slice().rank, fmt::join(r.expected, ",")));
  }
  return Status::Ok();
}

bool ContextSideImpl::Converts(const FetchMsg& f) const {
  return kvferry::Converts(engine_.SelfDesc(), f);
}

void ContextSideImpl::AcceptPair(CtxRequest& r, PeerId peer, const FetchMsg& f,
                                 std::unique_ptr<SendPath> path,
                                 const std::vector<CreditMsg>& credits) {
  if (!r.heard) {
    r.heard = true;
    r.gen_instance = f.gen_instance;
  }
  SendPair p;
  p.rank = f.gen_rank;
  p.peer = peer;
  p.transfer_id = f.transfer_id;
  p.checksum = f.checksum;
  if (Converts(f)) {
    p.conversion = Conversion{*ElementFormatOf(engine_.SelfDesc().shape.dtype),
                              *ElementFormatOf(f.shape.dtype)};
  }
  p.path = std::move(path);
  engine_.NotePathUsed(p.path->kind());
  for (const PairPlan& pp : r.plan) {
    if (pp.gen_rank == f.gen_rank) p.plan = pp;
  }
  r.state = TransferState::kInProgress;
  engine_.statuses().Set(TransferStatus{r.id, r.state, Status::Ok(), r.bytes, 0});
  // The answer says which data path the pair takes (ACCEPT, wire version 7; a peer-memory pair's
  // first CHUNK instead); a pair with no chunks is answered by COMPLETE alone.
  p.path->Open(engine_, r, p);
  SendPair& added = r.pairs.emplace(f.gen_rank, std::move(p)).first->second;
  for (const CreditMsg& c : credits) ApplyCredit(r, added, c);
}

// A pair takes only the credits of its path (the generation rank credits one-sided before it
// knows this rank's answer, and again tagged after ACCEPT says tagged).
void ContextSideImpl::ApplyCredit(CtxRequest& r, SendPair& p, const CreditMsg& c) {
  if (Status st = p.path->Credit(p, c); !st.ok()) Fail(r, st);
}

void ContextSideImpl::NoteUnauthenticated(std::string_view what) {
  if (unauthenticated_++ % 1000 == 0)
    Log(LogLevel::kWarn, "{} ({} such so far)", what, unauthenticated_);
}

void ContextSideImpl::Reject(PeerId peer, const FetchMsg& f, const Status& why) {
  Log(LogLevel::kInfo, "context side: refused fetch of request {} from generation rank {}: {}",
      f.request_id, f.gen_rank, why.ToString());
  engine_.SendMsg(peer, RejectMsg{f.request_id, f.transfer_id, static_cast<uint8_t>(why.code()),
                                  std::string(why.message())});
}

}  // namespace kvferry

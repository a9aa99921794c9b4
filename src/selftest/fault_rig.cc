#include "selftest/fault_rig.h"

#include <fmt/format.h>

#include <cstring>

#include "testing/testdata.h"

namespace kvferry {

StatusOr<std::unique_ptr<FaultRig>> FaultRig::Create(const RigInstance& ctx, const RigInstance& gen,
                                                     TransceiverOptions options,
                                                     const std::string& transport) {
  std::unique_ptr<FaultRig> rig(new FaultRig());
  rig->device_ = OpenCpuDevice();
  rig->fabric_ = InProcFabric::Create();
  rig->ctx_spec_ = ctx;
  rig->gen_spec_ = gen;
  options.transport = transport;
  const bool inproc = transport == "inproc";
  options.instance_secret = NewInstanceSecret();
  auto make = [&](std::vector<FaultyTransport*>& list,
                  std::vector<std::string>& addrs) -> StatusOr<std::unique_ptr<Transport>> {
    TransportOptions t;
    t.name = options.transport;
    t.fabric = rig->fabric_;
    KVF_ASSIGN_OR_RETURN(auto inner, CreateTransport(t));
    std::string addr = inner->LocalAddress();
    std::function<void()> crash;
    if (inproc) crash = [fabric = rig->fabric_, addr] { (void)fabric->Kill(addr); };
    auto faulty = std::make_unique<FaultyTransport>(std::move(inner), NeverFault(), crash);
    list.push_back(faulty.get());
    addrs.push_back(addr);
    return std::unique_ptr<Transport>(std::move(faulty));
  };
  auto pool_of = [&](const RigInstance& s, int rank) -> StatusOr<BlockPool> {
    PoolSpec p{s.shape, s.parallel, rank, s.layout, MemoryKind::kHost, s.blocks};
    KVF_ASSIGN_OR_RETURN(BlockPool pool, BlockPool::Create(*rig->device_, p));
    for (int i = 0; i < pool.num_regions(); ++i)
      std::memset(pool.region(i), 0xA5, pool.layout().region_bytes());
    return pool;
  };
  for (int r = 0; r < ctx.parallel.world_size(); ++r) {
    KVF_ASSIGN_OR_RETURN(BlockPool pool, pool_of(ctx, r));
    rig->ctx_pools_.push_back(std::move(pool));
    KVF_ASSIGN_OR_RETURN(auto t, make(rig->ctx_t_, rig->ctx_addr_));
    KVF_ASSIGN_OR_RETURN(auto side, ContextSide::Create(*rig->device_, rig->ctx_pools_.back(),
                                                        options, std::move(t)));
    rig->ctx_.push_back(std::move(side));
  }
  for (auto& c : rig->ctx_) KVF_RETURN_IF_ERROR(c->SetInstanceAddresses(rig->ctx_addr_));
  options.instance_id = 7;
  for (int r = 0; r < gen.parallel.world_size(); ++r) {
    KVF_ASSIGN_OR_RETURN(BlockPool pool, pool_of(gen, r));
    rig->gen_pools_.push_back(std::move(pool));
    KVF_ASSIGN_OR_RETURN(auto t, make(rig->gen_t_, rig->gen_addr_));
    KVF_ASSIGN_OR_RETURN(auto side, GenerationSide::Create(*rig->device_, rig->gen_pools_.back(),
                                                           options, std::move(t)));
    rig->gen_.push_back(std::move(side));
  }
  return rig;
}

FaultRig::~FaultRig() {
  // Sides first: they drive the transports and read the pools.
  gen_.clear();
  ctx_.clear();
}

int FaultRig::ranks(bool context) const { return spec(context).parallel.world_size(); }

std::vector<int> FaultRig::Group(bool context, int group) const {
  const RigInstance& s = spec(context);
  std::vector<int> out;
  for (int r = 0; r < s.parallel.world_size(); ++r) {
    auto slice = SliceOf(s.shape, s.parallel, r);
    if (slice.ok() && slice->dp_group == group) out.push_back(r);
  }
  return out;
}

StatusOr<std::vector<std::byte>> FaultRig::Publish(uint64_t id, const std::vector<int64_t>& blocks,
                                                   int64_t tokens, int ctx_group, bool layer_wise) {
  const int tpb = ctx_spec_.shape.tokens_per_block;
  std::vector<std::byte> handle;
  for (int r : Group(true, ctx_group)) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      int64_t valid = std::min<int64_t>(tpb, tokens - static_cast<int64_t>(i) * tpb);
      if (valid > 0)
        KVF_RETURN_IF_ERROR(FillBlock(ctx_pools_[r], id, {blocks[i], int64_t(i) * tpb, valid}));
    }
    auto h = layer_wise ? ctx_[r]->BeginLayerWise(id, blocks, tokens)
                        : ctx_[r]->MarkReady(id, blocks, tokens);
    if (!h.ok()) return h.status();
    handle = std::move(h).value();
  }
  return handle;
}

Status FaultRig::Fetch(std::span<const std::byte> handle, const std::vector<int64_t>& blocks,
                       int gen_group) {
  Status first = Status::Ok();
  for (int r : Group(false, gen_group)) {
    Status st = gen_[r]->Fetch(handle, blocks, 0);
    if (!st.ok() && first.ok()) first = st.WithContext(fmt::format("generation rank {}", r));
  }
  return first;
}

Status FaultRig::Verify(uint64_t id, const std::vector<int64_t>& blocks, int64_t tokens,
                        int gen_group) {
  const int tpb = gen_spec_.shape.tokens_per_block;
  for (int r : Group(false, gen_group)) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      int64_t valid = std::min<int64_t>(tpb, tokens - static_cast<int64_t>(i) * tpb);
      if (valid <= 0) continue;
      KVF_ASSIGN_OR_RETURN(auto m,
                           CheckBlock(gen_pools_[r], id, {blocks[i], int64_t(i) * tpb, valid}));
      if (m.has_value()) {
        return Status::DataLoss(fmt::format("request {} generation rank {} block {}: {}", id, r,
                                            blocks[i], m->ToString()));
      }
    }
  }
  return Status::Ok();
}

std::vector<RigReport> FaultRig::PollAll(std::chrono::milliseconds wait) {
  std::vector<RigReport> out;
  auto collect = [&](Deadline d) {
    for (size_t r = 0; r < ctx_.size(); ++r) {
      for (TransferStatus& s : ctx_[r]->Poll(0, d)) out.push_back({true, int(r), std::move(s)});
    }
    for (size_t r = 0; r < gen_.size(); ++r) {
      for (TransferStatus& s : gen_[r]->Poll(0, d)) out.push_back({false, int(r), std::move(s)});
    }
  };
  const Deadline until = DeadlineIn(wait);
  collect(Clock::now());
  while (out.empty() && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    collect(Clock::now());
  }
  return out;
}

TransceiverStats FaultRig::Totals() const {
  TransceiverStats t;
  auto add = [&](const TransceiverStats& s) {
    t.requests_ended += s.requests_ended;
    t.busy_cpu_seconds += s.busy_cpu_seconds;
    t.live_requests += s.live_requests;
    t.staging_slots_in_use += s.staging_slots_in_use;
  };
  for (const auto& c : ctx_) add(c->stats());
  for (const auto& g : gen_) add(g->stats());
  return t;
}

int64_t FaultRig::FaultsFired() const {
  int64_t n = 0;
  for (auto* t : ctx_t_) n += t->fired();
  for (auto* t : gen_t_) n += t->fired();
  return n;
}

void FaultRig::DisarmAll() {
  for (auto* t : ctx_t_) t->Arm(NeverFault());
  for (auto* t : gen_t_) t->Arm(NeverFault());
}

Status FaultRig::Kill(bool context, int rank) {
  if (spec(context).parallel.world_size() <= rank) return Status::InvalidArgument("no such rank");
  return fabric_->Kill(context ? ctx_addr_[rank] : gen_addr_[rank]);
}

}  // namespace kvferry

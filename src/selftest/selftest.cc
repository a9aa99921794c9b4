#include "selftest/selftest.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "kvferry/inproc_transport.h"
#include "kvferry/transceiver.h"
#include "selftest/baseline.h"
#include "selftest/handle_prefetch.h"
#include "selftest/metrics_board.h"
#include "selftest/run_files.h"
#include "selftest/run_watch.h"
#include "testing/faulty_transport.h"
#include "testing/testdata.h"

namespace kvferry {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// Tokens per block of one side's pools.
int64_t TokensPerBlock(const SelftestConfig& cfg, bool context) {
  return SideShape(cfg, context).tokens_per_block;
}
int64_t BlocksFor(const SelftestConfig& cfg, bool context, int64_t tokens) {
  return (tokens + TokensPerBlock(cfg, context) - 1) / TokensPerBlock(cfg, context);
}
int64_t MaxBlocksPerRequest(const SelftestConfig& cfg, bool context) {
  return BlocksFor(cfg, context,
                   *std::max_element(cfg.prompt_tokens.begin(), cfg.prompt_tokens.end()));
}
uint64_t RequestId(int i) { return 0x5E1F000000000000ULL + static_cast<uint64_t>(i) + 1; }
// The context instance's name on the rendezvous.
constexpr std::string_view kContextInstance = "ctx";
// Test-data seed of the shared prefix blocks (they hold the same values for every request).
constexpr uint64_t kPrefixSeed = 0x5E1FFFFFFFFFFFFFULL;

// Block b of a request in slot `slot` of `slots`: the resident prefix area, or the slot's own
// blocks.
int64_t BlockId(const SelftestConfig& cfg, int64_t bpr, int slots, int slot, int64_t b) {
  return b < cfg.shared_prefix_blocks ? bpr * slots + b : slot * bpr + b;
}
uint64_t SeedOf(const SelftestConfig& cfg, int64_t b, uint64_t id) {
  return b < cfg.shared_prefix_blocks ? kPrefixSeed : id;
}
int64_t PoolBlocks(const SelftestConfig& cfg, bool context) {
  return MaxBlocksPerRequest(cfg, context) * SlotsOf(cfg, context) + cfg.shared_prefix_blocks;
}

// Fills and checks blocks of a pool that may live in GPU memory, through a host mirror.
class PoolAccess {
 public:
  // Also touches every page of the pool once: a serving engine's pool is resident, and first
  // touches inside a timed transfer would measure the kernel's page faults.
  static StatusOr<PoolAccess> Make(Device& dev, const BlockPool& pool) {
    PoolAccess a;
    a.dev_ = &dev;
    a.pool_ = &pool;
    {
      KVF_ASSIGN_OR_RETURN(auto s, dev.CreateStream());
      for (int32_t r = 0; r < pool.num_regions(); ++r) {
        KVF_RETURN_IF_ERROR(s->Fill(pool.region(r), 0, pool.layout().region_bytes()));
      }
      if (pool.block_scales()) {
        KVF_RETURN_IF_ERROR(s->Fill(pool.block_scales(), 0, pool.block_scale_count() * 4));
      }
      KVF_RETURN_IF_ERROR(s->Synchronize(DeadlineIn(milliseconds(60000))));
    }
    return a;
  }
  Status Fill(uint64_t req, const BlockTokens& where) {
    KVF_RETURN_IF_ERROR(OpenMirror());
    if (!mirror_) return FillBlock(*pool_, req, where);
    KVF_RETURN_IF_ERROR(FillBlock(*mirror_, req, where));
    return Move(where.block, true);
  }
  // `sent_as`: the dtype the context side filled (the values arrive converted when it differs).
  // `sent_scales` and `own_scales`: the context's and this instance's KV scales.
  StatusOr<std::optional<Mismatch>> Check(uint64_t req, const BlockTokens& where, DType sent_as,
                                          const KvScales& sent_scales = {},
                                          const KvScales& own_scales = {}) {
    KVF_RETURN_IF_ERROR(OpenMirror());
    if (!mirror_) return CheckBlock(*pool_, req, where, sent_as, sent_scales, own_scales);
    KVF_RETURN_IF_ERROR(Move(where.block, false));
    return CheckBlock(*mirror_, req, where, sent_as, sent_scales, own_scales);
  }

 private:
  // A GPU pool's pinned host mirror, made at the first fill or check: a benchmark that checks
  // nothing (--no-verify) never pins a copy of its pools.
  Status OpenMirror() {
    if (mirror_ || dev_->info().platform == "cpu") return Status::Ok();
    PoolSpec s = pool_->spec();
    s.memory = MemoryKind::kPinnedHost;
    // The mirror has the pool's layout, custom strides included (extents are copied as they are).
    KVF_ASSIGN_OR_RETURN(BlockPool mirror, BlockPool::Create(*dev_, s, pool_->layout()));
    mirror_ = std::make_unique<BlockPool>(std::move(mirror));
    KVF_ASSIGN_OR_RETURN(stream_, dev_->CreateStream());
    return Status::Ok();
  }
  Status Move(int64_t block, bool to_pool) {
    std::vector<int64_t> ids{block};
    KVF_ASSIGN_OR_RETURN(auto ext, pool_->BlockExtents(ids));
    for (const Extent& e : ext) {
      std::byte* p = pool_->Address(e);
      std::byte* m = mirror_->Address(e);
      KVF_RETURN_IF_ERROR(to_pool ? stream_->Copy(p, m, e.bytes) : stream_->Copy(m, p, e.bytes));
    }
    if (float* scales = pool_->block_scales()) {  // the block's, contiguous
      const int64_t at = pool_->BlockScaleIndex(block, 0, 0, 0);
      const size_t bytes = static_cast<size_t>(pool_->BlockScaleIndex(1, 0, 0, 0)) * 4;
      float* m = mirror_->block_scales() + at;
      KVF_RETURN_IF_ERROR(to_pool ? stream_->Copy(scales + at, m, bytes)
                                  : stream_->Copy(m, scales + at, bytes));
    }
    return stream_->Synchronize(DeadlineIn(milliseconds(30000)));
  }
  Device* dev_ = nullptr;
  const BlockPool* pool_ = nullptr;
  std::unique_ptr<BlockPool> mirror_;
  std::unique_ptr<Stream> stream_;
};

void AddError(RankResult& r, std::string e) {
  if (r.errors.size() < 8) r.errors.push_back(std::move(e));
}

std::string StallMessage(const RunWatch& w) {
  return fmt::format(
      "gave up after {} ms without a request completing or failing (ends by the deadline don't "
      "count: a peer may be stopped)",
      w.limit().count());
}

// The rank stopped (RunWatch::Stalled or Stopped): what it gave up on, and why, counted as
// failed.
void GiveUp(RankResult& r, std::string msg, const std::vector<uint64_t>& live, size_t never_started,
            const std::string& why_not_started) {
  std::string ids;
  for (uint64_t id : live) ids += fmt::format("{}{}", ids.empty() ? "" : " ", id);
  msg += ":";
  if (!live.empty()) msg += fmt::format(" request(s) {} never ended;", ids);
  if (never_started > 0)
    msg += fmt::format(" {} never started ({});", never_started, why_not_started);
  msg.pop_back();
  r.errors.push_back(std::move(msg));  // past AddError's cap: this is the reason the rank stopped
  r.failed += static_cast<int>(live.size() + never_started);
}

// The context ranks add the instance secret (RunContextRank); the generation side needs none.
TransceiverOptions SideOptions(const SelftestConfig& cfg, bool context) {
  TransceiverOptions o;
  o.kv_scales = SideScales(cfg, context);
  o.transport = cfg.transport;
  o.timeout = cfg.timeout;
  o.instance_id = 0xD0D0;
  o.checksum = cfg.checksum;
  return o;
}

// Waits until generation rank 0 has started a request (its progress file, RunWatch, says
// "done total started" with started >= 1), or until `deadline`.
void AwaitGenerationStart(const SelftestConfig& cfg, Clock::time_point deadline) {
  const fs::path progress = fs::path(cfg.dir) / "progress-gen-0";
  while (Clock::now() < deadline) {
    std::ifstream f(progress);
    int64_t done = 0, total = 0, started = 0;
    if (f >> done >> total >> started && started >= 1) return;
    std::this_thread::sleep_for(milliseconds(5));
  }
}

}  // namespace

// The rank's transport, wrapped in a FaultyTransport when cfg.fault names this rank (`fault`
// points at it; the side that owns the transport keeps it alive). A crash fault ends the process
// abruptly, as a crashed rank would.
struct RankTransportParts {
  std::unique_ptr<Transport> transport;
  const FaultyTransport* fault = nullptr;
};
StatusOr<RankTransportParts> RankTransport(const SelftestConfig& cfg, bool context, int rank,
                                           const TransportMaker& make) {
  KVF_ASSIGN_OR_RETURN(auto transport, make());
  if (cfg.fault.empty()) return RankTransportParts{std::move(transport)};
  KVF_ASSIGN_OR_RETURN(FaultPoint f, ParseFaultPoint(cfg.fault));
  if (f.context != context || f.rank != rank) return RankTransportParts{std::move(transport)};
  auto faulty =
      std::make_unique<FaultyTransport>(std::move(transport), f.spec, [] { std::_Exit(3); });
  const FaultyTransport* fault = faulty.get();
  return RankTransportParts{std::move(faulty), fault};
}

// A fault injected at a step the run never took tested nothing: the run fails, saying so.
void NoteFaultMissed(RankResult& res, const SelftestConfig& cfg, const FaultyTransport* fault) {
  if (fault == nullptr || fault->fired() > 0) return;
  res.fault_missed = true;
  res.errors.push_back(fmt::format(
      "--fault {} never fired: this rank did not reach that step that many times", cfg.fault));
}

// What a rank's run stands on: its device, its pool (on the heap: the side and the access keep
// references to it), and the access that fills and checks the pool's blocks.
namespace {
struct RankMemory {
  std::unique_ptr<Device> dev;
  std::unique_ptr<BlockPool> pool;
  std::unique_ptr<PoolAccess> access;
};
}  // namespace

StatusOr<RankMemory> OpenRankMemory(const SelftestConfig& cfg, bool context, int rank) {
  const ParallelConfig& split = context ? cfg.ctx : cfg.gen;
  const LayoutSpec& layout = context ? cfg.ctx_layout : cfg.gen_layout;
  RankMemory m;
  KVF_ASSIGN_OR_RETURN(m.dev, OpenDevice(RankDevice(cfg, context, rank)));
  const KvShape shape = SideShape(cfg, context);
  const int64_t blocks = PoolBlocks(cfg, context);
  PoolSpec spec{shape, split, rank, layout.kind, MemoryKind::kDevice, blocks};
  spec.block_scales = (context ? cfg.ctx_scales : cfg.gen_scales) == ScaleGranularity::kBlock;
  KVF_ASSIGN_OR_RETURN(const RankSlice slice, SliceOf(shape, split, rank));
  KVF_ASSIGN_OR_RETURN(const PoolDims span, InstancePoolDims(shape, split, blocks));
  KVF_ASSIGN_OR_RETURN(const PoolLayout pool_layout,
                       layout.Make(RankPoolDims(shape, slice, blocks), span, shape.ElementBytes()));
  KVF_ASSIGN_OR_RETURN(BlockPool pool, BlockPool::Create(*m.dev, spec, pool_layout));
  m.pool = std::make_unique<BlockPool>(std::move(pool));
  KVF_ASSIGN_OR_RETURN(PoolAccess access, PoolAccess::Make(*m.dev, *m.pool));
  m.access = std::make_unique<PoolAccess>(std::move(access));
  return m;
}

// The requests served by DP group `group` of an instance split `split`, in order.
std::vector<int> RequestsOfGroup(const SelftestConfig& cfg, const ParallelConfig& split,
                                 int group) {
  std::vector<int> mine;
  for (int i = 0; i < cfg.requests; ++i) {
    if (i % split.dp_size == group) mine.push_back(i);
  }
  return mine;
}

static std::optional<RequestTimeline> Slowest(const std::vector<RequestTimeline>& timelines) {
  std::optional<RequestTimeline> out;
  for (const RequestTimeline& t : timelines) {
    if (!out || t.end > out->end) out = t;
  }
  return out;
}

// A rank's warm-up requests ended: what its side spent so far is set-up, not the measured
// requests' cost.
template <typename Side>
static void NoteWarm(RankResult& res, const Side& side, int done, Clock::time_point start) {
  const TransceiverStats stats = side.stats();
  res.control_cpu_warm_seconds = stats.busy_cpu_seconds;
  res.thread_cpu_warm_seconds = stats.thread_cpu_seconds;
  res.warm_requests = done;
  res.warm_at_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  res.profile_warm = side.metrics().profile;
}

// The run ended: what its side spent and which data path it took, from one snapshot each. When
// every request the rank started was reported (`all_reported`: it gave up on none), no lease or
// staging slot may be left (docs/reliability.md, Leases): RankResult::leaked, after a second for
// the progress thread to retire the last chunk's work.
template <typename Side>
static void NoteEnd(RankResult& res, const Side& side, bool all_reported) {
  if (all_reported) {
    TransceiverStats held = side.stats();
    const Deadline until = DeadlineIn(milliseconds(1000));
    while ((held.live_requests != 0 || held.staging_slots_in_use != 0) && Clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(5));
      held = side.stats();
    }
    res.leaked = held.live_requests + held.staging_slots_in_use;
    if (res.leaked != 0) {
      AddError(res, fmt::format("{} request lease(s) and {} staging slot(s) still held after "
                                "every request was reported",
                                held.live_requests, held.staging_slots_in_use));
    }
  }
  const TransceiverStats stats = side.stats();
  res.control_cpu_seconds = stats.busy_cpu_seconds;
  res.thread_cpu_seconds = stats.thread_cpu_seconds;
  TransceiverMetrics metrics = side.metrics();
  res.data_path = std::move(metrics.data_path);
  res.profile = std::move(metrics.profile);
  const std::vector<RequestTimeline> timelines = side.timelines();
  res.slowest = Slowest(timelines);
  res.median = MedianTimeline(timelines);
}

StatusOr<RankResult> RunContextRank(const SelftestConfig& cfg, int rank,
                                    const TransportMaker& make) {
  const fs::path dir(cfg.dir);
  RankResult res;
  res.context = true;
  res.rank = rank;
  const double cpu0 = CpuSeconds();
  KVF_ASSIGN_OR_RETURN(RankMemory m, OpenRankMemory(cfg, true, rank));
  Device& dev = *m.dev;
  const BlockPool& pool = *m.pool;
  PoolAccess& access = *m.access;
  const int64_t bpr = MaxBlocksPerRequest(cfg, true);
  const int64_t tpb = TokensPerBlock(cfg, true);
  KVF_ASSIGN_OR_RETURN(RankTransportParts parts, RankTransport(cfg, true, rank, make));
  std::unique_ptr<Transport> transport = std::move(parts.transport);
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<Rendezvous> rv, ConnectRunRendezvous(cfg));
  // Set-up waits for the other ranks of the instance, which start when the machine lets them:
  // bounded like any stretch without progress (StallLimit), not by one request's deadline (under
  // TSan at load 30, rank 0 gave up on rank 1's address after the 2 s request deadline).
  auto deadline = DeadlineIn(StallLimit(cfg));
  // Rank 0 makes the instance's secret; the other ranks take it from the rendezvous.
  TransceiverOptions options = SideOptions(cfg, true);
  if (rank == 0) {
    options.instance_secret = NewInstanceSecret();
    KVF_RETURN_IF_ERROR(PublishInstanceSecret(*rv, kContextInstance, options.instance_id,
                                              options.instance_secret, deadline));
  } else {
    KVF_ASSIGN_OR_RETURN(options.instance_secret,
                         FetchInstanceSecret(*rv, kContextInstance, options.instance_id, deadline));
  }
  KVF_ASSIGN_OR_RETURN(auto side, ContextSide::Create(dev, pool, options, std::move(transport)));
  MetricsBoard board;  // before the server: the server's thread reads it
  std::unique_ptr<MetricsServer> metrics_server;
  if (cfg.metrics_port >= 0) {
    const std::string name = fmt::format("context rank {}", rank);
    board.Attach([&side, name] { return std::vector<MetricsSource>{{name, side->metrics()}}; });
    const int port = cfg.metrics_port == 0 ? 0 : cfg.metrics_port + rank;
    KVF_ASSIGN_OR_RETURN(metrics_server, board.Serve(static_cast<uint16_t>(port), name));
  }
  KVF_RETURN_IF_ERROR(PublishRankAddress(*rv, kContextInstance, options.instance_id, rank,
                                         side->address(), deadline));
  KVF_ASSIGN_OR_RETURN(std::vector<std::string> addrs,
                       GatherRankAddresses(*rv, kContextInstance, options.instance_id,
                                           cfg.ctx.world_size(), deadline));
  KVF_RETURN_IF_ERROR(side->SetInstanceAddresses(addrs));
  const RankSlice me = pool.slice();
  std::vector<int> group = GroupRanks(cfg.shape, cfg.ctx, me.dp_group);
  const bool leader = group.front() == rank;
  const std::vector<int> mine = RequestsOfGroup(cfg, cfg.ctx, me.dp_group);
  // Block ids must be the same on every rank of an instance (one scheduler decides them in a
  // real engine): the k-th request of a DP group always uses slot k % slots.
  const int slots = SlotsOf(cfg, true);
  std::vector<bool> busy(slots, false);
  std::map<uint64_t, int> slot_of;
  std::map<uint64_t, std::vector<std::shared_ptr<Event>>> events;
  std::unique_ptr<Stream> compute;
  if (cfg.layer_wise) {
    KVF_ASSIGN_OR_RETURN(compute, dev.CreateStream());
  }
  for (int64_t b = 0; b < cfg.shared_prefix_blocks; ++b) {
    KVF_RETURN_IF_ERROR(access.Fill(kPrefixSeed, {BlockId(cfg, bpr, slots, 0, b), b * tpb, tpb}));
  }
  size_t next = 0;
  int done = 0;
  auto start = Clock::now();
  RunWatch watch(cfg, dir / fmt::format("progress-ctx-{}", rank), static_cast<int>(mine.size()));
  std::vector<uint64_t> live;
  // Warm-up (cfg.warmup): the first requests end before the others are published.
  const int warmup = std::min(cfg.warmup, static_cast<int>(mine.size()) - 1);
  bool warm = warmup <= 0;
  while (done < static_cast<int>(mine.size())) {
    if (!warm && done >= warmup) {
      warm = true;
      NoteWarm(res, *side, done, start);
    }
    while (next < mine.size() && !busy[next % slots] && !watch.Stopped() &&
           (static_cast<int>(next) < warmup || warm)) {
      int slot = static_cast<int>(next % slots);
      int i = mine[next++];
      busy[slot] = true;
      uint64_t id = RequestId(i);
      int64_t tokens = TokensOf(cfg, i);
      std::vector<int64_t> blocks;
      for (int64_t b = 0; b < BlocksFor(cfg, true, tokens); ++b) {
        blocks.push_back(BlockId(cfg, bpr, slots, slot, b));
        // Resident prefix blocks were filled once; without verification (benchmarks) the bytes
        // don't matter and filling would be what is measured.
        if (b < cfg.shared_prefix_blocks || !cfg.verify) continue;
        const int64_t valid = std::min<int64_t>(tpb, tokens - b * tpb);
        KVF_RETURN_IF_ERROR(access.Fill(id, {blocks.back(), b * tpb, valid}));
      }
      auto handle = cfg.layer_wise ? side->BeginLayerWise(id, blocks, tokens)
                                   : side->MarkReady(id, blocks, tokens);
      if (!handle.ok()) return handle.status();
      if (cfg.layer_wise) {
        // A stand-in for prefill: each layer "computes" on a stream; its event releases it.
        for (int32_t l = 0; l < me.layer_count; ++l) {
          KVF_RETURN_IF_ERROR(compute->HostCallback(
              [] { std::this_thread::sleep_for(std::chrono::microseconds(20)); }));
          auto ev = std::shared_ptr<Event>(std::move(dev.CreateEvent().value()));
          KVF_RETURN_IF_ERROR(compute->Record(*ev));
          KVF_RETURN_IF_ERROR(side->MarkLayerReadyOn(id, l, ev));
          events[id].push_back(ev);
        }
      }
      if (leader) KVF_RETURN_IF_ERROR(PublishHandle(*rv, id, *handle, DeadlineIn(cfg.timeout)));
      if (cfg.crash_ctx_rank == rank) {
        // Fault injection: die like a crashed process, with the request published and its
        // blocks leased; the other ranks must end their requests without hanging. Only once a
        // generation rank has started fetching it (or after a deadline): a fixed wait let a
        // loaded machine stop the run before any fetch, and then no request met the crash.
        AwaitGenerationStart(cfg, DeadlineIn(cfg.timeout));
        std::this_thread::sleep_for(milliseconds(50));
        std::_Exit(3);
      }
      slot_of[id] = slot;
      ++res.requests;
      live.push_back(id);
      watch.Started();
    }
    for (const TransferStatus& s : side->Poll(1, DeadlineIn(milliseconds(20)))) {
      ++done;
      watch.Ended(s);
      std::erase(live, s.request_id);
      busy[slot_of[s.request_id]] = false;
      events.erase(s.request_id);
      res.bytes += s.bytes;
      res.latencies.push_back(s.seconds);
      // Complete here means every generation rank has it: nobody needs the handle any more.
      if (leader && s.state == TransferState::kComplete) {
        (void)rv->Erase(HandleKey(s.request_id), DeadlineIn(milliseconds(1000)));
      }
      if (s.state != TransferState::kComplete) {
        ++res.failed;
        AddError(res, fmt::format("request {}: {} {}", s.request_id, TransferStateName(s.state),
                                  s.reason.ToString()));
      }
    }
    if (watch.Stopped() && live.empty()) {
      GiveUp(res, "stopped because " + watch.stop_reason(), live, mine.size() - next,
             "run stopped");
      break;
    }
    if (watch.Stalled()) {
      GiveUp(res, StallMessage(watch), live, mine.size() - next, "no request slot became free");
      break;
    }
  }
  res.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  res.cpu_seconds = CpuSeconds() - cpu0;
  NoteEnd(res, *side, live.empty());
  NoteFaultMissed(res, cfg, parts.fault);
  if (cfg.baseline && rank != 0) {
    Status b = BaselineBystander(cfg, make);
    if (!b.ok()) AddError(res, "baseline: " + b.ToString());
  }
  if (cfg.baseline && rank == 0) {
    auto c = CopyBaseline(cfg, dev);
    if (c.ok()) {
      res.copy_gbps = c->gbps;
      res.copy_name = c->name;
    } else {
      AddError(res, "copy baseline: " + c.status().ToString());
    }
    auto b = BaselineSender(cfg, make, dev, {res.copy_gbps, res.copy_name});
    if (b.ok()) {
      res.baseline_gbps = b->gbps;
      res.baseline_name = b->name;
    } else {
      AddError(res, "baseline: " + b.status().ToString());
    }
  }
  KVF_RETURN_IF_ERROR(WriteText(dir / fmt::format("ctx-{}.json", rank), ResultToJson(res)));
  return res;
}

StatusOr<RankResult> RunGenerationRank(const SelftestConfig& cfg, int rank,
                                       const TransportMaker& make) {
  const fs::path dir(cfg.dir);
  RankResult res;
  res.rank = rank;
  const double cpu0 = CpuSeconds();
  KVF_ASSIGN_OR_RETURN(RankMemory m, OpenRankMemory(cfg, false, rank));
  Device& dev = *m.dev;
  const BlockPool& pool = *m.pool;
  PoolAccess& access = *m.access;
  const int64_t bpr = MaxBlocksPerRequest(cfg, false);
  const int64_t tpb = TokensPerBlock(cfg, false);
  const KvScales ctx_scales = SideScales(cfg, true), gen_scales = SideScales(cfg, false);
  KVF_ASSIGN_OR_RETURN(RankTransportParts parts, RankTransport(cfg, false, rank, make));
  std::unique_ptr<Transport> transport = std::move(parts.transport);
  KVF_ASSIGN_OR_RETURN(
      auto side, GenerationSide::Create(dev, pool, SideOptions(cfg, false), std::move(transport)));
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<Rendezvous> rv, ConnectRunRendezvous(cfg));
  MetricsBoard board;  // before the server: the server's thread reads it
  std::unique_ptr<MetricsServer> metrics_server;
  if (cfg.metrics_port >= 0) {
    const std::string name = fmt::format("generation rank {}", rank);
    board.Attach([&side, name] { return std::vector<MetricsSource>{{name, side->metrics()}}; });
    const int port = cfg.metrics_port == 0 ? 0 : cfg.metrics_port + cfg.ctx.world_size() + rank;
    KVF_ASSIGN_OR_RETURN(metrics_server, board.Serve(static_cast<uint16_t>(port), name));
  }
  const RankSlice me = pool.slice();
  const std::vector<int> mine = RequestsOfGroup(cfg, cfg.gen, me.dp_group);
  const int slots = SlotsOf(cfg, false);
  std::vector<bool> busy(slots, false);              // slot k % slots, as on the context side
  std::map<uint64_t, std::pair<int, int>> inflight;  // id -> (request index, slot)
  std::vector<uint64_t> ids;
  for (int i : mine) ids.push_back(RequestId(i));
  HandlePrefetch handles(std::move(rv), std::move(ids), static_cast<size_t>(slots));
  size_t next = 0;
  int done = 0;
  RunWatch watch(cfg, dir / fmt::format("progress-gen-{}", rank), static_cast<int>(mine.size()));
  Clock::time_point start{};
  std::set<uint64_t> warming;  // warm-up requests in flight (cfg.warmup)
  // At least one request of the rank is measured.
  const int warmup = std::min(cfg.warmup, static_cast<int>(mine.size()) - 1);
  // With a shared prefix, the first request brings it; the others wait for it, then reuse it.
  bool prefix_resident = cfg.shared_prefix_blocks == 0;
  bool warm = warmup <= 0;  // the measured requests start once the warm-up ones ended
  const auto rank_start = Clock::now();
  while (done < static_cast<int>(mine.size())) {
    if (!warm && done >= warmup) {
      warm = true;
      NoteWarm(res, *side, done, rank_start);
    }
    bool handle_due = false;  // a free slot waits only for its request's handle
    // Timed requests start once the warm-up ones ended: started beside them (concurrency > 1),
    // their clock ran through the warm-up's connection set-up, first peer mapping (a context rank
    // maps the whole generation pool: 0.1-0.2 s per 2 GiB here) and bytes it does not count.
    while (next < mine.size() && !busy[next % slots] && (next == 0 || prefix_resident) &&
           (static_cast<int>(next) < warmup || warming.empty()) && !watch.Stopped()) {
      int i = mine[next];
      // Nothing in flight: no completion can come, so wait for the handle here; otherwise take it
      // only if it is there, and go on taking completions.
      auto handle = handles.Take(
          next, inflight.empty() ? std::chrono::microseconds(20000) : std::chrono::microseconds(0));
      if (!handle) {
        handle_due = true;
        break;
      }
      int slot = static_cast<int>(next % slots);
      const bool warm_up = static_cast<int>(next) < warmup;
      ++next;
      if (warm_up) warming.insert(RequestId(i));
      if (!warm_up && !warming.empty()) ++res.warmup_overlap;
      if (start == Clock::time_point{} && !warm_up) start = Clock::now();
      watch.Started();
      busy[slot] = true;
      std::vector<int64_t> blocks;
      for (int64_t b = 0; b < BlocksFor(cfg, false, TokensOf(cfg, i)); ++b)
        blocks.push_back(BlockId(cfg, bpr, slots, slot, b));
      const int64_t reused = prefix_resident ? cfg.shared_prefix_blocks : 0;
      Status st = side->Fetch(*handle, blocks, reused);
      ++res.requests;
      if (reused > 0) ++res.prefix_hits;
      if (!st.ok()) {
        ++done;
        watch.Ended(/*progress=*/true);
        ++res.failed;
        busy[slot] = false;
        warming.erase(RequestId(i));
        AddError(res, fmt::format("request {}: fetch refused: {}", RequestId(i), st.ToString()));
        continue;
      }
      inflight[RequestId(i)] = {i, slot};
    }
    // Completions wake the loop at once; a handle due is looked for again every 250 us.
    const auto wait = handle_due && !inflight.empty() ? std::chrono::microseconds(250)
                                                      : std::chrono::microseconds(20000);
    for (const TransferStatus& s : side->Poll(1, Clock::now() + wait)) {
      ++done;
      watch.Ended(s);
      auto [i, slot] = inflight[s.request_id];
      inflight.erase(s.request_id);
      if (warming.erase(s.request_id) == 0) {
        res.bytes += s.bytes;
        res.latencies.push_back(s.seconds);
      }
      bool ok = s.state == TransferState::kComplete;
      if (!ok)
        AddError(res, fmt::format("request {}: {} {}", s.request_id, TransferStateName(s.state),
                                  s.reason.ToString()));
      if (ok && cfg.verify) {
        int64_t tokens = TokensOf(cfg, i);
        for (int64_t b = 0; ok && b < BlocksFor(cfg, false, tokens); ++b) {
          const int64_t valid = std::min<int64_t>(tpb, tokens - b * tpb);
          auto m = access.Check(SeedOf(cfg, b, s.request_id),
                                {BlockId(cfg, bpr, slots, slot, b), b * tpb, valid},
                                cfg.shape.dtype, ctx_scales, gen_scales);
          if (!m.ok() || m->has_value()) {
            ok = false;
            AddError(res, fmt::format("request {} block {}: {}", s.request_id, b,
                                      m.ok() ? (*m)->ToString() : m.status().ToString()));
          }
        }
      }
      if (ok)
        ++res.verified;
      else
        ++res.failed;
      busy[slot] = false;
      if (ok) prefix_resident = true;
    }
    if (watch.Stopped() && inflight.empty()) {
      GiveUp(res, "stopped because " + watch.stop_reason(), {}, mine.size() - next, "run stopped");
      break;
    }
    if (watch.Stalled()) {
      std::vector<uint64_t> live;
      for (const auto& [id, where] : inflight) live.push_back(id);
      const Status looked = handles.LastError();
      GiveUp(res, StallMessage(watch), live, mine.size() - next,
             looked.ok() ? std::string("no handle was published for it")
                         : "no handle was published for it; the last rendezvous look-up: " +
                               looked.ToString());
      break;
    }
  }
  res.seconds = start == Clock::time_point{}
                    ? 0
                    : std::chrono::duration<double>(Clock::now() - start).count();
  res.cpu_seconds = CpuSeconds() - cpu0;
  NoteEnd(res, *side, inflight.empty());
  NoteFaultMissed(res, cfg, parts.fault);
  if (cfg.baseline && rank == 0) {
    auto b = BaselineReceiver(cfg, make, dev);
    if (b.ok()) {
      res.baseline_gbps = b->raw.gbps;
      res.baseline_name = b->raw.name;
      res.copy_gbps = b->copy.gbps;
      res.copy_name = b->copy.name;
    } else {
      AddError(res, "baseline: " + b.status().ToString());
    }
  } else if (cfg.baseline) {
    Status b = BaselineBystander(cfg, make);
    if (!b.ok()) AddError(res, "baseline: " + b.ToString());
  }
  KVF_RETURN_IF_ERROR(WriteText(dir / fmt::format("gen-{}.json", rank), ResultToJson(res)));
  return res;
}

StatusOr<std::vector<RankResult>> RunInProcess(const SelftestConfig& cfg) {
  KVF_RETURN_IF_ERROR(ValidateSelftest(cfg));
  auto fabric = InProcFabric::Create();
  TransportMaker make = [fabric, host = cfg.device == "cpu"]() {
    TransportOptions t;
    t.name = "inproc";
    t.fabric = fabric;
    t.device_memory_is_host = host;  // GPU pools: the in-process transport gets staged bytes
    return CreateTransport(t);
  };
  const int nc = cfg.ctx.world_size(), ng = cfg.gen.world_size();
  std::vector<StatusOr<RankResult>> results(nc + ng, Status::Internal("rank did not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < nc; ++r)
    threads.emplace_back([&, r] { results[r] = RunContextRank(cfg, r, make); });
  for (int r = 0; r < ng; ++r)
    threads.emplace_back([&, r] { results[nc + r] = RunGenerationRank(cfg, r, make); });
  for (auto& t : threads) t.join();
  std::vector<RankResult> out;
  for (auto& r : results) {
    if (!r.ok()) return r.status();
    out.push_back(std::move(r).value());
  }
  return out;
}

}  // namespace kvferry

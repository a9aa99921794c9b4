#include "selftest/soak.h"

#include <fmt/format.h>
#include <malloc.h>
#include <unistd.h>
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVF_SOAK_SANITIZER 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVF_SOAK_SANITIZER 1
#endif
#ifdef KVF_SOAK_SANITIZER
// The sanitizer runtimes' allocator interface (sanitizer/allocator_interface.h, which GCC's
// packages don't install).
extern "C" size_t __sanitizer_get_current_allocated_bytes();
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "selftest/fault_rig.h"
#include "transceiver/wire/handle.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

constexpr int kBlocksPerRequest = 4;
constexpr milliseconds kGrace{1000};  // terminal within deadline + grace, else "late"

struct SoakLayout {
  std::string name;
  RigInstance ctx, gen;
};

std::vector<SoakLayout> Layouts(int64_t pool_blocks) {
  const KvShape mha{6, 4, 16, DType::kFp16, 2, 4};
  const KvShape mla{6, 1, 16, DType::kFp16, 1, 4};
  const auto bm = LayoutKind::kBlockMajor;
  const auto pl = LayoutKind::kPerLayer;
  auto in = [&](KvShape s, ParallelConfig p, LayoutKind l) {
    return RigInstance{s, std::move(p), l, pool_blocks};
  };
  return {
      {"tp1->tp2 (per-layer)", in(mha, {1, 1, {}, 1, 0}, bm), in(mha, {2, 1, {}, 1, 0}, pl)},
      {"tp2->tp1pp2", in(mha, {2, 1, {}, 1, 0}, bm), in(mha, {1, 2, {}, 1, 0}, bm)},
      {"tp4dp2->tp2", in(mha, {4, 1, {}, 2, 0}, bm), in(mha, {2, 1, {}, 1, 0}, bm)},
      {"pp3(1,4,1) per-layer->tp2dp2", in(mha, {1, 3, {1, 4, 1}, 1, 0}, pl),
       in(mha, {2, 1, {}, 2, 0}, bm)},
      {"mla tp2->tp1", in(mla, {2, 1, {}, 1, 0}, bm), in(mla, {1, 1, {}, 1, 0}, bm)},
  };
}

// The run queue per core, 1 to 4: how much longer than on an idle machine a request may take to
// report when the soak shares a loaded one (its threads then wait seconds for a core). On an idle
// machine, or in CI, 1.
double LoadScale() {
  double load = 0;
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  if (getloadavg(&load, 1) != 1) return 1;
  return std::clamp(load / cores, 1.0, 4.0);
}

struct Rss {
  double total_mib = 0;  // VmRSS
  double anon_mib = 0;   // RssAnon: heap, stacks, anonymous maps (not code pages of libraries)
};

// Resident memory after the allocator returned what it caches (malloc_trim).
Rss ReadRss() {
  malloc_trim(0);
  Rss r;
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    int64_t kb = 0;
    if (std::sscanf(line.c_str(), "VmRSS: %ld kB", &kb) == 1) r.total_mib = kb / 1024.0;
    if (std::sscanf(line.c_str(), "RssAnon: %ld kB", &kb) == 1) r.anon_mib = kb / 1024.0;
  }
  return r;
}

#ifdef KVF_SOAK_SANITIZER
constexpr bool kSanitizer = true;
// Bytes the sanitizer's allocator has handed out and not had back (it replaces malloc, so
// mallinfo2 sees none).
double HeapMiB() {
  return static_cast<double>(__sanitizer_get_current_allocated_bytes()) / (1 << 20);
}
#else
constexpr bool kSanitizer = false;
// Bytes malloc has handed out and not had back (arenas and mmapped chunks).
double HeapMiB() {
  struct mallinfo2 m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd) / (1 << 20);
}
#endif

using RankKey = std::pair<bool, int>;  // (context, rank)

struct LiveRequest {
  uint64_t id = 0;
  int slot = 0;
  int gen_group = 0;
  int64_t tokens = 0;
  std::vector<int64_t> blocks;
  Clock::time_point start;
  std::map<RankKey, int> expected;
  std::map<RankKey, std::vector<TransferState>> got;
  std::optional<Clock::time_point> cancel_at;
  RankKey cancel_on{};
  bool forged = false;  // fetched with a forged handle: the context ranks must not answer it
  bool Ended() const {
    for (const auto& [k, n] : expected) {
      auto it = got.find(k);
      if (it == got.end() || static_cast<int>(it->second.size()) < n) return false;
    }
    return true;
  }
};

class Soak {
 public:
  Soak(const SoakConfig& cfg, const SoakProgress& progress)
      : cfg_(cfg), progress_(progress), rng_(cfg.seed) {}

  StatusOr<SoakReport> Run() {
    const auto layouts = Layouts(int64_t{cfg_.concurrency} * kBlocksPerRequest);
    for (const auto& l : layouts) report_.layouts.push_back(l.name);
    const auto start = Clock::now();
    const auto until = start + cfg_.duration;
    bool quarter_taken = false;
    while (true) {
      const bool by_time = cfg_.duration.count() > 0;
      if (by_time ? Clock::now() >= until : issued_ >= cfg_.requests) break;
      const SoakLayout& layout = layouts[report_.epochs % layouts.size()];
      int64_t n = cfg_.epoch_requests;
      if (!by_time) n = std::min<int64_t>(n, cfg_.requests - issued_);
      KVF_RETURN_IF_ERROR(Epoch(layout, n, by_time ? std::optional(until) : std::nullopt));
      ++report_.epochs;
      const Rss rss = ReadRss();
      const double done = by_time ? std::chrono::duration<double>(Clock::now() - start) /
                                        std::chrono::duration<double>(cfg_.duration)
                                  : static_cast<double>(issued_) / cfg_.requests;
      const double heap = HeapMiB();
      if (!quarter_taken && done >= 0.25) {
        report_.rss_quarter_mib = rss.total_mib;
        report_.anon_quarter_mib = rss.anon_mib;
        report_.heap_quarter_mib = heap;
        quarter_taken = true;
      }
      report_.rss_end_mib = rss.total_mib;
      report_.anon_end_mib = rss.anon_mib;
      report_.heap_end_mib = heap;
      report_.seconds = std::chrono::duration<double>(Clock::now() - start).count();
      report_.requests = issued_;
      if (progress_) progress_(report_);
    }
    report_.requests = issued_;
    report_.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    report_.requests_per_second = report_.seconds > 0 ? issued_ / report_.seconds : 0;
    auto growth = [](double from, double to) { return from > 0 ? 100.0 * (to - from) / from : 0; };
    report_.rss_growth_pct = growth(report_.rss_quarter_mib, report_.rss_end_mib);
    report_.anon_growth_pct = growth(report_.anon_quarter_mib, report_.anon_end_mib);
    report_.heap_growth_pct = growth(report_.heap_quarter_mib, report_.heap_end_mib);
    report_.sanitizer = kSanitizer;
    report_.growth_pct = kSanitizer ? report_.heap_growth_pct : report_.rss_growth_pct;
    return report_;
  }

 private:
  void Error(std::string what) {
    if (report_.errors.size() < 8) report_.errors.push_back(std::move(what));
  }

  double Uniform() { return std::uniform_real_distribution<double>(0, 1)(rng_); }
  int Pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }

  // Counts the fault armed on a transport if it fired, and forgets it.
  void Settle(FaultRig& rig, const RankKey& where) {
    auto it = arms_.find(where);
    if (it == arms_.end()) return;
    if (rig.faulty(where.first, where.second).fired() > it->second.fired_before) {
      ++report_.faults_by_step[std::string(FaultStepName(it->second.spec.step))];
      ++report_.faults_by_kind[std::string(FaultKindName(it->second.spec.kind))];
    }
    arms_.erase(it);
  }

  // Arms one transport of the serving ranks of request `q` for the next occurrence of a step: the
  // FETCH of a forged fetch, the ABORT of a cancel, or else a random step of a transfer.
  void MaybeArm(FaultRig& rig, int ctx_group, const LiveRequest& q) {
    int64_t armed = 0;
    for (bool c : {true, false}) {
      for (int r = 0; r < rig.ranks(c); ++r) armed += rig.faulty(c, r).armed();
    }
    // Forged fetches and cancels are rare: their FETCH is faulted whenever faults are on at all,
    // their ABORT more often than the rate alone would (the others make room: the rate counts
    // every fault).
    const bool due = injected_before_ + rig.FaultsFired() + armed < cfg_.fault_rate * (issued_ + 1);
    const bool extra = cfg_.fault_rate > 0 && (q.forged || (q.cancel_at && Pick(4) == 0));
    if (!due && !extra) return;
    static constexpr FaultStep kSteps[] = {FaultStep::kFetch,  FaultStep::kAccept,
                                           FaultStep::kCredit, FaultStep::kData,
                                           FaultStep::kDone,   FaultStep::kComplete};
    // Crashes end an epoch (its ranks can't serve): rarer than the others.
    static constexpr FaultKind kKinds[] = {FaultKind::kStall, FaultKind::kDrop,
                                           FaultKind::kDuplicate, FaultKind::kCorrupt};
    const bool context = Pick(2) == 0;
    const std::vector<int> group = rig.Group(context, context ? ctx_group : q.gen_group);
    const int rank = group[Pick(static_cast<int>(group.size()))];
    FaultSpec spec;
    spec.step = q.forged      ? FaultStep::kFetch
                : q.cancel_at ? FaultStep::kAbort
                              : kSteps[Pick(std::size(kSteps))];
    spec.nth = 1;
    const bool crash = cfg_.transport == "inproc" && Pick(20) == 0;
    spec.kind = crash ? FaultKind::kCrash : kKinds[Pick(std::size(kKinds))];
    spec.stall =
        milliseconds(static_cast<int64_t>(cfg_.timeout.count() * (0.25 + 1.25 * Uniform())) + 1);
    Settle(rig, {context, rank});
    arms_[{context, rank}] = Arm{spec, rig.faulty(context, rank).fired()};
    rig.faulty(context, rank).Arm(spec);
    if (crash) crash_armed_.push_back({context, rank});
  }

  bool Crashed(FaultRig& rig) const {
    for (const auto& [c, r] : crash_armed_) {
      if (rig.faulty(c, r).fired() > 0) return true;
    }
    return false;
  }

  Status Start(FaultRig& rig, int slot) {
    LiveRequest q;
    q.id = ++next_id_;
    q.slot = slot;
    const int ctx_group = Pick(rig.groups(true));
    q.gen_group = Pick(rig.groups(false));
    q.tokens = 1 + Pick(kBlocksPerRequest * rig.spec(true).shape.tokens_per_block);
    const int64_t nblocks = (q.tokens + rig.spec(true).shape.tokens_per_block - 1) /
                            rig.spec(true).shape.tokens_per_block;
    for (int64_t b = 0; b < nblocks; ++b) q.blocks.push_back(slot * kBlocksPerRequest + b);
    q.start = Clock::now();
    if (Uniform() < cfg_.forge_rate) {
      q.forged = true;
      ++report_.forged;
    } else if (Uniform() < cfg_.cancel_rate) {
      ++report_.cancels;
      q.cancel_at = q.start + std::chrono::microseconds(Pick(4000));
      const bool context = Pick(2) == 0;
      const std::vector<int> group = rig.Group(context, context ? ctx_group : q.gen_group);
      q.cancel_on = {context, group[Pick(static_cast<int>(group.size()))]};
    }
    MaybeArm(rig, ctx_group, q);
    auto handle = rig.Publish(q.id, q.blocks, q.tokens, ctx_group, false);
    if (!handle.ok()) return handle.status().WithContext(fmt::format("request {}", q.id));
    for (int r : rig.Group(true, ctx_group)) q.expected[{true, r}] = 1;
    std::vector<std::byte> fetched = *handle;
    if (q.forged) {  // the access token altered: no answer, then both sides' deadlines
      KVF_ASSIGN_OR_RETURN(ContextHandle h, DecodeHandle(fetched));
      h.token[0] ^= 1;
      fetched = EncodeHandle(h);
    }
    Status st = rig.Fetch(fetched, q.blocks, q.gen_group);
    for (int r : rig.Group(false, q.gen_group)) {
      // A rank that refused at the call (a dead context rank) started nothing.
      if (rig.gen(r).Query(q.id).ok()) q.expected[{false, r}] = 1;
    }
    ++issued_;
    live_.emplace(q.id, std::move(q));
    return Status::Ok();
  }

  void Finish(FaultRig& rig, LiveRequest& q) {
    std::string state = "complete";
    for (const auto& [k, list] : q.got) {
      for (TransferState s : list) {
        ++report_.rank_states[std::string(TransferStateName(s))];
        if (s != TransferState::kComplete && state == "complete")
          state = std::string(TransferStateName(s));
      }
      auto it = q.expected.find(k);
      if (it == q.expected.end() || static_cast<int>(list.size()) != it->second) {
        ++report_.not_exactly_once;
        Error(fmt::format("request {}: {} rank {} reported {} terminal states", q.id,
                          k.first ? "context" : "generation", k.second, list.size()));
      }
    }
    ++report_.request_states[state];
    if (state == "complete" && cfg_.verify) {
      Status v = rig.Verify(q.id, q.blocks, q.tokens, q.gen_group);
      if (!v.ok()) {
        ++report_.verify_failures;
        Error(v.ToString());
      }
    }
  }

  void Collect(FaultRig& rig, std::vector<bool>& busy) {
    for (RigReport& r : rig.PollAll(milliseconds(1))) {
      auto it = live_.find(r.status.request_id);
      if (it == live_.end()) {
        ++report_.not_exactly_once;
        Error(fmt::format("request {}: a terminal state ({}) after the request had ended",
                          r.status.request_id, TransferStateName(r.status.state)));
        continue;
      }
      if (r.status.seconds > std::chrono::duration<double>(cfg_.timeout + kGrace).count())
        ++report_.late;
      it->second.got[{r.context, r.rank}].push_back(r.status.state);
    }
    const auto now = Clock::now();
    if (now >= load_read_ + std::chrono::seconds(1)) {
      load_scale_ = LoadScale();
      load_read_ = now;
    }
    const auto never_ended =
        std::chrono::duration_cast<Clock::duration>((cfg_.timeout * 3 + kGrace) * load_scale_);
    for (auto it = live_.begin(); it != live_.end();) {
      LiveRequest& q = it->second;
      if (q.cancel_at && now >= *q.cancel_at) {
        q.cancel_at.reset();
        if (q.cancel_on.first)
          (void)rig.ctx(q.cancel_on.second).Cancel(q.id);
        else
          (void)rig.gen(q.cancel_on.second).Cancel(q.id);
      }
      if (q.Ended()) {
        Finish(rig, q);
        busy[q.slot] = false;
        it = live_.erase(it);
      } else if (now > q.start + never_ended) {
        // Never ended: a broken promise. Its slot stays out of use (its blocks may be leased).
        ++report_.not_exactly_once;
        Error(fmt::format("request {}: some ranks never reported a terminal state", q.id));
        it = live_.erase(it);
      } else {
        ++it;
      }
    }
  }

  Status Epoch(const SoakLayout& layout, int64_t n, std::optional<Clock::time_point> until) {
    TransceiverOptions o;
    o.transport = cfg_.transport;
    o.timeout = cfg_.timeout;
    o.chunk_bytes = 1024;
    o.staging_chunks = 3;
    o.direct_min_bytes = 512;
    // Both data paths in turn (one-sided puts; tagged messages), checksums on: a corrupted or
    // lost chunk fails its request rather than completing it with wrong bytes.
    o.rma = report_.epochs % 2 == 0;
    o.checksum = true;
    KVF_ASSIGN_OR_RETURN(auto rig, FaultRig::Create(layout.ctx, layout.gen, o, cfg_.transport));
    BoardScope board(cfg_.metrics, [&rig] {
      std::vector<MetricsSource> s;
      for (int r = 0; r < rig->ranks(true); ++r)
        s.push_back({fmt::format("ctx{}", r), rig->ctx(r).metrics()});
      for (int r = 0; r < rig->ranks(false); ++r)
        s.push_back({fmt::format("gen{}", r), rig->gen(r).metrics()});
      return s;
    });
    crash_armed_.clear();
    std::vector<bool> busy(cfg_.concurrency, false);
    int64_t started = 0;
    while (true) {
      const bool more = started < n && !Crashed(*rig) && (!until || Clock::now() < *until);
      if (!more && live_.empty()) break;
      for (int s = 0; more && s < cfg_.concurrency && started < n; ++s) {
        if (busy[s]) continue;
        busy[s] = true;
        ++started;
        KVF_RETURN_IF_ERROR(Start(*rig, s));
      }
      Collect(*rig, busy);
    }
    injected_before_ += rig->FaultsFired();
    report_.faults_injected = injected_before_;
    while (!arms_.empty()) Settle(*rig, arms_.begin()->first);
    rig->DisarmAll();
    // Leaks: every request ended; the counters must come back to zero.
    TransceiverStats t = rig->Totals();
    const Deadline d = DeadlineIn(kGrace);
    while ((t.live_requests != 0 || t.staging_slots_in_use != 0) && Clock::now() < d) {
      std::this_thread::sleep_for(milliseconds(2));
      for (RigReport& r : rig->PollAll(milliseconds(0))) {
        ++report_.not_exactly_once;
        Error(
            fmt::format("request {}: a terminal state after the epoch ended", r.status.request_id));
      }
      t = rig->Totals();
    }
    if (t.live_requests != 0 || t.staging_slots_in_use != 0) {
      Error(fmt::format("layout {}: {} leases and {} staging slots left", layout.name,
                        t.live_requests, t.staging_slots_in_use));
    }
    report_.leaked_leases += t.live_requests;
    report_.leaked_staging += t.staging_slots_in_use;
    return Status::Ok();
  }

  const SoakConfig cfg_;
  const SoakProgress progress_;
  std::mt19937_64 rng_;
  SoakReport report_;
  std::map<uint64_t, LiveRequest> live_;
  std::vector<RankKey> crash_armed_;
  struct Arm {
    FaultSpec spec;
    int64_t fired_before = 0;  // the transport's fired() when armed
  };
  std::map<RankKey, Arm> arms_;
  double load_scale_ = 1;          // LoadScale(), read at most once a second
  Clock::time_point load_read_{};  // the fault last armed on each transport, until counted
  int64_t issued_ = 0;
  int64_t injected_before_ = 0;
  uint64_t next_id_ = 0;
};

}  // namespace

StatusOr<SoakReport> RunSoak(const SoakConfig& config, const SoakProgress& progress) {
  if (config.requests < 1 && config.duration.count() <= 0)
    return Status::InvalidArgument(
        fmt::format("soak: requests={} and no duration: nothing to run", config.requests));
  if (config.concurrency < 1 || config.concurrency > 256)
    return Status::InvalidArgument(
        fmt::format("soak: concurrency={} is outside [1, 256]", config.concurrency));
  if (config.epoch_requests < 1)
    return Status::InvalidArgument(
        fmt::format("soak: epoch_requests={} must be positive", config.epoch_requests));
  if (config.timeout.count() < 1)
    return Status::InvalidArgument(
        fmt::format("soak: timeout={} ms must be positive", config.timeout.count()));
  for (double rate : {config.fault_rate, config.cancel_rate, config.forge_rate}) {
    if (!(rate >= 0 && rate <= 1))
      return Status::InvalidArgument(fmt::format("soak: rate {} is outside [0, 1]", rate));
  }
  if (config.transport != "inproc" && config.transport != "ucx")
    return Status::InvalidArgument(
        fmt::format("soak: transport '{}' (expected inproc or ucx)", config.transport));
  Soak soak(config, progress);
  return soak.Run();
}

}  // namespace kvferry

// `kvferry soak --processes`: the soak over UCX with one process per rank, as `selftest` runs
// them, so that a crash fault is a process dying (the in-process soak's UCX variant can't crash a
// rank: its workers share one process).
//
// Each epoch is one multi-process run (RunCluster) of a split in turn, with one fault at a random
// protocol step (FETCH, ACCEPT, REJECT, CREDIT, DATA, DONE, COMPLETE, ABORT: steps a run never
// takes simply never fire) of a random rank, of a random kind (crash about a third of the time,
// else stall, drop, duplicate, corrupt). Per epoch it checks what must hold whatever the fault:
//   - the run ends by itself: every request reached a terminal state on every surviving rank
//     (a rank that gave up with requests that "never ended" breaks the promise);
//   - only the crashed rank has no result (any other rank without one died or hung);
//   - no completed request holds wrong bytes (the generation ranks check every element).
// RankGroup reaps every process and removes the run's directory however the run ended
// (cli.no_orphans_* check that part).
#include "tools/kvferry/process_soak.h"

#include <fmt/format.h>

#include <random>

#include "testing/faulty_transport.h"
#include "tools/kvferry/cluster.h"

namespace kvferry::tools {
namespace {

struct Split {
  const char* name;
  ParallelConfig ctx, gen;
  LayoutKind ctx_layout, gen_layout;
};

bool Contains(const std::vector<std::string>& errors, std::string_view what) {
  for (const std::string& e : errors) {
    if (e.find(what) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

StatusOr<ProcessSoakReport> RunProcessSoak(
    const ProcessSoakConfig& cfg, const std::function<void(const ProcessSoakReport&)>& progress) {
  if (cfg.requests < 1 || cfg.epoch_requests < 1 || cfg.epoch_requests > 1000) {
    return Status::InvalidArgument(
        fmt::format("soak --processes: requests={} and epoch_requests={} (1 to 1000) must be "
                    "positive",
                    cfg.requests, cfg.epoch_requests));
  }
  const auto bm = LayoutKind::kBlockMajor;
  const auto pl = LayoutKind::kPerLayer;
  const Split splits[] = {
      {"tp2->tp1", {2, 1, {}, 1, 0}, {1, 1, {}, 1, 0}, bm, bm},
      {"tp1->tp2 (per-layer)", {1, 1, {}, 1, 0}, {2, 1, {}, 1, 0}, bm, pl},
      {"tp2->tp1pp2", {2, 1, {}, 1, 0}, {1, 2, {}, 1, 0}, bm, bm},
  };
  static constexpr FaultKind kOthers[] = {FaultKind::kStall, FaultKind::kDrop,
                                          FaultKind::kDuplicate, FaultKind::kCorrupt};
  std::mt19937_64 rng(cfg.seed);
  auto pick = [&](int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); };
  ProcessSoakReport rep;
  auto error = [&](std::string what) {
    ++rep.broken;
    if (rep.errors.size() < 8) rep.errors.push_back(std::move(what));
  };
  const auto start = Clock::now();
  for (int64_t done = 0; done < cfg.requests; ++rep.epochs) {
    const Split& split = splits[rep.epochs % std::size(splits)];
    SelftestConfig c;
    c.shape = KvShape{6, 4, 16, DType::kBf16, 2, 8};
    c.ctx = split.ctx;
    c.gen = split.gen;
    c.ctx_layout.kind = split.ctx_layout;
    c.gen_layout.kind = split.gen_layout;
    c.requests = static_cast<int>(std::min<int64_t>(cfg.epoch_requests, cfg.requests - done));
    c.prompt_tokens = {40};
    c.concurrency = 4;
    c.transport = "ucx";
    c.device = "cpu";
    c.timeout = cfg.timeout;
    c.checksum = true;
    FaultPoint f;
    f.context = pick(2) == 0;
    f.rank = pick((f.context ? c.ctx : c.gen).world_size());
    f.spec.step = kAllFaultSteps[pick(static_cast<int>(std::size(kAllFaultSteps)))];
    f.spec.nth = 1 + pick(3);
    const bool crash = pick(3) == 0;
    f.spec.kind = crash ? FaultKind::kCrash : kOthers[pick(static_cast<int>(std::size(kOthers)))];
    f.spec.stall = std::chrono::milliseconds(cfg.timeout.count() / 2 + pick(cfg.timeout.count()));
    c.fault = FaultPointString(f);
    const std::string epoch =
        fmt::format("epoch {} ({}, fault {})", rep.epochs, split.name, c.fault);
    ++rep.faults_by_kind[std::string(FaultKindName(f.spec.kind))];
    ++rep.faults_by_step[std::string(FaultStepName(f.spec.step))];
    done += c.requests;
    rep.requests += c.requests;
    auto ranks = RunCluster(c);
    if (!ranks.ok()) {
      error(fmt::format("{}: {}", epoch, ranks.status().ToString()));
      continue;
    }
    bool crashed = false;
    for (const RankResult& r : *ranks) {
      const std::string who =
          fmt::format("{} rank {}", r.context ? "context" : "generation", r.rank);
      const bool faulted = r.context == f.context && r.rank == f.rank;
      if (Contains(r.errors, "no result (")) {
        if (crash && faulted) {
          crashed = true;
        } else {
          error(fmt::format("{}: {} has no result: {}", epoch, who, r.errors.front()));
        }
        continue;
      }
      if (Contains(r.errors, "never ended"))
        error(fmt::format("{}: {} has requests that never ended", epoch, who));
      // A generation rank names a completed request whose bytes were wrong by its block.
      if (!r.context && Contains(r.errors, " block ")) {
        ++rep.verify_failures;
        error(fmt::format("{}: {} holds wrong bytes in a completed request", epoch, who));
      }
    }
    rep.crashed_epochs += crashed;
    const SelftestSummary s = Summarize(c, *ranks);
    rep.verified += s.verified;
    rep.failed += s.failed;
    rep.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (progress) progress(rep);
  }
  rep.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return rep;
}

}  // namespace kvferry::tools

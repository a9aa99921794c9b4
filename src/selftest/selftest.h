// The self-test and transfer benchmark engine behind `kvferry selftest` and `kvferry bench
// transfer`: a context instance and a generation instance, one rank per process (or per thread
// for the in-process transport), a stream of requests, every received element checked against the
// test-data generator.
//
// Ranks find each other through the TCP rendezvous (kvferry/rendezvous.h) that the parent runs, as
// a deployment would: context rank 0 publishes the instance secret, every context rank its
// address, the lowest rank of a request's serving DP group its handle (the router's job in a real
// deployment); the handle of a request complete everywhere is erased. Results and progress go to
// the run directory (ctx-R.json / gen-R.json), written to a temporary name and renamed, so readers
// never see half a file.
//
// Files: the rank loops here (selftest.cc) stand on the run's config (selftest_config.h), its
// files (run_files.h) and its same-run baselines (baseline.h); the baselines stand on the config
// and the files only, so nothing calls back into the rank loops. The aggregate (Summarize) is in
// summary.cc.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvferry/kv_model.h"
#include "kvferry/metrics.h"
#include "kvferry/status.h"
#include "selftest/run_files.h"
#include "selftest/selftest_config.h"

namespace kvferry {

struct RankResult {
  bool context = false;
  int rank = 0;
  int requests = 0;  // requests this rank took part in
  int verified = 0;  // generation: requests complete (and, with cfg.verify, checked element-wise)
  int failed = 0;
  int prefix_hits = 0;  // generation: requests that reused the resident prefix
  // Generation: timed requests fetched while a warm-up request was still in flight (their time
  // would include the warm-up's connection set-up, peer mappings and bytes); 0 by design.
  int warmup_overlap = 0;
  int64_t bytes = 0;
  double seconds = 0;              // first start to last end on this rank
  double cpu_seconds = 0;          // process CPU time over the run
  double control_cpu_seconds = 0;  // the transceiver's busy progress-thread CPU (its stats())
  double thread_cpu_seconds = 0;   // all of its progress-thread CPU (idle polling too)
  // The same once this rank's warm-up requests (cfg.warmup) ended, how many those were, and when
  // (seconds after start): the measured requests' control CPU is the difference.
  double control_cpu_warm_seconds = 0;
  double thread_cpu_warm_seconds = 0;
  int warm_requests = 0;
  double warm_at_seconds = 0;
  // The side's metrics().profile (transfer.profile) at the end and once warm; empty when off.
  std::vector<std::pair<std::string, double>> profile, profile_warm;
  std::vector<double> latencies;  // per request, seconds (generation: fetch to complete)
  double baseline_gbps = 0;       // raw transport bandwidth, same processes, same bytes (rank 0s)
  std::string baseline_name;
  double copy_gbps =
      0;  // one memcpy / cudaMemcpy of the same bytes in ctx rank 0 (gen rank 0 hears it)
  std::string copy_name;
  std::vector<std::string> errors;  // the first few
  // cfg.fault names this rank and it never fired (its step was not reached): the run fails.
  bool fault_missed = false;
  // Request leases and staging slots the side still held once every request it started had been
  // reported (checked only then; a rank that gave up on live requests is not): the run fails.
  int64_t leaked = 0;
  std::string data_path;  // the transceiver's (metrics): peer-memory, one-sided, tagged
  // This rank's slowest request (the longest from start to terminal), when one ended.
  std::optional<RequestTimeline> slowest;
  // Where a typical request of this rank spent its time: MedianTimeline of its recent requests.
  std::optional<RequestTimeline> median;
};

std::string ResultToJson(const RankResult& r);
StatusOr<RankResult> ResultFromJson(const std::string& text);

// Runs one rank to the end and writes its result file. `make_transport` overrides cfg.transport
// (the in-process transport needs a shared fabric).
StatusOr<RankResult> RunContextRank(const SelftestConfig& cfg, int rank,
                                    const TransportMaker& make_transport);
StatusOr<RankResult> RunGenerationRank(const SelftestConfig& cfg, int rank,
                                       const TransportMaker& make_transport);
// Every rank as a thread of this process over the in-process transport.
StatusOr<std::vector<RankResult>> RunInProcess(const SelftestConfig& cfg);

// The aggregate over all ranks: what the command prints.
struct SelftestSummary {
  int requests = 0, verified = 0, failed = 0;
  // Requests that ended complete on every generation rank; `verified` counts those also checked
  // element by element, so it is 0 when verification is off (cfg.verify false).
  int completed = 0;
  int prefix_hits = 0;     // (request, generation rank) pairs that reused the resident prefix
  int warmup_overlap = 0;  // RankResult::warmup_overlap, summed over generation ranks
  int64_t bytes = 0;       // payload bytes received by the generation instance
  double seconds = 0;      // wall time of the generation instance (max over ranks)
  double gbps = 0;
  double p50_ms = 0, p90_ms = 0, p99_ms = 0;
  double cpu_us_per_request = 0;  // process CPU of all ranks / requests
  // Transceiver progress-thread CPU in iterations that did work, all ranks of both instances,
  // per measured request (warm-up requests and the set-up they carry left out): the control
  // plane's cost (plus posting operations; no idle polling). The second counts every request,
  // warm-up included.
  double control_cpu_us_per_request = 0;
  double control_cpu_with_warmup_us_per_request = 0;
  // All progress-thread CPU per measured request, all ranks: the above plus idle polling and nap
  // wake-ups (what the transceiver costs the cores while requests are in flight).
  double thread_cpu_us_per_request = 0;
  // transfer.profile, per side ("context", "generation"), measured requests only: "<phase>_cpu_s"
  // and counters summed over the side's ranks per request (CPU in microseconds), and on the
  // context side "copy_busy" (the copy streams' busy time over the measured wall time, mean of the
  // ranks) and "copy_busy_min".
  std::vector<std::pair<std::string, std::vector<std::pair<std::string, double>>>> profile;
  double baseline_gbps = 0;
  std::string baseline_name;
  double copy_gbps = 0;
  std::string copy_name;
  std::vector<std::string> errors;
  // A rank's RankResult::fault_missed: the injected fault never fired, so the run tested nothing.
  bool fault_missed = false;
  int64_t leaked = 0;  // the ranks' RankResult::leaked, summed
  // The generation ranks' data paths (peer-memory, one-sided, tagged), distinct ones joined by +.
  std::string data_path;
};
SelftestSummary Summarize(const SelftestConfig& cfg, const std::vector<RankResult>& ranks);
// Summarize's parts for the measured requests (summary.cc): progress-thread CPU per request in
// seconds, all ranks (`total` - `warm` of each rank: control_cpu_* for the busy iterations,
// thread_cpu_* for all); SelftestSummary::profile.
double MeasuredCpu(const SelftestConfig& cfg, const std::vector<RankResult>& ranks,
                   double RankResult::*total, double RankResult::*warm);
std::vector<std::pair<std::string, std::vector<std::pair<std::string, double>>>> MeasuredProfile(
    const SelftestConfig& cfg, const std::vector<RankResult>& ranks);
// The median request of complete timelines, each phase counted from the fetch (the FETCH sent on
// a generation rank, received on a context rank: a context rank's requests wait for it from
// publication): fetch 0, then the medians of first byte, last byte and end after it, bytes and
// chunks. Phases a timeline never reached are left out of their median (-1 when none reached
// them); nullopt without a complete timeline that was fetched.
std::optional<RequestTimeline> MedianTimeline(const std::vector<RequestTimeline>& timelines);

}  // namespace kvferry

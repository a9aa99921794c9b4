// The soak behind `kvferry soak`: thousands of requests through context and generation instances
// of several splits and layouts in turn (one FaultRig per epoch), with random cancels from either
// side and faults injected at random protocol steps through FaultyTransport, checking what must
// hold however long it runs:
//   - every (request, rank) that took the request ends in exactly one terminal state (one that
//     has not within 3 deadlines + 1 s, times the run queue per core on a loaded machine, never
//     ended);
//   - no lease and no staging slot is left on any side once an epoch's requests have ended;
//   - completed requests hold the right bytes (every element checked);
//   - memory does not grow: RSS at the end of the first quarter vs at the end (after malloc_trim;
//     `kvferry soak` also limits malloc to one arena, see there), with anonymous RSS (RssAnon)
//     and malloc's bytes in use beside it. Under ASan or TSan the growth is that of the bytes the
//     sanitizer's allocator has handed out and not had back: there RSS is mostly the sanitizer's
//     shadow and history, which grow with the run with no byte leaked (a 300-request UCX soak:
//     +2% RSS plain, +45-51% under TSan).
//
// Faults: every few requests (--fault-rate) a transport of the serving ranks is armed for the next
// occurrence of a random step (FETCH, ACCEPT, CREDIT, DATA, DONE, COMPLETE; ABORT when the request
// will be cancelled, its FETCH when it is fetched with a forged handle) with a random kind (crash,
// stall, drop, duplicate, corrupt); "injected" counts faults that fired. A crash ends its epoch
// early (its ranks can't serve); the next epoch starts on fresh transports. Epochs alternate the
// one-sided and the tagged data path; per-chunk checksums are on, so a corrupted or lost chunk must
// fail its request (a completed request with wrong bytes is a verify failure). A few requests
// (--forge-rate) are fetched with a forged handle (access token altered): the context ranks must
// leave their FETCHes unanswered (wire version 9: an answer would connect back to an address
// nothing vouched for), so both sides end them at their deadlines.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kvferry/status.h"
#include "selftest/metrics_board.h"

namespace kvferry {

struct SoakConfig {
  int64_t requests = 10000;
  std::chrono::seconds duration{0};  // > 0: run this long instead (the long soak)
  double fault_rate = 0.06;          // faults armed per request
  double cancel_rate = 0.05;         // requests cancelled at a random moment, either side
  double forge_rate = 0.01;          // requests fetched with a forged handle (no answer)
  int concurrency = 16;              // requests in flight
  int epoch_requests = 400;          // requests per rig before the next layout
  std::chrono::milliseconds timeout{300};
  std::string transport = "inproc";  // or "ucx" (crash faults are then left out)
  uint64_t seed = 1;
  bool verify = true;
  MetricsBoard* metrics = nullptr;  // when set: every epoch's sides, while it runs (--metrics-port)
};

struct SoakReport {
  int64_t requests = 0;
  int64_t faults_injected = 0;
  int64_t cancels = 0;
  int64_t forged = 0;
  std::map<std::string, int64_t> faults_by_step;  // fired faults per step ("ABORT", ...)
  std::map<std::string, int64_t> faults_by_kind;  // fired faults per kind ("crash", ...)
  int64_t epochs = 0;
  std::map<std::string, int64_t> request_states;  // per request: complete if every rank completed,
                                                  // else the first other state a rank reported
  std::map<std::string, int64_t> rank_states;     // per (request, rank) report
  int64_t not_exactly_once = 0;  // (request, rank) pairs with no terminal state, or several
  int64_t late = 0;              // terminal after deadline + grace
  int64_t leaked_leases = 0;     // live requests left on a side at the end of an epoch
  int64_t leaked_staging = 0;    // staging slots left in use at the end of an epoch
  int64_t verify_failures = 0;   // completed requests whose bytes were wrong
  double rss_quarter_mib = 0, rss_end_mib = 0, rss_growth_pct = 0;     // VmRSS
  double anon_quarter_mib = 0, anon_end_mib = 0, anon_growth_pct = 0;  // RssAnon
  // Allocated and not freed: mallinfo2, or the sanitizer's allocator in a sanitizer build.
  double heap_quarter_mib = 0, heap_end_mib = 0, heap_growth_pct = 0;
  bool sanitizer = false;  // a sanitizer build: growth_pct is the heap's, not RSS's
  double growth_pct = 0;   // what the soak's limit applies to
  double seconds = 0, requests_per_second = 0;
  std::vector<std::string> layouts;
  std::vector<std::string> errors;  // the first few
};

using SoakProgress = std::function<void(const SoakReport&)>;
StatusOr<SoakReport> RunSoak(const SoakConfig& config, const SoakProgress& progress = {});

}  // namespace kvferry

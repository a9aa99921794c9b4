// Metrics: value snapshots of what a transceiver side and a transfer manager did, and per-request
// timelines. Why snapshots: an engine already owns the objects (sides, managers); asking each for a
// copy of its counters needs no global registry to keep in sync with objects that come and go, and
// the same value feeds the Prometheus text (kvferry/prometheus.h), the CLI's --json and Python.
//
// Cost. Counters and histograms are relaxed atomics updated by the thread that does the work (the
// side's progress thread, the transfer manager's caller or I/O thread), a handful per chunk or
// batch, never per block; a timeline is one small record per request. Snapshots may be taken from
// any thread at any time; counters taken together are not one atomic cut (a request may be counted
// as ended while its bytes are not yet added), which is what scrapers expect.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

// A latency histogram over fixed buckets: bucket i holds values <= 1 us * 2^i (i < kBuckets), the
// last one everything larger (+Inf). 1 us to 2^26 us (67 s) covers a chunk copy to a deadline.
class LatencyHistogram {
 public:
  static constexpr int kBuckets = 27;   // finite upper bounds
  static double UpperBound(int i);      // seconds; +inf for i == kBuckets
  static int BucketOf(double seconds);  // the bucket a value falls in
  void Add(double seconds);             // not thread-safe (a snapshot is a value)
  int64_t count() const { return count_; }
  double sum() const { return sum_; }                                          // seconds
  const std::array<int64_t, kBuckets + 1>& counts() const { return counts_; }  // per bucket
  int64_t& bucket(int i) { return counts_[i]; }
  void set_totals(int64_t count, double sum) {
    count_ = count;
    sum_ = sum;
  }
  // The upper bound of the bucket holding the q-quantile (0 when empty): an upper estimate.
  double Quantile(double q) const;

 private:
  std::array<int64_t, kBuckets + 1> counts_{};
  int64_t count_ = 0;
  double sum_ = 0;
};

// When a request passed each step on one rank. Times are seconds after `created`; -1 when the
// request never got there (a failed request may have no first byte).
//   context rank:    created = MarkReady / BeginLayerWise; fetch = the first FETCH arrived;
//                    first/last byte = the first / last chunk in place at a generation rank
//                    (tagged: its send completed; one-sided: its puts flushed).
//   generation rank: created = the FETCH messages were sent (Fetch); fetch = the same;
//                    first/last byte = the first / last chunk landed in the pool (unpacked,
//                    checksum checked).
//   both:            end = the terminal state (complete: every rank acknowledged).
struct RequestTimeline {
  uint64_t request_id = 0;
  std::string state;  // TransferStateName of the terminal state ("" while live)
  std::string code;   // StatusCodeName of the reason ("OK" when complete)
  int64_t bytes = 0;
  int64_t chunks = 0;  // chunks this rank moved for it
  std::chrono::system_clock::time_point created;
  double fetch = -1, first_byte = -1, last_byte = -1, end = -1;
};

// One side (rank) of the transceiver.
struct TransceiverMetrics {
  std::string side;       // "context" or "generation"
  std::string transport;  // the transport's name (inproc, ucx, mpi)
  std::string data_path;  // "one-sided" or "tagged"
  int64_t requests_started = 0;
  // Requests ended, by terminal state: complete, error, timed-out, cancelled.
  int64_t requests_complete = 0, requests_error = 0, requests_timed_out = 0, requests_cancelled = 0;
  int64_t live_requests = 0;  // started, not terminal yet (their blocks are leased)
  // Ended requests that were not complete, by the StatusCodeName of their reason.
  std::vector<std::pair<std::string, int64_t>> errors_by_code;
  int64_t bytes = 0;           // payload bytes of ended requests, sent or received here
  double request_seconds = 0;  // sum of ended requests' durations
  int64_t chunks = 0;          // chunks in place (see RequestTimeline)
  int64_t chunk_bytes = 0;     // their payload bytes
  int64_t staging_slots_in_use = 0;
  int64_t staging_slots = 0;         // the bound (transfer.staging_chunks)
  int64_t command_queue = 0;         // public calls waiting for the progress thread
  double busy_cpu_seconds = 0;       // progress-thread CPU in iterations that did work
  LatencyHistogram request_latency;  // start (MarkReady / Fetch) to terminal
  LatencyHistogram chunk_latency;    // a chunk's start (pack / receive posted) to in place
  // With the knob transfer.profile: the progress thread's CPU by phase ("<phase>_cpu_s"), its
  // loop and message counts, and (context side) "copy_busy_s", how long its copy stream had work.
  // Empty when the knob is off.
  std::vector<std::pair<std::string, double>> profile;
};

// Copies between two tiers of a transfer manager (primary, host, file), one direction.
struct TierCopyMetrics {
  std::string from, to;  // TierName
  int64_t batches = 0;
  int64_t blocks = 0;
  int64_t bytes = 0;  // bytes the streams copied (file batches: the pool <-> staging part)
  // Submission to completion as first observed (a Wait or Query that finds the batch done, or its
  // recycling): an upper bound when nobody waits.
  LatencyHistogram latency;
};

struct TieringMetrics {
  std::vector<TierCopyMetrics> copies;  // directions with at least one batch
  int64_t file_writes = 0, file_write_errors = 0, file_reads = 0, file_read_errors = 0;
  int64_t file_jobs_queued = 0;  // queue depth of the file I/O thread
};

}  // namespace kvferry
#pragma GCC visibility pop

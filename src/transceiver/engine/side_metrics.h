// SideMetrics: the counters, histograms and request timelines of one transceiver side, fed by its
// engine (every status change, every chunk in place) and read by TransceiverMetrics snapshots.
//
// Threading. OnStatus and OnChunk run on the progress thread only (the live timelines are its
// own); Fill and Timelines may run on any thread (atomics, and a mutex taken once per request
// end, never per chunk).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

#include "base/thread_annotations.h"
#include "kvferry/metrics.h"
#include "kvferry/transceiver.h"
#include "metrics/atomic_histogram.h"

namespace kvferry {

class SideMetrics {
 public:
  // Ended requests whose timelines are kept for Timelines() (the slowest is kept beside them).
  static constexpr size_t kRecentTimelines = 256;

  void OnStatus(const TransferStatus& status);
  void OnChunk(uint64_t request_id, int64_t bytes, Clock::time_point started);
  // Counters into `m` (side, transport, queue and staging fields are the engine's).
  void Fill(TransceiverMetrics& m) const;
  // The timelines of recently ended requests, oldest first, then the slowest ever ended here
  // when it is no longer among them.
  std::vector<RequestTimeline> Timelines() const;

 private:
  struct Live {
    Clock::time_point created, fetch, first, last;
    std::chrono::system_clock::time_point wall;
    int64_t chunks = 0;
    bool has_fetch = false;
  };

  std::unordered_map<uint64_t, Live> live_;  // progress thread only
  std::atomic<int64_t> started_{0};
  std::array<std::atomic<int64_t>, 4> ended_{};   // complete, error, timed-out, cancelled
  std::array<std::atomic<int64_t>, 16> codes_{};  // by StatusCode, requests not complete
  std::atomic<int64_t> bytes_{0}, request_ns_{0}, chunks_{0}, chunk_bytes_{0};
  AtomicHistogram request_latency_, chunk_latency_;
  mutable Mutex mu_;
  std::deque<RequestTimeline> recent_ GUARDED_BY(mu_);
  RequestTimeline slowest_ GUARDED_BY(mu_);
  bool has_slowest_ GUARDED_BY(mu_) = false;
};

}  // namespace kvferry

// AtomicHistogram: a LatencyHistogram that one thread adds to while others take snapshots.
// Relaxed atomics: a snapshot may see a count before its sum; scrapers tolerate that.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

#include "kvferry/metrics.h"

namespace kvferry {

class AtomicHistogram {
 public:
  void Add(double seconds) {
    counts_[LatencyHistogram::BucketOf(seconds)].fetch_add(1, std::memory_order_relaxed);
    count_.fetch_add(1, std::memory_order_relaxed);
    sum_ns_.fetch_add(static_cast<int64_t>(seconds * 1e9), std::memory_order_relaxed);
  }
  LatencyHistogram Snapshot() const {
    LatencyHistogram h;
    for (int i = 0; i <= LatencyHistogram::kBuckets; ++i)
      h.bucket(i) = counts_[i].load(std::memory_order_relaxed);
    h.set_totals(count_.load(std::memory_order_relaxed),
                 static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9);
    return h;
  }

 private:
  std::array<std::atomic<int64_t>, LatencyHistogram::kBuckets + 1> counts_{};
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> sum_ns_{0};
};

}  // namespace kvferry

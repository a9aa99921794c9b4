// StatusTable: a side's requests as the public calls see them. The progress thread sets each
// request's status; Poll hands out the terminal ones (once each, then they leave the table);
// Query reads any; Reserve claims an id for a request a public call starts asynchronously. It also
// keeps the side's per-request metrics (SideMetrics: phases, chunk times, timelines).
//
// Thread-safe: every call from any thread (one mutex; SideMetrics has its own).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <string_view>
#include <vector>

#include "base/thread_annotations.h"
#include "kvferry/transceiver.h"
#include "transceiver/engine/side_metrics.h"

namespace kvferry {

class StatusTable {
 public:
  // The request's status now (the progress thread): a terminal one wakes Poll.
  void Set(const TransferStatus& status);
  // Claims `request_id` for a request a public call starts asynchronously (its first status,
  // kInit, set here on the caller's thread; the progress thread's Set calls follow):
  // kInvalidArgument with `what` when a request of that id is live on this side.
  Status Reserve(uint64_t request_id, std::string_view what);
  // Waits until at least `at_least` requests ended unreported (or the deadline), and reports
  // them; reported requests leave the table, so Query then says not found.
  std::vector<TransferStatus> Poll(size_t at_least, Deadline deadline);
  StatusOr<TransferStatus> Query(uint64_t request_id) const;

  // Requests whose last status is not terminal, and requests that ended.
  int64_t live() const { return live_.load(); }
  int64_t ended() const { return ended_.load(); }
  SideMetrics& metrics() { return metrics_; }
  const SideMetrics& metrics() const { return metrics_; }

 private:
  mutable Mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, TransferStatus> statuses_ GUARDED_BY(mu_);
  std::deque<TransferStatus> reports_ GUARDED_BY(mu_);  // terminal, not yet polled
  std::atomic<int64_t> ended_{0};
  std::atomic<int64_t> live_{0};
  SideMetrics metrics_;
};

}  // namespace kvferry

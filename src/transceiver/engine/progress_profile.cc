#include "transceiver/engine/progress_profile.h"

#include <time.h>

#include <algorithm>

namespace kvferry {
namespace {

constexpr const char* kPhaseNames[] = {"commands", "progress",    "control",     "advance",
                                       "tick",     "idle",        "peer_import", "connect",
                                       "plan",     "copy_submit", "event_query", "send_control"};
static_assert(std::size(kPhaseNames) == static_cast<size_t>(ProfilePhase::kCount));

constexpr const char* kCounterNames[] = {"busy_iterations", "idle_iterations", "control_sent",
                                         "control_received", "batches"};
static_assert(std::size(kCounterNames) == static_cast<size_t>(ProfileCounter::kCount));

}  // namespace

int64_t ThreadCpuNs() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

uint64_t ProgressProfile::Launched(int64_t now_ns) {
  if (!on_) return 0;
  open_.emplace_back(now_ns, -1);
  return first_open_ + open_.size() - 1;
}

void ProgressProfile::Landed(uint64_t ticket, int64_t now_ns) {
  if (!on_ || ticket < first_open_ || ticket - first_open_ >= open_.size()) return;
  open_[ticket - first_open_].second = now_ns;
  int64_t busy = 0;
  while (!open_.empty() && open_.front().second >= 0) {
    const auto [launched, ended] = open_.front();
    busy += std::max<int64_t>(0, ended - std::max(launched, last_end_));
    last_end_ = std::max(last_end_, ended);
    open_.pop_front();
    ++first_open_;
  }
  copy_busy_ns_.fetch_add(busy, std::memory_order_relaxed);
}

std::vector<std::pair<std::string, double>> ProgressProfile::Snapshot() const {
  std::vector<std::pair<std::string, double>> out;
  if (!on_) return out;
  for (size_t i = 0; i < phase_ns_.size(); ++i) {
    out.emplace_back(std::string(kPhaseNames[i]) + "_cpu_s",
                     static_cast<double>(phase_ns_[i].load(std::memory_order_relaxed)) / 1e9);
  }
  for (size_t i = 0; i < counters_.size(); ++i) {
    out.emplace_back(kCounterNames[i],
                     static_cast<double>(counters_[i].load(std::memory_order_relaxed)));
  }
  out.emplace_back("copy_busy_s",
                   static_cast<double>(copy_busy_ns_.load(std::memory_order_relaxed)) / 1e9);
  return out;
}

}  // namespace kvferry

// How long a selftest run may take, derived from its requests' deadlines rather than from the
// length of the run: a healthy slow run is never cut short, a stuck one ends within a bound.
//
// Every request ends within its deadline (cfg.timeout from when it starts, plus the context
// side's abort grace). Progress is a request that ends by anything but its deadline: complete,
// or failed for a reason (a refusal, a dead peer). A start is not progress, and neither is a
// request that timed out: a rank whose peer is stopped (SIGSTOP) or hung sees every request
// time out and its slot start the next one, and counting those kept such a run going for
// requests x deadline (hours). In a healthy run some request completes at least every deadline,
// so when nothing progressed for StallLimit(cfg), whatever is left will never end, and the rank
// gives up on it, writing a result that names each request it gave up on and why. The parent
// process watches the ranks' progress counts the same way and allows kParentGrace more (for the
// ranks to write their results and close their transports) before it kills them.
//
// Not thread-safe: each rank owns its watch.
#pragma once

#include <chrono>
#include <filesystem>
#include <string>

#include "kvferry/device.h"
#include "kvferry/transceiver.h"
#include "selftest/selftest.h"

namespace kvferry {

// Nothing progressed for this long: the rest will not end.
std::chrono::milliseconds StallLimit(const SelftestConfig& cfg);
inline constexpr std::chrono::milliseconds kParentGrace{4000};

// A rank's progress: when a request last made progress, and (at most every 200 ms, and on the
// first and last call) "done total started progressed" in the progress file the parent reads
// (done counts every end, progressed only the ends that are progress).
class RunWatch {
 public:
  RunWatch(const SelftestConfig& cfg, std::filesystem::path progress_file, int total);
  static std::filesystem::path StopFile(const SelftestConfig& cfg);
  // A request started; a request ended (`progress`: by anything but its deadline).
  void Started();
  void Ended(bool progress);
  // A request's end: progress unless a deadline ended it, its own (timed out) or a sibling
  // rank's relayed to it ("context rank 1 ended it: not delivered within ...", an error with
  // DEADLINE_EXCEEDED), which a stopped peer causes on every rank of the instance.
  void Ended(const TransferStatus& s) {
    Ended(s.state != TransferState::kTimedOut && s.reason.code() != StatusCode::kDeadlineExceeded);
  }
  bool Stalled() const { return Clock::now() > last_ + limit_; }
  // The parent asked the ranks to stop (checked at most every 100 ms); stop_reason() says why.
  bool Stopped();
  const std::string& stop_reason() const { return stop_reason_; }
  std::chrono::milliseconds limit() const { return limit_; }

 private:
  void Write(bool force);
  const std::chrono::milliseconds limit_;
  const std::filesystem::path file_, stop_file_;
  const int total_;
  int started_ = 0, done_ = 0, progressed_ = 0;
  Clock::time_point last_, last_write_{}, next_stop_check_{};
  bool stopped_ = false;
  std::string stop_reason_;
};

}  // namespace kvferry

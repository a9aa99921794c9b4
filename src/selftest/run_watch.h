// How long a selftest run may take, derived from its requests' deadlines rather than from the
// length of the run: a healthy slow run is never cut short, a stuck one ends within a bound.
//
// Every request ends within its deadline (cfg.timeout from when it starts, plus the context
// side's abort grace). So while any request starts or ends, the run is alive; when no request has
// started or ended for StallLimit(cfg), whatever is left will never end, and the rank gives up on
// it, writing a result that names each request it gave up on and why. The parent process watches
// the ranks' progress files the same way and allows kParentGrace more (for the ranks to write
// their results and close their transports) before it kills them.
//
// Not thread-safe: each rank owns its watch.
#pragma once

#include <chrono>
#include <filesystem>
#include <string>

#include "kvferry/device.h"
#include "selftest/selftest.h"

namespace kvferry {

// Nothing started or ended for this long: the rest will not end.
std::chrono::milliseconds StallLimit(const SelftestConfig& cfg);
inline constexpr std::chrono::milliseconds kParentGrace{4000};

// A rank's progress: when the last request started or ended, and (at most every 200 ms, and on
// the first and last call) "done total started" in the progress file the parent reads.
class RunWatch {
 public:
  RunWatch(const SelftestConfig& cfg, std::filesystem::path progress_file, int total);
  static std::filesystem::path StopFile(const SelftestConfig& cfg);
  // A request started or ended.
  void Started();
  void Ended();
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
  int started_ = 0, done_ = 0;
  Clock::time_point last_, last_write_{}, next_stop_check_{};
  bool stopped_ = false;
  std::string stop_reason_;
};

}  // namespace kvferry

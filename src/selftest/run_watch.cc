#include "selftest/run_watch.h"

#include <fmt/format.h>

#include <fstream>
#include <system_error>

#include "kvferry/config.h"

namespace kvferry {

std::chrono::milliseconds StallLimit(const SelftestConfig& cfg) {
  if (cfg.give_up.count() > 0) return cfg.give_up;
  return cfg.timeout + std::chrono::milliseconds(Config::Global().Int("transfer.abort_grace_ms")) +
         std::chrono::milliseconds(1000);
}

std::filesystem::path RunWatch::StopFile(const SelftestConfig& cfg) {
  return std::filesystem::path(cfg.dir) / "stop";
}

RunWatch::RunWatch(const SelftestConfig& cfg, std::filesystem::path progress_file, int total)
    : limit_(StallLimit(cfg)),
      file_(std::move(progress_file)),
      stop_file_(StopFile(cfg)),
      total_(total),
      last_(Clock::now()) {
  Write(true);  // set-up is done: that is progress too
}

void RunWatch::Started() {
  ++started_;
  Write(started_ == 1);
}

void RunWatch::Ended(bool progress) {
  ++done_;
  if (progress) {
    ++progressed_;
    last_ = Clock::now();
  }
  Write(done_ == total_);
}

bool RunWatch::Stopped() {
  if (stopped_) return true;
  auto now = Clock::now();
  if (now < next_stop_check_) return false;
  next_stop_check_ = now + std::chrono::milliseconds(100);
  std::ifstream f(stop_file_);
  if (!f) return false;
  stopped_ = true;
  std::getline(f, stop_reason_);
  return true;
}

void RunWatch::Write(bool force) {
  auto now = Clock::now();
  if (!force && now - last_write_ < std::chrono::milliseconds(200)) return;
  last_write_ = now;
  // Written aside and renamed: the parent never reads half a line. Best effort: progress files
  // only extend the parent's patience.
  std::filesystem::path tmp = file_;
  tmp += ".tmp";
  {
    std::ofstream f(tmp);
    f << fmt::format("{} {} {} {}\n", done_, total_, started_, progressed_);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file_, ec);
}

}  // namespace kvferry

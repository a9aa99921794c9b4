#include "base/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>

#include "kvferry/config.h"

namespace kvferry {
namespace {

LogLevel ParseLevel(const std::string& s) {
  if (s == "error") return LogLevel::kError;
  if (s == "warn") return LogLevel::kWarn;
  if (s == "debug") return LogLevel::kDebug;
  return LogLevel::kInfo;
}

}  // namespace

bool LogEnabled(LogLevel level) {
  // Read the knob each time: it can be changed by Config::Set; logging is off the hot path.
  return static_cast<int>(level) <=
         static_cast<int>(ParseLevel(Config::Global().String("log.level")));
}

void LogLine(LogLevel level, std::string_view message) {
  static std::mutex mu;
  static constexpr const char* kNames[] = {"E", "W", "I", "D"};
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                std::chrono::system_clock::now().time_since_epoch())
                .count();
  std::lock_guard lock(mu);
  std::fprintf(stderr, "[kvferry %s %lld.%06lld] %.*s\n", kNames[static_cast<int>(level)],
               static_cast<long long>(us / 1000000), static_cast<long long>(us % 1000000),
               static_cast<int>(message.size()), message.data());
}

}  // namespace kvferry

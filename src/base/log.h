// Logging: one line per event to stderr, filtered by the knob log.level. Thread-safe.
// Errors are logged once, by whoever first decides what they are (usually the backend edge).
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace kvferry {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, std::string_view message);

template <typename... Args>
void Log(LogLevel level, fmt::format_string<Args...> f, Args&&... args) {
  if (LogEnabled(level)) LogLine(level, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace kvferry

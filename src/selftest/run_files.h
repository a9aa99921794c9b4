// The selftest's run directory and rendezvous (run_files.cc): result files written atomically
// (a temporary name, then renamed: readers never see half a file), and the run's TCP rendezvous
// from its address and hex key.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/rendezvous.h"
#include "kvferry/status.h"
#include "selftest/selftest_config.h"

namespace kvferry {

Status WriteText(const std::filesystem::path& path, const std::string& s);
std::string AsString(const std::vector<std::byte>& b);

// A rendezvous group key as 32 hex digits, and back (kInvalidArgument naming the text).
std::string RendezvousKeyHex(const RendezvousKey& key);
StatusOr<RendezvousKey> ParseRendezvousKeyHex(std::string_view hex);
// A client of the run's rendezvous (cfg.rendezvous, cfg.rendezvous_key).
StatusOr<std::unique_ptr<Rendezvous>> ConnectRunRendezvous(const SelftestConfig& cfg);

}  // namespace kvferry

// The selftest's run directory and rendezvous: files written atomically, waited for, and the
// run's TCP rendezvous from its address and hex key.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "selftest/baseline.h"
#include "selftest/selftest.h"

namespace kvferry {

namespace fs = std::filesystem;

namespace {

Status WriteFileAtomic(const fs::path& path, std::span<const std::byte> bytes) {
  fs::path tmp = path;
  tmp += fmt::format(".tmp{}", ::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
    if (!f) return Status::Unavailable(fmt::format("cannot write {}", tmp.string()));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec)
    return Status::Unavailable(
        fmt::format("cannot rename {} to {}: {}", tmp.string(), path.string(), ec.message()));
  return Status::Ok();
}

}  // namespace

Status WriteText(const fs::path& path, const std::string& s) {
  return WriteFileAtomic(path, std::as_bytes(std::span(s.data(), s.size())));
}

StatusOr<std::vector<std::byte>> WaitForFile(const fs::path& path, Deadline deadline) {
  while (true) {
    std::ifstream f(path, std::ios::binary);
    if (f) {
      std::vector<char> c((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      std::vector<std::byte> out(c.size());
      std::memcpy(out.data(), c.data(), c.size());
      return out;
    }
    if (Clock::now() > deadline) {
      return Status::DeadlineExceeded(fmt::format("waited too long for {}", path.string()));
    }
    // Short naps: a handle published by the context rank is picked up within ~0.1 ms, so bench
    // transfer measures transfers rather than this poll (2 ms naps capped 4k-token GPU requests,
    // 0.7 ms each, at a third of their speed).
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

std::string RendezvousKeyHex(const RendezvousKey& key) {
  std::string out;
  for (uint8_t b : key) out += fmt::format("{:02x}", b);
  return out;
}

StatusOr<RendezvousKey> ParseRendezvousKeyHex(std::string_view hex) {
  RendezvousKey key{};
  auto nibble = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
  };
  bool ok = hex.size() == 2 * key.size();
  for (size_t i = 0; ok && i < key.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    ok = hi >= 0 && lo >= 0;
    key[i] = static_cast<uint8_t>(hi * 16 + lo);
  }
  if (!ok) {
    return Status::InvalidArgument(
        fmt::format("rendezvous key '{}': expected 32 lowercase hex digits", hex));
  }
  return key;
}

StatusOr<std::unique_ptr<Rendezvous>> ConnectRunRendezvous(const SelftestConfig& cfg) {
  if (cfg.rendezvous.empty()) return Status::InvalidArgument("no rendezvous address");
  KVF_ASSIGN_OR_RETURN(RendezvousKey key, ParseRendezvousKeyHex(cfg.rendezvous_key));
  return ConnectRendezvous(cfg.rendezvous, key);
}

std::string AsString(const std::vector<std::byte>& b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

}  // namespace kvferry

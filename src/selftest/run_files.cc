#include "selftest/run_files.h"

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

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

#include "device/peer_memory.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>

#include "base/wire.h"
#include "device/host_shm.h"
#include "kvferry/device.h"

namespace kvferry {
namespace {

constexpr char kMagic[4] = {'k', 'v', 'p', 'm'};
constexpr uint8_t kVersion = 2;
constexpr size_t kHeader = 44;

// Non-owning view of memory of this very process (the exporter importing its own handle).
class OwnMapping final : public PeerMapping {
 public:
  OwnMapping(std::byte* p, size_t n) : p_(p), n_(n) {}
  std::byte* data() const override { return p_; }
  size_t size() const override { return n_; }

 private:
  std::byte* const p_;
  const size_t n_;
};

}  // namespace

const std::array<uint8_t, 16>& ThisHostId() {
  static const std::array<uint8_t, 16> id = [] {
    std::array<uint8_t, 16> out{};
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string text;
    std::getline(in, text);
    size_t n = 0;
    for (size_t i = 0; i + 1 < text.size() && n < out.size(); ++i) {
      if (text[i] == '-') continue;
      out[n++] = static_cast<uint8_t>(std::stoi(text.substr(i, 2), nullptr, 16));
      ++i;
    }
    return out;
  }();
  return id;
}

uint32_t ThisPid() { return static_cast<uint32_t>(getpid()); }

std::vector<std::byte> EncodePeerHandle(const PeerHandle& h) {
  WireWriter w;
  w.buffer().reserve(kHeader + h.payload.size());
  for (char c : kMagic) w.U8(static_cast<uint8_t>(c));
  w.U8(kVersion);
  w.U8(static_cast<uint8_t>(h.platform));
  w.U16(0);
  w.U32(h.pid);
  for (uint8_t b : h.host) w.U8(b);
  w.U64(h.address);
  w.U64(h.bytes);
  w.buffer().insert(w.buffer().end(), h.payload.begin(), h.payload.end());
  return w.Take();
}

StatusOr<PeerHandle> DecodePeerHandle(std::span<const std::byte> b) {
  if (b.size() < kHeader || std::memcmp(b.data(), kMagic, 4) != 0) {
    return Status::InvalidArgument(
        fmt::format("peer memory handle: {} bytes without the kvpm header", b.size()));
  }
  if (static_cast<uint8_t>(b[4]) != kVersion) {
    return Status::InvalidArgument(
        fmt::format("peer memory handle: version {} (this build reads {})", static_cast<int>(b[4]),
                    static_cast<int>(kVersion)));
  }
  const uint8_t platform = static_cast<uint8_t>(b[5]);
  if (platform > 1) {
    return Status::InvalidArgument(
        fmt::format("peer memory handle: unknown platform {}", static_cast<int>(platform)));
  }
  PeerHandle h;
  h.platform = static_cast<PeerPlatform>(platform);
  WireReader r(b.subspan(8, kHeader - 8));  // the size was checked above
  h.pid = r.U32("pid");
  for (uint8_t& x : h.host) x = r.U8("host");
  h.address = r.U64("address");
  h.bytes = r.U64("bytes");
  h.payload.assign(b.begin() + kHeader, b.end());
  if (h.bytes == 0 || h.bytes > UINT64_MAX - h.address) {
    return Status::InvalidArgument(fmt::format(
        "peer memory handle: region of {} bytes at {:#x} is empty or wraps", h.bytes, h.address));
  }
  return h;
}

StatusOr<PeerHandle> DecodeLocalPeerHandle(std::span<const std::byte> bytes,
                                           PeerPlatform platform) {
  KVF_ASSIGN_OR_RETURN(PeerHandle h, DecodePeerHandle(bytes));
  if (h.platform != platform) {
    return Status::Unavailable(fmt::format("peer memory handle of platform {} given to a {} device",
                                           static_cast<int>(h.platform),
                                           static_cast<int>(platform)));
  }
  if (h.host != ThisHostId()) {
    return Status::Unavailable(
        fmt::format("peer memory handle of process {} on another host", h.pid));
  }
  return h;
}

StatusOr<std::vector<std::byte>> Device::ExportMemory(const void* base, size_t, MemoryKind) {
  return Status::Unavailable(
      fmt::format("device {} can't share memory ({}) with other processes", info().name, base));
}

StatusOr<std::unique_ptr<PeerMapping>> Device::ImportMemory(std::span<const std::byte>) {
  return Status::Unavailable(
      fmt::format("device {} can't map other processes' memory", info().name));
}

// The CPU device's sharing: any region within this process by address; across processes of this
// host only regions of shared allocations (payload given: host_shm.h).
StatusOr<std::vector<std::byte>> ExportCpuMemory(const void* base, size_t bytes,
                                                 std::span<const std::byte> payload) {
  if (base == nullptr || bytes == 0) {
    return Status::InvalidArgument(
        fmt::format("ExportMemory: {} bytes at {} is not a region", bytes, base));
  }
  PeerHandle h;
  h.platform = PeerPlatform::kCpu;
  h.pid = ThisPid();
  h.host = ThisHostId();
  h.address = reinterpret_cast<uintptr_t>(base);
  h.bytes = bytes;
  h.payload.assign(payload.begin(), payload.end());
  return EncodePeerHandle(h);
}

StatusOr<std::unique_ptr<PeerMapping>> ImportCpuMemory(std::span<const std::byte> bytes) {
  KVF_ASSIGN_OR_RETURN(PeerHandle h, DecodeLocalPeerHandle(bytes, PeerPlatform::kCpu));
  if (h.pid == ThisPid()) {
    return std::unique_ptr<PeerMapping>(std::make_unique<OwnMapping>(
        reinterpret_cast<std::byte*>(h.address), static_cast<size_t>(h.bytes)));
  }
  if (h.payload.empty()) {
    return Status::Unavailable(fmt::format(
        "cpu device: {} bytes at {:#x} of process {} are not shared memory (only host memory "
        "kvferry allocated, not a wrapped engine region, maps into another process such as {})",
        h.bytes, h.address, h.pid, ThisPid()));
  }
  KVF_ASSIGN_OR_RETURN(ShmPayload p, DecodeShmPayload(h.payload));
  return MapPeerShm(h.pid, h.bytes, p);
}

std::unique_ptr<PeerMapping> OwnPeerMapping(std::byte* data, size_t bytes) {
  return std::make_unique<OwnMapping>(data, bytes);
}

}  // namespace kvferry

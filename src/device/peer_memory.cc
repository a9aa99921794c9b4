#include "device/peer_memory.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>
#include <unordered_map>

#include "base/thread_annotations.h"
#include "base/wire.h"
#include "device/host_shm.h"
#include "kvferry/device.h"

namespace kvferry {
namespace {

constexpr char kMagic[4] = {'k', 'v', 'p', 'm'};
constexpr uint8_t kVersion = 3;
constexpr size_t kHeader = 52;
constexpr size_t kMaxExports = 1 << 16;

struct Export {
  uint64_t address;
  uint64_t bytes;
  PeerPlatform platform;
};

// This process's live exports by token.
class ExportRegistry {
 public:
  static ExportRegistry& Get() {
    static ExportRegistry* r = new ExportRegistry();
    return *r;
  }
  StatusOr<uint64_t> Add(const Export& e) {
    MutexLock lock(mu_);
    if (exports_.size() >= kMaxExports) {
      return Status::ResourceExhausted(fmt::format(
          "ExportMemory: {} exports of this process are live (the limit)", exports_.size()));
    }
    uint64_t token = RandomU64();
    while (token == 0 || exports_.count(token)) token = RandomU64();
    exports_.emplace(token, e);
    return token;
  }
  void Remove(uint64_t token) {
    MutexLock lock(mu_);
    exports_.erase(token);
  }
  bool Has(uint64_t token, const Export& e) const {
    MutexLock lock(mu_);
    auto it = exports_.find(token);
    return it != exports_.end() && it->second.address == e.address && it->second.bytes == e.bytes &&
           it->second.platform == e.platform;
  }

 private:
  mutable Mutex mu_;
  std::unordered_map<uint64_t, Export> exports_ GUARDED_BY(mu_);
};

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
    // A process reaches another's memory by its pid (pidfd_open, /proc/PID): only within one PID
    // namespace. Containers (and `unshare --pid`) of one machine share its boot id but not their
    // pids, so the namespace is part of the identity: "another host" for peer memory.
    struct stat ns {};
    if (stat("/proc/self/ns/pid", &ns) == 0) {
      uint64_t ino = static_cast<uint64_t>(ns.st_ino), dev = static_cast<uint64_t>(ns.st_dev);
      for (int i = 0; i < 8; ++i) {
        out[i] ^= static_cast<uint8_t>(ino >> (8 * i));
        out[8 + i] ^= static_cast<uint8_t>(dev >> (8 * i));
      }
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
  w.U64(h.export_token);
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
  h.export_token = r.U64("export_token");
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
  KVF_ASSIGN_OR_RETURN(h.export_token, RegisterPeerExport(h.address, h.bytes, h.platform));
  h.payload.assign(payload.begin(), payload.end());
  return EncodePeerHandle(h);
}

StatusOr<std::unique_ptr<PeerMapping>> ImportCpuMemory(std::span<const std::byte> bytes) {
  KVF_ASSIGN_OR_RETURN(PeerHandle h, DecodeLocalPeerHandle(bytes, PeerPlatform::kCpu));
  if (h.pid == ThisPid()) {
    KVF_RETURN_IF_ERROR(CheckOwnExport(h));
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

uint64_t RandomU64() {
  uint64_t v = 0;
  auto* p = reinterpret_cast<char*>(&v);
  size_t got = 0;
  while (got < sizeof v) {
    const ssize_t n = getrandom(p + got, sizeof v - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return v;
}

StatusOr<uint64_t> RegisterPeerExport(uint64_t address, uint64_t bytes, PeerPlatform platform) {
  return ExportRegistry::Get().Add(Export{address, bytes, platform});
}

void RevokePeerExport(std::span<const std::byte> handle) {
  auto h = DecodePeerHandle(handle);
  if (h.ok() && h->pid == ThisPid()) ExportRegistry::Get().Remove(h->export_token);
}

bool OwnExportLive(const PeerHandle& h) {
  return h.pid == ThisPid() &&
         ExportRegistry::Get().Has(h.export_token, Export{h.address, h.bytes, h.platform});
}

Status CheckOwnExport(const PeerHandle& h) {
  if (OwnExportLive(h)) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "peer memory handle of this very process ({}) names {} bytes at {:#x} that it did not "
      "export (or no longer does) under token {:#018x}: refused, nothing of this process is "
      "mapped but what its pools exported",
      h.pid, h.bytes, h.address, h.export_token));
}

ExporterWatch::ExporterWatch(const PeerHandle& h) {
  if (h.pid == ThisPid()) {
    own_ = h;
    own_process_ = true;
    return;
  }
  pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(h.pid), 0));
}

ExporterWatch::~ExporterWatch() {
  if (pidfd_ >= 0) close(pidfd_);
}

bool ExporterWatch::alive() const {
  if (own_process_) return OwnExportLive(own_);
  if (pidfd_ < 0) return false;
  pollfd p{pidfd_, POLLIN, 0};
  return poll(&p, 1, 0) == 0;  // a pidfd is readable once its process exited
}

std::unique_ptr<PeerMapping> OwnPeerMapping(std::byte* data, size_t bytes) {
  return std::make_unique<OwnMapping>(data, bytes);
}

}  // namespace kvferry

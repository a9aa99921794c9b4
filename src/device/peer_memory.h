// The peer memory handle (Device::ExportMemory / ImportMemory), byte by byte (version 2, all
// integers little-endian; docs/wire_format.md repeats it):
//   0..3   "kvpm"           4  version (2)        5  platform (0 cpu, 1 cuda)      6..7  zero
//   8..11  exporter's pid   12..27  host id (the kernel's boot id, 16 bytes)
//   28..35 address of the region in the exporter   36..43  bytes of the region
//   44..   platform payload (cpu: none, memory of the exporting process only; or a shared
//          allocation: u32 fd, u64 offset in the memfd, u64 memfd bytes, u64 token; cuda: u32
//          ordinal, u64 offset of the region inside its allocation, 64 bytes of cudaIpcMemHandle_t)
// The host id lets an importer on another host refuse the handle by name instead of mapping
// garbage; the pid lets the exporting process itself use its own pointer (CUDA refuses to open
// a handle in the process that made it).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/status.h"

namespace kvferry {

enum class PeerPlatform : uint8_t { kCpu = 0, kCuda = 1 };

struct PeerHandle {
  PeerPlatform platform = PeerPlatform::kCpu;
  uint32_t pid = 0;
  std::array<uint8_t, 16> host{};
  uint64_t address = 0;
  uint64_t bytes = 0;
  std::vector<std::byte> payload;
};

// This host's id (the boot id; zeros when /proc does not say) and this process's pid.
const std::array<uint8_t, 16>& ThisHostId();
uint32_t ThisPid();

std::vector<std::byte> EncodePeerHandle(const PeerHandle& h);
StatusOr<PeerHandle> DecodePeerHandle(std::span<const std::byte> bytes);
// Decodes and checks platform and host; errors name what differs.
StatusOr<PeerHandle> DecodeLocalPeerHandle(std::span<const std::byte> bytes, PeerPlatform platform);

}  // namespace kvferry

namespace kvferry {
// The CPU device's ExportMemory / ImportMemory (payload: a shared allocation's ShmPayload bytes,
// mappable by other processes of this host; empty: this process only), and a non-owning mapping
// of this process's own memory (an exporter importing its own handle).
StatusOr<std::vector<std::byte>> ExportCpuMemory(const void* base, size_t bytes,
                                                 std::span<const std::byte> payload);
StatusOr<std::unique_ptr<PeerMapping>> ImportCpuMemory(std::span<const std::byte> bytes);
std::unique_ptr<PeerMapping> OwnPeerMapping(std::byte* data, size_t bytes);
}  // namespace kvferry

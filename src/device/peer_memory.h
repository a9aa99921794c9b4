// The peer memory handle (Device::ExportMemory / ImportMemory), byte by byte (version 3, all
// integers little-endian; docs/wire_format.md repeats it):
//   0..3   "kvpm"           4  version (3)        5  platform (0 cpu, 1 cuda)      6..7  zero
//   8..11  exporter's pid   12..27  host id (the kernel's boot id, 16 bytes)
//   28..35 address of the region in the exporter   36..43  bytes of the region
//   44..51 export token: random (getrandom), one per ExportMemory call, registered in the
//          exporting process with the region (RegisterPeerExport)
//   52..   platform payload (cpu: none, memory of the exporting process only; or a shared
//          allocation: u32 fd, u64 offset in the memfd, u64 memfd bytes, u64 token; cuda: u32
//          ordinal, u64 offset of the region inside its allocation, 64 bytes of cudaIpcMemHandle_t)
// The host id lets an importer on another host refuse the handle by name instead of mapping
// garbage. The exporting process itself maps its own pointer (CUDA refuses to open a handle in
// the process that made it), but only a region it exported and has not revoked, exactly as
// registered under the handle's token: a handle naming any other address of the importer's own
// process (a peer holding one valid handle could otherwise have this process copy KV anywhere
// in its own memory) is refused. Another process maps only what the exporter shared (a memfd
// checked by name, seals and size; a CUDA IPC allocation checked against its size).
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
  uint64_t export_token = 0;
  std::vector<std::byte> payload;
};

// This host's id for peer memory (the boot id, zeros when /proc does not say, mixed with this
// process's PID namespace: pids reach across no other) and this process's pid.
const std::array<uint8_t, 16>& ThisHostId();
uint32_t ThisPid();

std::vector<std::byte> EncodePeerHandle(const PeerHandle& h);
StatusOr<PeerHandle> DecodePeerHandle(std::span<const std::byte> bytes);
// Decodes and checks platform and host; errors name what differs.
StatusOr<PeerHandle> DecodeLocalPeerHandle(std::span<const std::byte> bytes, PeerPlatform platform);

// This process's exports (thread-safe; at most 65536 live). Register returns the random token the
// handle carries; Revoke forgets the export a handle names (its exporter's side ends: nothing of
// this process maps it any more); OwnExportLive says whether a handle of this process names a
// registered export, with exactly its region and platform.
StatusOr<uint64_t> RegisterPeerExport(uint64_t address, uint64_t bytes, PeerPlatform platform);
void RevokePeerExport(std::span<const std::byte> handle);
bool OwnExportLive(const PeerHandle& h);
// Ok when OwnExportLive, else kInvalidArgument naming the region and the token.
Status CheckOwnExport(const PeerHandle& h);
// A random 64-bit value from the kernel (getrandom); never a function of another one.
uint64_t RandomU64();

// Whether the exporter of a mapped handle still stands: this process's own export still
// registered, or another process not exited (a pidfd, so a reused pid does not count). Made at
// import; a watch that could not open the exporter's pidfd reports it gone.
class ExporterWatch {
 public:
  explicit ExporterWatch(const PeerHandle& h);
  ~ExporterWatch();
  ExporterWatch(const ExporterWatch&) = delete;
  ExporterWatch& operator=(const ExporterWatch&) = delete;
  bool alive() const;

 private:
  PeerHandle own_;  // set when the exporter is this process
  bool own_process_ = false;
  int pidfd_ = -1;
};

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

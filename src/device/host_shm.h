// Host memory another process on this host can map: the CPU device allocates from anonymous
// shared memory (memfd_create + mmap MAP_SHARED), so a peer maps the same pages and copies
// straight into them (the CPU analogue of CUDA IPC). A memfd has no name in any file system:
// nothing is left behind in /dev/shm or elsewhere when a process is killed; the pages are freed
// when the last mapping and descriptor go.
//
// The exporter keeps the memfd open for the allocation's lifetime; the importer opens it through
// /proc/<pid>/fd/<n> (needs ptrace read access to the exporter: same user, or root), and, where
// that is refused, through pidfd_open + pidfd_getfd (ptrace attach access). The memfd is named
// "kvferry:<token>" with a random 64-bit token the handle carries, and sealed against shrinking
// and growing, so the importer can tell a kvferry memfd of the right allocation from a reused pid
// or descriptor number, and a mapping can never lose its pages to a truncate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/status.h"

namespace kvferry {

// The CPU payload of a peer memory handle (version 2; empty payload: memory of this process only).
struct ShmPayload {
  uint32_t fd = 0;          // the exporter's descriptor of the memfd
  uint64_t offset = 0;      // of the region inside the memfd
  uint64_t file_bytes = 0;  // the memfd's size
  uint64_t token = 0;       // the memfd's name is "kvferry:<token as 16 hex digits>"
};
constexpr size_t kShmPayloadBytes = 28;
std::vector<std::byte> EncodeShmPayload(const ShmPayload& p);
StatusOr<ShmPayload> DecodeShmPayload(std::span<const std::byte> bytes);

// One shared allocation: `bytes` usable at `data` (aligned to `alignment`), backed by `fd`.
struct ShmBlock {
  std::byte* data = nullptr;
  size_t bytes = 0;  // the memfd's size (the request rounded up to pages)
  int fd = -1;
  uint64_t token = 0;
  std::byte* reserved = nullptr;  // the whole address range reserved (alignment padding)
  size_t reserved_bytes = 0;
};
// Allocates from a new memfd; `populate` faults every page in (resident from the start).
StatusOr<ShmBlock> AllocateShm(size_t bytes, size_t alignment, bool populate);
void FreeShm(const ShmBlock& b) noexcept;

// The live shared allocations of one device, found by address.
class ShmTable {
 public:
  void Add(const ShmBlock& b);
  // Removes and returns the block starting at `data` (none: not a shared allocation).
  std::optional<ShmBlock> Take(const void* data);
  // The payload for [base, base + bytes) when it lies inside one live block.
  std::optional<ShmPayload> Find(const void* base, size_t bytes) const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_ = MakeImpl();
  static std::shared_ptr<Impl> MakeImpl();
};

// Maps the region a handle of another process on this host names; errors name pid, descriptor,
// sizes and what the descriptor really is.
StatusOr<std::unique_ptr<PeerMapping>> MapPeerShm(uint32_t pid, uint64_t bytes,
                                                  const ShmPayload& p);

// How the last successful MapPeerShm opened the descriptor ("proc-fd" or "pidfd-getfd"), for logs.
std::string ShmOpenMethod();

}  // namespace kvferry

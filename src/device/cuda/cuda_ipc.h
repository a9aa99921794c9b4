// CUDA IPC peer memory for the CUDA device (Device::ExportMemory / ImportMemory, device.h): a
// region of device memory exported as a peer memory handle (peer_memory.h) naming its whole
// allocation, and opened in another process on the same host. Each peer allocation is opened
// once per process however many importers map it (CUDA maps a handle once per context).
// Private to src/device/cuda/. Thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/status.h"

namespace kvferry::internal::cuda {

// The handle of `bytes` of device memory at `base` (any interior pointer of an allocation) on
// GPU `ordinal`. Refuses other memory kinds, empty regions and regions that run past their
// allocation, naming the values.
StatusOr<std::vector<std::byte>> ExportIpcMemory(int ordinal, const void* base, size_t bytes,
                                                 MemoryKind kind);

// Maps a handle from ExportIpcMemory on GPU `ordinal`: the exporter's own pointer when this
// process made it, else the peer allocation opened through CUDA IPC (closed when the last
// mapping of it goes).
StatusOr<std::unique_ptr<PeerMapping>> ImportIpcMemory(int ordinal,
                                                       std::span<const std::byte> handle);

}  // namespace kvferry::internal::cuda

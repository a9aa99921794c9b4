// Raw transport bandwidth between two connected transports, for benchmark baselines: the same
// processes, the same bytes, no kvferry protocol on top. Works with any Transport (Put needs
// caps().one_sided). Each call drives the transport itself and returns when the bytes are done
// (Put: flushed, i.e. visible at the peer) or at the deadline (kDeadlineExceeded).
//
// Messages cycle through the local buffer (message i starts at (i * message_bytes) % buffer
// size, and likewise in the remote region), so a small buffer can measure a large volume.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "kvferry/device.h"
#include "kvferry/transport.h"

namespace kvferry {

struct BandwidthResult {
  size_t bytes = 0;
  double seconds = 0;
  std::string transports;  // what carried them: Transport::DescribePeer after the run
  double GBps() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
};

struct BandwidthParams {
  size_t total_bytes = size_t{1} << 30;
  size_t message_bytes = size_t{4} << 20;
  int window = 8;  // messages in flight (ucx_perftest ucp_put_bw keeps up to 32 puts in flight)
};

// Puts total_bytes into the peer's registered region [remote_addr, remote_addr + remote_bytes).
StatusOr<BandwidthResult> MeasurePutBandwidth(Transport& t, PeerId peer, const void* local,
                                              size_t local_bytes, MemoryKind kind,
                                              uint64_t remote_addr, size_t remote_bytes,
                                              std::span<const std::byte> rkey,
                                              const BandwidthParams& params, Deadline deadline);

// Tag-sends total_bytes as messages tagged tag_base + i; the peer runs ReceiveBandwidth with the
// same tag_base and params at the same time. Each side returns its own timing.
StatusOr<BandwidthResult> SendBandwidth(Transport& t, PeerId peer, const void* local,
                                        size_t local_bytes, MemoryKind kind, uint64_t tag_base,
                                        const BandwidthParams& params, Deadline deadline);
StatusOr<BandwidthResult> ReceiveBandwidth(Transport& t, PeerId peer, void* local,
                                           size_t local_bytes, MemoryKind kind, uint64_t tag_base,
                                           const BandwidthParams& params, Deadline deadline);

// The copy baseline beside them: one stream copy of `bytes` from `src` to `dst`, the best of
// `reps`, in GB/s.
StatusOr<double> BestCopyGBps(Stream& stream, void* dst, const void* src, size_t bytes, int reps,
                              Deadline deadline);

}  // namespace kvferry

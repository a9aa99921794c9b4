#include "testing/bandwidth.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>

namespace kvferry {
namespace {

using PostFn = std::function<StatusOr<std::unique_ptr<TransportOp>>(size_t index, size_t offset,
                                                                    size_t bytes)>;

Status CheckParams(size_t local_bytes, const BandwidthParams& p) {
  if (p.message_bytes == 0 || p.window <= 0 || p.total_bytes == 0) {
    return Status::InvalidArgument("bandwidth: message_bytes, window and total_bytes must be > 0");
  }
  if (local_bytes < p.message_bytes) {
    return Status::InvalidArgument("bandwidth: buffer of " + std::to_string(local_bytes) +
                                   " bytes is smaller than one message (" +
                                   std::to_string(p.message_bytes) + ")");
  }
  return Status::Ok();
}

// Keeps `window` ops in flight until total_bytes are posted and done.
StatusOr<BandwidthResult> Pump(Transport& t, size_t slots, const BandwidthParams& p,
                               const PostFn& post, Deadline deadline) {
  std::deque<std::unique_ptr<TransportOp>> inflight;
  size_t posted = 0, index = 0;
  const auto start = Clock::now();
  while (posted < p.total_bytes || !inflight.empty()) {
    while (posted < p.total_bytes && inflight.size() < static_cast<size_t>(p.window)) {
      const size_t n = std::min(p.message_bytes, p.total_bytes - posted);
      KVF_ASSIGN_OR_RETURN(auto op, post(index, (index % slots) * p.message_bytes, n));
      inflight.push_back(std::move(op));
      posted += n;
      ++index;
    }
    while (!inflight.empty() && inflight.front()->Done()) {
      KVF_RETURN_IF_ERROR(inflight.front()->status().WithContext("bandwidth op"));
      inflight.pop_front();
    }
    if (inflight.empty()) continue;
    if (Clock::now() > deadline) {
      for (auto& op : inflight) t.Cancel(*op);
      return Status::DeadlineExceeded("bandwidth: " + std::to_string(posted) + " of " +
                                      std::to_string(p.total_bytes) + " bytes posted");
    }
    t.Progress();
  }
  BandwidthResult r;
  r.bytes = p.total_bytes;
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return r;
}

}  // namespace

StatusOr<BandwidthResult> MeasurePutBandwidth(Transport& t, PeerId peer, const void* local,
                                              size_t local_bytes, MemoryKind kind,
                                              uint64_t remote_addr, size_t remote_bytes,
                                              std::span<const std::byte> rkey,
                                              const BandwidthParams& params, Deadline deadline) {
  KVF_RETURN_IF_ERROR(CheckParams(std::min(local_bytes, remote_bytes), params));
  const size_t slots = std::min(local_bytes, remote_bytes) / params.message_bytes;
  const auto* src = static_cast<const std::byte*>(local);
  const auto start = Clock::now();
  KVF_ASSIGN_OR_RETURN(BandwidthResult r, Pump(
                                              t, slots, params,
                                              [&](size_t, size_t off, size_t n) {
                                                return t.Put(peer, src + off, n, kind,
                                                             remote_addr + off, rkey);
                                              },
                                              deadline));
  KVF_ASSIGN_OR_RETURN(auto flush, t.Flush(peer));
  KVF_RETURN_IF_ERROR(WaitOp(t, *flush, deadline).WithContext("bandwidth flush"));
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  r.transports = t.DescribePeer(peer);
  return r;
}

StatusOr<BandwidthResult> SendBandwidth(Transport& t, PeerId peer, const void* local,
                                        size_t local_bytes, MemoryKind kind, uint64_t tag_base,
                                        const BandwidthParams& params, Deadline deadline) {
  KVF_RETURN_IF_ERROR(CheckParams(local_bytes, params));
  const auto* src = static_cast<const std::byte*>(local);
  KVF_ASSIGN_OR_RETURN(BandwidthResult r, Pump(
                                              t, local_bytes / params.message_bytes, params,
                                              [&](size_t i, size_t off, size_t n) {
                                                return t.Send(peer, tag_base + i, src + off, n,
                                                              kind);
                                              },
                                              deadline));
  r.transports = t.DescribePeer(peer);
  return r;
}

StatusOr<BandwidthResult> ReceiveBandwidth(Transport& t, PeerId peer, void* local,
                                           size_t local_bytes, MemoryKind kind, uint64_t tag_base,
                                           const BandwidthParams& params, Deadline deadline) {
  KVF_RETURN_IF_ERROR(CheckParams(local_bytes, params));
  auto* dst = static_cast<std::byte*>(local);
  return Pump(
      t, local_bytes / params.message_bytes, params,
      [&](size_t i, size_t off, size_t n) {
        return t.Recv(peer, tag_base + i, dst + off, n, kind);
      },
      deadline);
}

StatusOr<double> BestCopyGBps(Stream& stream, void* dst, const void* src, size_t bytes, int reps,
                              Deadline deadline) {
  double best = 1e9;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    KVF_RETURN_IF_ERROR(stream.Copy(dst, src, bytes));
    KVF_RETURN_IF_ERROR(stream.Synchronize(deadline));
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return static_cast<double>(bytes) / best / 1e9;
}

}  // namespace kvferry

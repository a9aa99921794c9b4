// Private helpers of the CUDA device: the one conversion of cudaError_t into Status, and the
// move-only owners of CUDA handles (streams, events, pinned regions). Nothing here is visible
// outside src/device/cuda/.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstddef>
#include <string>
#include <utility>

#include "kvferry/status.h"

namespace kvferry::internal::cuda {

// Converts a failed CUDA call into a Status: "<context>: <cudaErrorName> (<description>)", with
// a code the caller can act on (out of memory -> kResourceExhausted, bad arguments ->
// kInvalidArgument, no device or driver -> kUnavailable, anything else -> kInternal). Clears the
// runtime's last-error slot so a non-sticky error does not leak into the next call.
Status CudaError(cudaError_t err, std::string context);

// The one entry point used at every CUDA call site: no formatting on success.
template <typename... Args>
inline Status CudaCheck(cudaError_t err, fmt::format_string<Args...> context, Args&&... args) {
  if (err == cudaSuccess) [[likely]]
    return Status::Ok();
  return CudaError(err, fmt::format(context, std::forward<Args>(args)...));
}

// Owns one cudaStream_t (non-blocking with respect to the legacy default stream). Destroying it
// waits for the stream's queued work first.
class StreamHandle {
 public:
  StreamHandle() = default;
  static StatusOr<StreamHandle> Create();
  ~StreamHandle() { Reset(); }
  StreamHandle(StreamHandle&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  StreamHandle& operator=(StreamHandle&& o) noexcept {
    if (this != &o) {
      Reset();
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  StreamHandle(const StreamHandle&) = delete;
  StreamHandle& operator=(const StreamHandle&) = delete;
  cudaStream_t get() const { return s_; }
  void Reset() noexcept;

 private:
  explicit StreamHandle(cudaStream_t s) : s_(s) {}
  cudaStream_t s_ = nullptr;
};

// Owns one cudaEvent_t; created with cudaEventDisableTiming unless timing is asked for.
class EventHandle {
 public:
  EventHandle() = default;
  static StatusOr<EventHandle> Create(bool timing);
  ~EventHandle() { Reset(); }
  EventHandle(EventHandle&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  EventHandle& operator=(EventHandle&& o) noexcept {
    if (this != &o) {
      Reset();
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  EventHandle(const EventHandle&) = delete;
  EventHandle& operator=(const EventHandle&) = delete;
  cudaEvent_t get() const { return e_; }
  void Reset() noexcept;

 private:
  explicit EventHandle(cudaEvent_t e) : e_(e) {}
  cudaEvent_t e_ = nullptr;
};

// Owns one region of pinned host memory (cudaHostAlloc, portable and mapped). Used for the
// device's internal staging (descriptor rings); user allocations are Buffers.
class PinnedRegion {
 public:
  PinnedRegion() = default;
  static StatusOr<PinnedRegion> Create(size_t bytes);
  ~PinnedRegion() { Reset(); }
  PinnedRegion(PinnedRegion&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  PinnedRegion& operator=(PinnedRegion&& o) noexcept {
    if (this != &o) {
      Reset();
      p_ = std::exchange(o.p_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  PinnedRegion(const PinnedRegion&) = delete;
  PinnedRegion& operator=(const PinnedRegion&) = delete;
  void* get() const { return p_; }
  size_t size() const { return size_; }
  void Reset() noexcept;

 private:
  PinnedRegion(void* p, size_t size) : p_(p), size_(size) {}
  void* p_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kvferry::internal::cuda

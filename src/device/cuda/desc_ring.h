// Descriptor ring. The gather kernel reads its descriptors through the mapped pointer of a
// per-stream pinned ring. A slice of the ring is reused only after the event recorded behind the
// launch that read it has completed; when no slice is free the ring doubles, and the old region is
// freed once the last launch that used it has finished. In steady state a batch allocates nothing.
// The ring is allocated when the stream is created, not at its first batch: CUDA treats a pinned
// host allocation as an implicit synchronization (it waits for work already queued on the GPU), so
// allocating behind a stream that waits on the caller (a host callback, an event of another
// stream) would stall or deadlock. Growing has the same cost and is rare: it happens only when a
// stream keeps more than the initial 16k descriptors in flight. (On the H200, a test that queued
// batches behind a host callback waiting for the enqueuing thread hung while the ring was still
// allocated at first use; the CUDA guide lists page-locked allocation among the implicit
// synchronizations.)
// Private to src/device/cuda/.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "device/cuda/cuda_kernels.h"
#include "device/cuda/cuda_util.h"
#include "kvferry/status.h"

namespace kvferry::internal::cuda {

// A per-stream ring of GatherDesc slots in mapped pinned memory. Reserve() hands out a contiguous
// slice for one launch, Commit() records an event behind that launch; a slice is reused only
// after its event completed. Not thread-safe (a Stream is used by one thread at a time).
class DescRing {
 public:
  static constexpr size_t kInitialSlots = 16384;  // 768 KiB

  // Allocates the initial ring (see the file comment for why this happens up front).
  Status Init() { return Grow(kInitialSlots); }

  // Slots for `n` descriptors, to be written by the host and read by the next launch.
  StatusOr<GatherDesc*> Reserve(size_t n);

  // Marks the reserved slice busy until the work enqueued on `stream` so far has finished.
  Status Commit(cudaStream_t stream);

 private:
  struct Slice {
    size_t start;
    size_t count;
    EventHandle done;
  };
  struct Retired {
    PinnedRegion region;
    EventHandle done;
  };

  void Reclaim();

  bool FindSpace(size_t n, size_t* start) const;

  Status Grow(size_t n);

  PinnedRegion region_;
  size_t capacity_ = 0;  // in descriptors
  size_t head_ = 0;      // one past the newest busy slot
  size_t pending_start_ = 0, pending_count_ = 0;
  std::vector<Slice> inflight_;  // oldest first
  std::vector<EventHandle> spare_;
  std::vector<Retired> retired_;
};

}  // namespace kvferry::internal::cuda

// The CUDA device's kernels, seen from host code. Private to src/device/cuda/.
//
// GatherDesc is the descriptor the batched gather kernel reads: a CopyDesc with fixed-width
// fields, so that host and device agree on its layout. The kernel reads the descriptor array in
// place (mapped pinned host memory or device memory), one thread block per descriptor at a time.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvferry::internal::cuda {

struct GatherDesc {
  uint64_t dst;
  uint64_t src;
  uint64_t bytes;  // bytes per row
  uint64_t rows;   // >= 1
  uint64_t dst_pitch;
  uint64_t src_pitch;
};
static_assert(sizeof(GatherDesc) == 48, "GatherDesc is read as six 64-bit words by the kernel");

// Enqueues one launch of the gather kernel on `stream` copying every descriptor of
// descs[0, count). `descs` must be readable by the device (device memory or mapped pinned host
// memory) until the launch completes; src and dst of each descriptor must be addressable by the
// device (memory of the stream's device or mapped pinned host memory). Destinations of different
// descriptors must not overlap. At most `max_blocks` thread blocks (0: as many as descriptors, up
// to 65535) walk the descriptors in a grid-stride loop: a capped grid leaves room on the SMs for a
// launch of another stream to run beside it. With a cap and fewer descriptors than it, the
// blocks left over share the descriptors' rows, so a few large head-sliced descriptors still
// fill the grid up to the cap. Returns the launch error, if any (not errors of the
// kernel's execution, which surface at the stream's next synchronization).
cudaError_t LaunchGather(const GatherDesc* descs, uint32_t count, uint32_t max_blocks,
                         cudaStream_t stream);

}  // namespace kvferry::internal::cuda

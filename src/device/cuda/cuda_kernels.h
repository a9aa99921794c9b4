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
  // Planes of `rows` rows (CopyDesc::planes), plane q at + q * plane pitch; >= 1. The kernels
  // walk (plane, row) as one row index: a layout conversion's piece of 128 blocks is one
  // descriptor, not 128 (expanding planes on the host cost 2.8 ms of submission per Llama-3-8B
  // TP4 -> TP2 request into per-layer-kv on the H100: 163,840 descriptors).
  uint64_t planes;
  uint64_t dst_plane_pitch;
  uint64_t src_plane_pitch;
};
static_assert(sizeof(GatherDesc) == 72, "GatherDesc is read as nine 64-bit words by the kernels");

// Row `r` of a descriptor's (plane, row) rows: plane r / rows, row r % rows (no division when
// the descriptor has one plane).
__host__ __device__ __forceinline__ uint64_t RowOffset(uint64_t r, uint64_t rows, uint64_t planes,
                                                       uint64_t pitch, uint64_t plane_pitch) {
  if (planes <= 1) return r * pitch;
  const uint64_t q = r / rows;
  return q * plane_pitch + (r - q * rows) * pitch;
}

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

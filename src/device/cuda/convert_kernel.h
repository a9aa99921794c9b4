// The CUDA device's conversion kernel (Stream::ConvertBatch), seen from host code. Private to
// src/device/cuda/.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device/cuda/cuda_kernels.h"

namespace kvferry::internal::cuda {

// Enqueues one launch converting every descriptor of descs[0, count): `bytes` is a destination
// row's bytes (elements of `to`), its source row as many elements of `from`; formats by the value
// of ElementFormat (0 fp32, 1 fp16, 2 bf16, 3 fp8 e4m3). `scales` (null: none) holds each
// descriptor's (src_scale, dst_scale) (CopyDesc), readable by the device like `descs`. Memory and
// grid as LaunchGather's (cuda_kernels.h). Returns the launch error, if any.
cudaError_t LaunchConvert(const GatherDesc* descs, const float2* scales, uint32_t count, int from,
                          int to, uint32_t max_blocks, cudaStream_t stream);

// A descriptor's per-block scales (CopyDesc::src_scales, dst_scales, their strides in floats,
// and its uniform scales for what has no array), read by the device like `descs`.
struct BlockScaleDesc {
  uint64_t src_scales;  // const float*, or 0
  uint64_t dst_scales;  // float*, or 0
  uint64_t src_stride;
  uint64_t dst_stride;
  float src_scale;
  float dst_scale;
};
static_assert(sizeof(BlockScaleDesc) == 40, "BlockScaleDesc travels in the descriptor ring");

// LaunchConvert for a batch with per-block scales: one thread block per (descriptor, plane) at a
// time, each plane a scale group (its amax reduced in the block before the plane is written).
// `max_planes`: the most planes of any descriptor (the grid's second dimension).
cudaError_t LaunchConvertBlockScaled(const GatherDesc* descs, const BlockScaleDesc* scales,
                                     uint32_t count, uint64_t max_planes, int from, int to,
                                     uint32_t max_blocks, cudaStream_t stream);

}  // namespace kvferry::internal::cuda

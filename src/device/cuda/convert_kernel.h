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

}  // namespace kvferry::internal::cuda

// The segment digest kernel (Stream::Digest on CUDA), seen from host code. Private to
// src/device/cuda/.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvferry::internal::cuda {

// One run, as the kernel reads it: the packed bytes of `rows` rows of `bytes` (> 0) bytes, `pitch`
// apart, whose segment digests go to out[first_segment, ...).
struct DigestRunDesc {
  uint64_t data;
  uint64_t bytes;
  uint64_t rows;
  uint64_t pitch;
  uint64_t first_segment;
};
static_assert(sizeof(DigestRunDesc) == 40, "DigestRunDesc is read as five 64-bit words");

// Enqueues the digest of `segments` segments on `stream`: segment g belongs to run
// runs[segment_run[g]] and is its (g - first_segment)-th; out[g] = XXH64 of its bytes
// (digest_core.h). `runs` and `segment_run` must stay readable by the device (device memory or
// mapped pinned host memory) until the launch completes, the runs' bytes must be addressable by the
// device and `out` writable by it. Returns the launch error, if any.
cudaError_t LaunchDigest(const DigestRunDesc* runs, const uint32_t* segment_run, uint64_t segments,
                         uint64_t* out, cudaStream_t stream);

}  // namespace kvferry::internal::cuda

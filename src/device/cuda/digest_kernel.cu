// The segment digest kernel: XXH64 of every kDigestSegmentBytes segment of a list of runs.
//
// XXH64 is sequential within a segment but keeps four independent accumulators, so four
// consecutive threads take one segment, one accumulator (lane) each; the first of them gathers the
// four by warp shuffles, merges them and hashes the tail. The arithmetic is digest_core.h's, the
// same code the host tests run against libxxhash (eight loads in flight per thread).
#include "device/cuda/digest_kernel.h"
#include "device/digest_core.h"

namespace kvferry::internal::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kLanes = 4;

__global__ void __launch_bounds__(kThreads)
    DigestKernel(const DigestRunDesc* runs, const uint32_t* segment_run, uint64_t segments,
                 uint64_t* out) {
  const uint64_t t = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t g = t / kLanes;
  const int lane = static_cast<int>(t % kLanes);
  digest::RowCursor c{nullptr, 1, 0};
  uint64_t start = 0, len = 0, acc = 0;
  if (g < segments) {
    const DigestRunDesc r = runs[segment_run[g]];
    c = digest::RowCursor{reinterpret_cast<const uint8_t*>(r.data), r.bytes, r.pitch};
    start = (g - r.first_segment) * digest::kSegmentBytes;
    const uint64_t total = r.bytes * r.rows;
    len = total - start < digest::kSegmentBytes ? total - start : digest::kSegmentBytes;
    acc = digest::LaneAccumulate(c, start, len, lane);
  }
  // Every thread of the warp takes part in the shuffles (groups of four never straddle a warp).
  const unsigned long long a = acc;
  const uint64_t v1 = __shfl_sync(0xffffffffu, a, 0, kLanes);
  const uint64_t v2 = __shfl_sync(0xffffffffu, a, 1, kLanes);
  const uint64_t v3 = __shfl_sync(0xffffffffu, a, 2, kLanes);
  const uint64_t v4 = __shfl_sync(0xffffffffu, a, 3, kLanes);
  if (g < segments && lane == 0) out[g] = digest::SegmentFinish(c, start, len, v1, v2, v3, v4);
}

}  // namespace

cudaError_t LaunchDigest(const DigestRunDesc* runs, const uint32_t* segment_run, uint64_t segments,
                         uint64_t* out, cudaStream_t stream) {
  if (segments == 0) return cudaSuccess;
  const uint64_t blocks = (segments * kLanes + kThreads - 1) / kThreads;
  DigestKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(runs, segment_run, segments,
                                                                       out);
  return cudaGetLastError();
}

}  // namespace kvferry::internal::cuda

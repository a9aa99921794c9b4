// The batched gather kernel: many small (2-D) copies in one launch.
//
// Each thread block takes descriptors in a grid-stride loop. A descriptor whose addresses,
// pitches and row length are all 16-byte aligned is copied as a flat range of 16-byte vectors
// over (row, column); otherwise each row is copied with the widest access (16, 8, 4, 2 or 1
// bytes) that source and destination share after a short byte-wise head, so unaligned
// fragments still move mostly in wide words. Single-row descriptors use the whole block per
// row; multi-row ones use one warp per row (aligned rows under 2 KiB: the block walks them
// flat). Aligned copies keep four 16-byte loads in flight per thread, narrow rows too.
//
// Few descriptors with many rows (a head-sliced transfer: one descriptor per block, 64 rows of
// 16 KiB each) would leave most SMs idle with one thread block per descriptor. The launch then
// adds a second grid dimension: the gridDim.y blocks of one descriptor split its rows (or, for a
// single row, its vectors) between them, so the grid reaches the block cap whatever the number of
// descriptors. Every byte is still written by exactly one thread.
#include <algorithm>

#include "device/cuda/cuda_kernels.h"

namespace kvferry::internal::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kLoads = 4;  // 16-byte loads in flight per thread on aligned copies (8: no faster)
constexpr uint32_t kMaxBlocks = 65535;
// gridDim.y: blocks sharing one descriptor (a peer-memory batch of head slices can be one
// descriptor of thousands of rows: consecutive blocks merge into one tall 2-D copy).
constexpr uint32_t kMaxParts = 4096;

template <typename T>
__device__ void CopyRowAs(char* d, const char* s, uint64_t n, unsigned lane, unsigned lanes) {
  constexpr uint64_t kW = sizeof(T);
  uint64_t head = (kW - (reinterpret_cast<uintptr_t>(d) & (kW - 1))) & (kW - 1);
  if (head > n) head = n;
  for (uint64_t i = lane; i < head; i += lanes) d[i] = s[i];
  const uint64_t words = (n - head) / kW;
  T* dw = reinterpret_cast<T*>(d + head);
  const T* sw = reinterpret_cast<const T*>(s + head);
  for (uint64_t i = lane; i < words; i += lanes) dw[i] = sw[i];
  for (uint64_t i = head + words * kW + lane; i < n; i += lanes) d[i] = s[i];
}

// Copies n 16-byte vectors with lanes [0, lanes) of the calling group, U loads in flight per
// lane before their stores (over PCIe, latency rather than issue rate limits a lane).
template <int U>
__device__ void CopyVectors(uint4* d, const uint4* s, uint64_t n, unsigned lane, unsigned lanes) {
  uint64_t i = lane;
  for (; i + (U - 1) * static_cast<uint64_t>(lanes) < n; i += U * static_cast<uint64_t>(lanes)) {
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; ++k) v[k] = s[i + k * lanes];
#pragma unroll
    for (int k = 0; k < U; ++k) d[i + k * lanes] = v[k];
  }
  for (; i < n; i += lanes) d[i] = s[i];
}

// Copies one row of n bytes with lanes [0, lanes) of the calling group of threads.
__device__ void CopyRow(char* d, const char* s, uint64_t n, unsigned lane, unsigned lanes) {
  const uintptr_t mis = reinterpret_cast<uintptr_t>(d) ^ reinterpret_cast<uintptr_t>(s);
  if ((mis & 15) == 0) {
    CopyRowAs<uint4>(d, s, n, lane, lanes);
  } else if ((mis & 7) == 0) {
    CopyRowAs<uint2>(d, s, n, lane, lanes);
  } else if ((mis & 3) == 0) {
    CopyRowAs<uint32_t>(d, s, n, lane, lanes);
  } else if ((mis & 1) == 0) {
    CopyRowAs<uint16_t>(d, s, n, lane, lanes);
  } else {
    for (uint64_t i = lane; i < n; i += lanes) d[i] = s[i];
  }
}

__global__ void __launch_bounds__(kThreads) GatherKernel(const GatherDesc* descs, uint32_t count) {
  __shared__ GatherDesc desc;
  // This block's share of each descriptor: part `part` of `parts` (gridDim.y).
  const unsigned part = blockIdx.y, parts = gridDim.y;
  const unsigned tid = part * blockDim.x + threadIdx.x, threads = parts * blockDim.x;
  const unsigned warps_per_block = blockDim.x / kWarp;
  const unsigned warp = part * warps_per_block + threadIdx.x / kWarp;
  const unsigned warps = parts * warps_per_block;
  for (uint32_t i = blockIdx.x; i < count; i += gridDim.x) {
    if (threadIdx.x < sizeof(GatherDesc) / sizeof(uint64_t)) {
      reinterpret_cast<uint64_t*>(&desc)[threadIdx.x] =
          reinterpret_cast<const uint64_t*>(descs + i)[threadIdx.x];
    }
    __syncthreads();
    char* dst = reinterpret_cast<char*>(desc.dst);
    const char* src = reinterpret_cast<const char*>(desc.src);
    const uint64_t bytes = desc.bytes, rows = desc.rows, planes = desc.planes;
    const uint64_t dp = desc.dst_pitch, sp = desc.src_pitch;
    const uint64_t dpp = desc.dst_plane_pitch, spp = desc.src_plane_pitch;
    // Rows of all planes, as one index (RowOffset); a single row per plane never comes (the host
    // makes planes of single rows rows).
    const uint64_t all_rows = rows * planes;
    const uint64_t all =
        desc.dst | desc.src | bytes | (rows > 1 ? (dp | sp) : 0) | (planes > 1 ? (dpp | spp) : 0);
    const auto dst_row = [&](uint64_t r) { return dst + RowOffset(r, rows, planes, dp, dpp); };
    const auto src_row = [&](uint64_t r) { return src + RowOffset(r, rows, planes, sp, spp); };
    if ((all & 15) == 0) {
      const uint64_t per_row = bytes / 16;
      if (all_rows == 1) {
        CopyVectors<kLoads>(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src),
                            per_row, tid, threads);
      } else if (per_row >= kWarp * kLoads) {  // rows of 2 KiB or more: one warp per row
        for (uint64_t r = warp; r < all_rows; r += warps) {
          CopyVectors<kLoads>(reinterpret_cast<uint4*>(dst_row(r)),
                              reinterpret_cast<const uint4*>(src_row(r)), per_row,
                              threadIdx.x % kWarp, kWarp);
        }
      } else {
        // Narrow rows, walked flat over (row, vector), kLoads vectors in flight per thread
        // (gather_kernel_bench_test on the H200, 256-byte rows: one vector at a time moved 0.66
        // of a cudaMemcpy of the same bytes, four 0.96, each beside its run's cudaMemcpy). Rows
        // under kLoads vectors a lane (2 KiB) come here too: a warp per row left a lane one
        // vector in flight on 512-byte rows (vLLM NHD -> HND, 0.64 of a cudaMemcpy on the H100).
        const uint64_t total = per_row * all_rows;
        auto at = [&](const char* base, uint64_t pitch, uint64_t plane_pitch, uint64_t u) {
          const uint64_t r = u / per_row;
          return base + RowOffset(r, rows, planes, pitch, plane_pitch) + (u - r * per_row) * 16;
        };
        uint64_t u = tid;
        for (; u + (kLoads - 1) * static_cast<uint64_t>(threads) < total;
             u += kLoads * static_cast<uint64_t>(threads)) {
          uint4 v[kLoads];
#pragma unroll
          for (int k = 0; k < kLoads; ++k) {
            v[k] = *reinterpret_cast<const uint4*>(at(src, sp, spp, u + k * threads));
          }
#pragma unroll
          for (int k = 0; k < kLoads; ++k) {
            *reinterpret_cast<uint4*>(const_cast<char*>(at(dst, dp, dpp, u + k * threads))) = v[k];
          }
        }
        for (; u < total; u += threads) {
          *reinterpret_cast<uint4*>(const_cast<char*>(at(dst, dp, dpp, u))) =
              *reinterpret_cast<const uint4*>(at(src, sp, spp, u));
        }
      }
    } else if (all_rows == 1) {
      CopyRow(dst, src, bytes, tid, threads);
    } else {
      for (uint64_t r = warp; r < all_rows; r += warps) {
        CopyRow(dst_row(r), src_row(r), bytes, threadIdx.x % kWarp, kWarp);
      }
    }
    __syncthreads();  // `desc` is overwritten by the next iteration
  }
}

}  // namespace

cudaError_t LaunchGather(const GatherDesc* descs, uint32_t count, uint32_t max_blocks,
                         cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const uint32_t cap = max_blocks == 0 ? kMaxBlocks : std::min(max_blocks, kMaxBlocks);
  const uint32_t blocks = std::min(count, cap);
  // Fewer descriptors than the cap: the spare blocks share the descriptors' rows (file comment).
  const uint32_t parts = max_blocks == 0 ? 1 : std::min<uint32_t>(cap / blocks, kMaxParts);
  GatherKernel<<<dim3(blocks, parts), kThreads, 0, stream>>>(descs, count);
  return cudaGetLastError();
}

}  // namespace kvferry::internal::cuda

// The batched conversion kernel (Stream::ConvertBatch): the gather kernel's walk (cuda_kernels.cu:
// descriptors in a grid-stride loop over blockIdx.x, gridDim.y blocks sharing one descriptor's
// rows), each element converted on the way by convert_core.h, the arithmetic the host uses, so
// both write the same bytes.
//
// A thread takes a group of elements at a time, 16 bytes at least on each side (8 for bf16 ->
// fp16, 16 for bf16 -> fp8), loaded and stored whole when both rows, both pitches and the row
// length allow it (every group aligned on both sides); otherwise one element at a time. A thread
// steps through (row, group) by a fixed stride, carrying the group index into the row instead of
// dividing (a 64-bit division per step held bf16 -> fp8 to 0.35 of a copy on the H100).
#include <algorithm>

#include "device/convert_core.h"
#include "device/cuda/convert_kernel.h"

namespace kvferry::internal::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr uint32_t kMaxBlocks = 65535;
constexpr uint32_t kMaxParts = 4096;

template <int F>
struct Format;
template <>
struct Format<0> {  // fp32
  using Bits = uint32_t;
  static __device__ uint32_t Widen(uint32_t v) { return v; }
  static __device__ uint32_t Narrow(uint32_t x) {
    const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
    return nan ? (x & 0x80000000u) | convert::kF32QuietNan : x;
  }
};
template <>
struct Format<1> {  // fp16
  using Bits = uint16_t;
  static __device__ uint32_t Widen(uint32_t v) { return convert::Fp16ToF32(v); }
  static __device__ uint32_t Narrow(uint32_t x) { return convert::F32ToFp16(x); }
};
template <>
struct Format<2> {  // bf16
  using Bits = uint16_t;
  static __device__ uint32_t Widen(uint32_t v) { return convert::Bf16ToF32(v); }
  static __device__ uint32_t Narrow(uint32_t x) { return convert::F32ToBf16(x); }
};
template <>
struct Format<3> {  // fp8 e4m3
  using Bits = uint8_t;
  static __device__ uint32_t Widen(uint32_t v) { return convert::E4m3ToF32(v); }
  static __device__ uint32_t Narrow(uint32_t x) { return convert::F32ToE4m3(x); }
};

// N elements of T as one aligned access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// One element: widened, rescaled when the descriptor has scales (uniform across the block),
// narrowed.
template <int From, int To>
__device__ __forceinline__ uint32_t ConvertOne(uint32_t v, bool scaled, float2 s) {
  const uint32_t wide = Format<From>::Widen(v);
  return Format<To>::Narrow(scaled ? convert::Rescale(wide, s.x, s.y) : wide);
}

template <int From, int To>
__global__ void __launch_bounds__(kThreads)
    ConvertKernel(const GatherDesc* descs, const float2* scales, uint32_t count) {
  using In = typename Format<From>::Bits;
  using Out = typename Format<To>::Bits;
  constexpr int kGroup = 16 / (sizeof(In) < sizeof(Out) ? sizeof(In) : sizeof(Out));
  __shared__ GatherDesc desc;
  const unsigned part = blockIdx.y, parts = gridDim.y;
  const unsigned tid = part * blockDim.x + threadIdx.x, threads = parts * blockDim.x;
  for (uint32_t i = blockIdx.x; i < count; i += gridDim.x) {
    if (threadIdx.x < sizeof(GatherDesc) / sizeof(uint64_t)) {
      reinterpret_cast<uint64_t*>(&desc)[threadIdx.x] =
          reinterpret_cast<const uint64_t*>(descs + i)[threadIdx.x];
    }
    __syncthreads();
    const float2 s = scales != nullptr ? scales[i] : make_float2(1.0f, 1.0f);
    const bool scaled = s.x != 1.0f || s.y != 1.0f;
    const uint64_t n = desc.bytes / sizeof(Out);  // elements per row
    const uint64_t rows = desc.rows, planes = desc.planes;
    const uint64_t dp = rows > 1 ? desc.dst_pitch : 0, sp = rows > 1 ? desc.src_pitch : 0;
    const uint64_t dpp = planes > 1 ? desc.dst_plane_pitch : 0;
    const uint64_t spp = planes > 1 ? desc.src_plane_pitch : 0;
    const uint64_t all_rows = rows * planes;  // (plane, row) as one index (RowOffset)
    char* dst = reinterpret_cast<char*>(desc.dst);
    const char* src = reinterpret_cast<const char*>(desc.src);
    const bool grouped = n % kGroup == 0 && (desc.src | sp | spp) % (sizeof(In) * kGroup) == 0 &&
                         (desc.dst | dp | dpp) % (sizeof(Out) * kGroup) == 0;
    if (grouped) {
      const uint64_t per_row = n / kGroup;
      const uint64_t row_step = threads / per_row, group_step = threads % per_row;
      uint64_t r = tid / per_row, g = tid % per_row;
      for (; r < all_rows; r += row_step, g += group_step) {
        if (g >= per_row) {  // carry into the next row (group_step < per_row)
          g -= per_row;
          if (++r >= all_rows) break;
        }
        const auto in = *reinterpret_cast<const Pack<In, kGroup>*>(
            src + RowOffset(r, rows, planes, sp, spp) + g * kGroup * sizeof(In));
        Pack<Out, kGroup> out;
#pragma unroll
        for (int k = 0; k < kGroup; ++k) {
          out.v[k] = static_cast<Out>(ConvertOne<From, To>(in.v[k], scaled, s));
        }
        *reinterpret_cast<Pack<Out, kGroup>*>(dst + RowOffset(r, rows, planes, dp, dpp) +
                                              g * kGroup * sizeof(Out)) = out;
      }
    } else {
      const uint64_t total = n * all_rows;
      for (uint64_t u = tid; u < total; u += threads) {
        const uint64_t r = u / n, e = u - r * n;
        const In v = *reinterpret_cast<const In*>(src + RowOffset(r, rows, planes, sp, spp) +
                                                  e * sizeof(In));
        *reinterpret_cast<Out*>(dst + RowOffset(r, rows, planes, dp, dpp) + e * sizeof(Out)) =
            static_cast<Out>(ConvertOne<From, To>(v, scaled, s));
      }
    }
    __syncthreads();  // `desc` is overwritten by the next iteration
  }
}

// Per-block scales (CopyDesc::src_scales, dst_scales): a warp takes one (descriptor, plane) at a
// time, blockIdx.x over descriptors and (blockIdx.y, warp) over planes, so a plane's amax is
// reduced within one warp (__reduce_max_sync, no shared memory or block barrier): a first pass
// over the plane's rows (reading them into the caches), the scale, then the rows converted as
// ConvertKernel does. A plane is a KV block's rows of one head (16-128 tokens of a head_dim),
// too little for a thread block. On the H200 a block per plane and a warp per plane both ran
// 0.16-0.18 of a copy of the source bytes: the per-element arithmetic bounds it, not the
// reduction. The plane's lanes walk (row, group) with a 32-bit division.
template <int From, int To>
__global__ void __launch_bounds__(kThreads)
    ConvertBlockScaledKernel(const GatherDesc* descs, const BlockScaleDesc* scales,
                             uint32_t count) {
  using In = typename Format<From>::Bits;
  using Out = typename Format<To>::Bits;
  constexpr int kGroup = 16 / (sizeof(In) < sizeof(Out) ? sizeof(In) : sizeof(Out));
  __shared__ GatherDesc desc;
  __shared__ BlockScaleDesc sd;
  for (uint32_t i = blockIdx.x; i < count; i += gridDim.x) {
    if (threadIdx.x < sizeof(GatherDesc) / sizeof(uint64_t)) {
      reinterpret_cast<uint64_t*>(&desc)[threadIdx.x] =
          reinterpret_cast<const uint64_t*>(descs + i)[threadIdx.x];
    }
    if (threadIdx.x < sizeof(BlockScaleDesc) / sizeof(uint64_t)) {
      reinterpret_cast<uint64_t*>(&sd)[threadIdx.x] =
          reinterpret_cast<const uint64_t*>(scales + i)[threadIdx.x];
    }
    __syncthreads();
    const uint32_t n = static_cast<uint32_t>(desc.bytes / sizeof(Out));  // elements per row
    const uint32_t rows = static_cast<uint32_t>(desc.rows);
    const uint64_t planes = desc.planes;
    const uint64_t dp = rows > 1 ? desc.dst_pitch : 0, sp = rows > 1 ? desc.src_pitch : 0;
    const uint64_t dpp = planes > 1 ? desc.dst_plane_pitch : 0;
    const uint64_t spp = planes > 1 ? desc.src_plane_pitch : 0;
    const bool grouped = n % kGroup == 0 && (desc.src | sp | spp) % (sizeof(In) * kGroup) == 0 &&
                         (desc.dst | dp | dpp) % (sizeof(Out) * kGroup) == 0;
    const uint32_t per_row = grouped ? n / kGroup : n;  // work items per row
    const uint32_t items = per_row * rows;
    const auto* src_scales = reinterpret_cast<const float*>(sd.src_scales);
    auto* dst_scales = reinterpret_cast<float*>(sd.dst_scales);
    const bool travel = From == To && src_scales != nullptr && dst_scales != nullptr;
    const uint32_t lane = threadIdx.x % 32;
    for (uint64_t q = uint64_t{blockIdx.y} * kWarps + threadIdx.x / 32; q < planes;
         q += uint64_t{gridDim.y} * kWarps) {
      const char* src = reinterpret_cast<const char*>(desc.src) + q * spp;
      char* dst = reinterpret_cast<char*>(desc.dst) + q * dpp;
      const float s_src = src_scales != nullptr ? src_scales[q * sd.src_stride] : sd.src_scale;
      float s_dst = sd.dst_scale;
      if (travel) {
        if (lane == 0) dst_scales[q * sd.dst_stride] = s_src;
      } else if (dst_scales != nullptr) {
        uint32_t m = 0;
        for (uint32_t u = lane; u < items; u += 32) {
          const uint32_t r = u / per_row, g = u - r * per_row;
          if (grouped) {
            const auto in =
                *reinterpret_cast<const Pack<In, kGroup>*>(src + r * sp + g * kGroup * sizeof(In));
#pragma unroll
            for (int k = 0; k < kGroup; ++k) {
              m = max(m, convert::FiniteMagnitude(Format<From>::Widen(in.v[k])));
            }
          } else {
            const In v = *reinterpret_cast<const In*>(src + r * sp + g * sizeof(In));
            m = max(m, convert::FiniteMagnitude(Format<From>::Widen(v)));
          }
        }
        s_dst = convert::BlockScale(__reduce_max_sync(0xffffffffu, m), s_src);
        if (lane == 0) dst_scales[q * sd.dst_stride] = s_dst;
      }
      const bool scaled = !travel && (s_src != 1.0f || s_dst != 1.0f);
      const float2 s = make_float2(s_src, s_dst);
      for (uint32_t u = lane; u < items; u += 32) {
        const uint32_t r = u / per_row, g = u - r * per_row;
        if (grouped) {
          const auto in =
              *reinterpret_cast<const Pack<In, kGroup>*>(src + r * sp + g * kGroup * sizeof(In));
          Pack<Out, kGroup> out;
#pragma unroll
          for (int k = 0; k < kGroup; ++k) {
            out.v[k] = travel ? static_cast<Out>(in.v[k])
                              : static_cast<Out>(ConvertOne<From, To>(in.v[k], scaled, s));
          }
          *reinterpret_cast<Pack<Out, kGroup>*>(dst + r * dp + g * kGroup * sizeof(Out)) = out;
        } else {
          const In v = *reinterpret_cast<const In*>(src + r * sp + g * sizeof(In));
          *reinterpret_cast<Out*>(dst + r * dp + g * sizeof(Out)) =
              travel ? static_cast<Out>(v) : static_cast<Out>(ConvertOne<From, To>(v, scaled, s));
        }
      }
    }
    __syncthreads();  // `desc` is overwritten by the next iteration
  }
}

using Kernel = void (*)(const GatherDesc*, const float2*, uint32_t);
using BlockScaledKernel = void (*)(const GatherDesc*, const BlockScaleDesc*, uint32_t);

// The kernel instance for (from, to): Pick<From, To>() of a functor templated on both.
template <typename K, int From, typename Pick>
K KernelTo(int to, Pick pick) {
  switch (to) {
    case 0:
      return pick.template operator()<From, 0>();
    case 1:
      return pick.template operator()<From, 1>();
    case 2:
      return pick.template operator()<From, 2>();
    case 3:
      return pick.template operator()<From, 3>();
  }
  return nullptr;
}

template <typename K, typename Pick>
K KernelFor(int from, int to, Pick pick) {
  switch (from) {
    case 0:
      return KernelTo<K, 0>(to, pick);
    case 1:
      return KernelTo<K, 1>(to, pick);
    case 2:
      return KernelTo<K, 2>(to, pick);
    case 3:
      return KernelTo<K, 3>(to, pick);
  }
  return nullptr;
}

struct PickConvert {
  template <int From, int To>
  Kernel operator()() const {
    return &ConvertKernel<From, To>;
  }
};
struct PickBlockScaled {
  template <int From, int To>
  BlockScaledKernel operator()() const {
    return &ConvertBlockScaledKernel<From, To>;
  }
};

}  // namespace

cudaError_t LaunchConvert(const GatherDesc* descs, const float2* scales, uint32_t count, int from,
                          int to, uint32_t max_blocks, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const Kernel kernel = KernelFor<Kernel>(from, to, PickConvert{});
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const uint32_t cap = max_blocks == 0 ? kMaxBlocks : std::min(max_blocks, kMaxBlocks);
  const uint32_t blocks = std::min(count, cap);
  // As the gather kernel: spare blocks of the cap share the descriptors' rows. Uncapped (0), a
  // few tall descriptors still get up to 256 blocks each (conversion is arithmetic too).
  const uint32_t parts = std::min<uint32_t>(
      max_blocks == 0 ? std::max<uint32_t>(1, 1024 / blocks) : cap / blocks, kMaxParts);
  kernel<<<dim3(blocks, parts), kThreads, 0, stream>>>(descs, scales, count);
  return cudaGetLastError();
}

cudaError_t LaunchConvertBlockScaled(const GatherDesc* descs, const BlockScaleDesc* scales,
                                     uint32_t count, uint64_t max_planes, int from, int to,
                                     uint32_t max_blocks, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const BlockScaledKernel kernel = KernelFor<BlockScaledKernel>(from, to, PickBlockScaled{});
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const uint32_t cap = max_blocks == 0 ? kMaxBlocks : std::min(max_blocks, kMaxBlocks);
  const uint32_t blocks = std::min(count, cap);
  // Enough (descriptor, plane) warps to fill the GPU: the cap's spare blocks go to planes, a
  // warp each.
  const uint64_t want = std::max<uint64_t>(1, std::max<uint32_t>(cap, 1024) / blocks);
  const uint64_t plane_blocks = (std::max<uint64_t>(max_planes, 1) + kWarps - 1) / kWarps;
  const uint32_t parts =
      static_cast<uint32_t>(std::min<uint64_t>(std::min(plane_blocks, want), kMaxBlocks));
  kernel<<<dim3(blocks, parts), kThreads, 0, stream>>>(descs, scales, count);
  return cudaGetLastError();
}

}  // namespace kvferry::internal::cuda

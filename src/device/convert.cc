#include "device/convert.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "device/convert_core.h"
#include "device/convert_rows.h"

namespace kvferry {

int ElementFormatSize(ElementFormat format) { return static_cast<int>(Width(format)); }

std::string_view ElementFormatName(ElementFormat format) {
  switch (format) {
    case ElementFormat::kFp32:
      return "fp32";
    case ElementFormat::kFp16:
      return "fp16";
    case ElementFormat::kBf16:
      return "bf16";
    case ElementFormat::kFp8E4m3:
      return "fp8";
  }
  return "unknown";
}

Status Stream::ConvertBatch(std::span<const CopyDesc>, Conversion conversion) {
  return Status::InvalidArgument(fmt::format("this stream does not convert elements ({} to {})",
                                             ElementFormatName(conversion.from),
                                             ElementFormatName(conversion.to)));
}

namespace {

#if defined(__x86_64__)
// CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports does not know "f16c"); the AVX it
// needs is checked with avx2, OS support of the vector state included.
bool HasF16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & (1u << 29)) != 0;
}
#endif

bool PathRuns(ConvertPath path) {
  switch (path) {
    case ConvertPath::kPortable:
      return true;
#if defined(__x86_64__)
    case ConvertPath::kAvx2: {
      static const bool has = __builtin_cpu_supports("avx2") && HasF16c();
      return has;
    }
    case ConvertPath::kAvx512: {
      static const bool has = __builtin_cpu_supports("avx512f") &&
                              __builtin_cpu_supports("avx512bw") &&
                              __builtin_cpu_supports("avx512vl") && HasF16c();
      return has;
    }
#else
    default:
      return false;
#endif
  }
  return false;
}

ConvertPath BestPath() {
  static const ConvertPath best = PathRuns(ConvertPath::kAvx512) ? ConvertPath::kAvx512
                                  : PathRuns(ConvertPath::kAvx2) ? ConvertPath::kAvx2
                                                                 : ConvertPath::kPortable;
  return best;
}

using RowFn = void (*)(std::byte* dst, const std::byte* src, size_t n);
using ScaledRowFn = void (*)(std::byte* dst, const std::byte* src, size_t n, float src_scale,
                             float dst_scale);

template <ElementFormat From, ElementFormat To>
void PortableRow(std::byte* dst, const std::byte* src, size_t n) {
  RowScalar<From, To>(dst, src, 0, n);
}

template <ElementFormat From, ElementFormat To>
RowFn Pick(ConvertPath path) {
#if defined(__x86_64__)
  if (path == ConvertPath::kAvx512) return &RowAvx512<From, To>;
  if (path == ConvertPath::kAvx2) return &RowAvx2<From, To>;
#endif
  return &PortableRow<From, To>;
}

// fn.template operator()<From, To>() for the conversion's pair of formats (the loops are
// templates over both): one dispatch for the plain and the scaled rows.
template <ElementFormat From, typename Fn>
auto DispatchTo(ElementFormat to, Fn&& fn) {
  switch (to) {
    case ElementFormat::kFp32:
      return fn.template operator()<From, ElementFormat::kFp32>();
    case ElementFormat::kFp16:
      return fn.template operator()<From, ElementFormat::kFp16>();
    case ElementFormat::kBf16:
      return fn.template operator()<From, ElementFormat::kBf16>();
    case ElementFormat::kFp8E4m3:
      break;
  }
  return fn.template operator()<From, ElementFormat::kFp8E4m3>();
}

template <typename Fn>
auto Dispatch(Conversion c, Fn&& fn) {
  switch (c.from) {
    case ElementFormat::kFp32:
      return DispatchTo<ElementFormat::kFp32>(c.to, fn);
    case ElementFormat::kFp16:
      return DispatchTo<ElementFormat::kFp16>(c.to, fn);
    case ElementFormat::kBf16:
      return DispatchTo<ElementFormat::kBf16>(c.to, fn);
    case ElementFormat::kFp8E4m3:
      break;
  }
  return DispatchTo<ElementFormat::kFp8E4m3>(c.to, fn);
}

RowFn RowFor(Conversion c, ConvertPath path = BestPath()) {
  return Dispatch(c, [&]<ElementFormat From, ElementFormat To>() { return Pick<From, To>(path); });
}

// Scaled rows run AVX-512 or AVX2 where the CPU has them, one element at a time elsewhere.
template <ElementFormat From, ElementFormat To>
ScaledRowFn PickScaled(ConvertPath path) {
#if defined(__x86_64__)
  if (path == ConvertPath::kAvx512) return &ScaledRowAvx512<From, To>;
  if (path == ConvertPath::kAvx2) return &ScaledRowAvx2<From, To>;
#endif
  (void)path;
  return &ScaledRow<From, To>;
}

ScaledRowFn ScaledRowFor(Conversion c, ConvertPath path = BestPath()) {
  return Dispatch(
      c, [&]<ElementFormat From, ElementFormat To>() { return PickScaled<From, To>(path); });
}

using PlaneMaxFn = uint32_t (*)(const std::byte* src, size_t rows, size_t pitch, size_t n);

// The amax loop of per-block scales for `f` on `path` (AVX-512 CPUs run the AVX2 one).
PlaneMaxFn PlaneMaxFor(ElementFormat f, ConvertPath path = BestPath()) {
  return Dispatch({f, f}, [&]<ElementFormat From, ElementFormat>() -> PlaneMaxFn {
#if defined(__x86_64__)
    if (path != ConvertPath::kPortable) return &PlaneMaxAvx2<From>;
#endif
    (void)path;
    return &PlaneMaxScalar<From>;
  });
}

// Asks for the cache lines of `bytes` at `p` (a no-op where the platform has no prefetch).
void PrefetchRow(const std::byte* p, size_t bytes) {
#if defined(__x86_64__)
  for (size_t o = 0; o < bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + o, _MM_HINT_T0);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace

void ConvertElements(void* dst, const void* src, size_t count, Conversion c) {
  if (c.from == c.to) {
    ScaledRowFor(c)(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), count, 1, 1);
    return;
  }
  RowFor(c)(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), count);
}

void ConvertElementsScaled(void* dst, const void* src, size_t count, Conversion c, float src_scale,
                           float dst_scale) {
  ScaledRowFor(c)(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), count,
                  src_scale, dst_scale);
}

bool ConvertElementsScaledWith(ConvertPath path, void* dst, const void* src, size_t count,
                               Conversion c, float src_scale, float dst_scale) {
  if (!PathRuns(path)) return false;
  ScaledRowFor(c, path)(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), count,
                        src_scale, dst_scale);
  return true;
}

bool ConvertElementsWith(ConvertPath path, void* dst, const void* src, size_t count, Conversion c) {
  if (!PathRuns(path) || c.from == c.to) return false;
  RowFor(c, path)(static_cast<std::byte*>(dst), static_cast<const std::byte*>(src), count);
  return true;
}

bool PlaneMaxMagnitudeWith(ConvertPath path, ElementFormat format, const void* src, size_t rows,
                           size_t pitch, size_t count, uint32_t* out) {
  if (!PathRuns(path)) return false;
  *out = PlaneMaxFor(format, path)(static_cast<const std::byte*>(src), rows, pitch, count);
  return true;
}

uint32_t ConvertElement(uint32_t bits, Conversion c, float src_scale, float dst_scale) {
  std::byte in[4], out[4] = {};
  std::memcpy(in, &bits, sizeof in);  // little-endian: the low bytes are the element
  ConvertElementsScaled(out, in, 1, c, src_scale, dst_scale);
  uint32_t r = 0;
  std::memcpy(&r, out, sizeof r);
  const int bits_out = 8 * ElementFormatSize(c.to);
  return bits_out == 32 ? r : r & ((1u << bits_out) - 1);
}

Status CheckConversion(std::span<const CopyDesc> copies, Conversion c) {
  const int in = ElementFormatSize(c.from);
  const int out = ElementFormatSize(c.to);
  if (in == 0 || out == 0) {
    return Status::InvalidArgument(fmt::format("conversion between unknown element formats {}, {}",
                                               static_cast<int>(c.from), static_cast<int>(c.to)));
  }
  for (size_t i = 0; i < copies.size(); ++i) {
    const CopyDesc& d = copies[i];
    if (d.bytes % static_cast<size_t>(out) != 0) {
      return Status::InvalidArgument(
          fmt::format("ConvertBatch descriptor {}: {} bytes are not whole {} elements", i, d.bytes,
                      ElementFormatName(c.to)));
    }
    if (!(std::isfinite(d.src_scale) && d.src_scale > 0 && std::isfinite(d.dst_scale) &&
          d.dst_scale > 0)) {
      return Status::InvalidArgument(
          fmt::format("ConvertBatch descriptor {}: scales {} and {} must be finite and positive", i,
                      d.src_scale, d.dst_scale));
    }
    const bool travel = c.from == c.to && d.src_scales != nullptr;
    if (d.dst_scales != nullptr && c.to != ElementFormat::kFp8E4m3 && !travel) {
      return Status::InvalidArgument(fmt::format(
          "ConvertBatch descriptor {}: per-block destination scales are computed for fp8 only, "
          "and the destination is {}",
          i, ElementFormatName(c.to)));
    }
    if (d.dst_scales != nullptr && d.planes > 1 && d.dst_scale_stride == 0) {
      return Status::InvalidArgument(fmt::format(
          "ConvertBatch descriptor {}: {} planes would write one destination scale (stride 0)", i,
          d.planes));
    }
  }
  return Status::Ok();
}

namespace {

// A descriptor with per-block scales (CopyDesc::src_scales, dst_scales), plane by plane: each
// plane's source scale read, its destination scale computed (or, from == to with both, the source
// scale travelling), then its rows converted.
void ConvertBlockScaled(const CopyDesc& d, Conversion c, ScaledRowFn scaled_row,
                        PlaneMaxFn plane_max) {
  const size_t count = d.bytes / static_cast<size_t>(ElementFormatSize(c.to));
  const size_t rows = d.rows < 1 ? 1 : d.rows;
  const size_t planes = d.planes < 1 ? 1 : d.planes;
  const bool travel = c.from == c.to && d.src_scales != nullptr && d.dst_scales != nullptr;
  for (size_t q = 0; q < planes; ++q) {
    const auto* src =
        static_cast<const std::byte*>(d.src) + (planes > 1 ? q * d.src_plane_pitch : 0);
    auto* dst = static_cast<std::byte*>(d.dst) + (planes > 1 ? q * d.dst_plane_pitch : 0);
    const float src_scale = d.src_scales ? d.src_scales[q * d.src_scale_stride] : d.src_scale;
    float dst_scale = d.dst_scale;
    if (travel) {
      d.dst_scales[q * d.dst_scale_stride] = src_scale;
      for (size_t r = 0; r < rows; ++r) {
        std::memcpy(dst + (rows > 1 ? r * d.dst_pitch : 0), src + (rows > 1 ? r * d.src_pitch : 0),
                    d.bytes);
      }
      continue;
    }
    if (d.dst_scales != nullptr) {
      dst_scale =
          convert::BlockScale(plane_max(src, rows, rows > 1 ? d.src_pitch : 0, count), src_scale);
      d.dst_scales[q * d.dst_scale_stride] = dst_scale;
    }
    for (size_t r = 0; r < rows; ++r) {
      scaled_row(dst + (rows > 1 ? r * d.dst_pitch : 0), src + (rows > 1 ? r * d.src_pitch : 0),
                 count, src_scale, dst_scale);
    }
  }
}

}  // namespace

void ConvertHostBatch(std::span<const CopyDesc> copies, Conversion c) {
  const RowFn row = c.from == c.to ? nullptr : RowFor(c);
  const ScaledRowFn scaled_row = ScaledRowFor(c);
  const PlaneMaxFn plane_max = PlaneMaxFor(c.from);
  const size_t out_size = static_cast<size_t>(ElementFormatSize(c.to));
  for (const CopyDesc& d : copies) {
    if (d.block_scaled()) {
      ConvertBlockScaled(d, c, scaled_row, plane_max);
      continue;
    }
    const size_t count = d.bytes / out_size;
    // Pitched rows (a 256-byte head row of a KV block) are too short for the loops' own prefetch:
    // the rows about kPrefetchBytes ahead are fetched instead.
    const size_t src_row = count * static_cast<size_t>(ElementFormatSize(c.from));
    const size_t ahead = std::max<size_t>(1, kPrefetchBytes / std::max<size_t>(src_row, 1));
    const size_t rows = d.rows < 1 ? 1 : d.rows;
    const size_t planes = d.planes < 1 ? 1 : d.planes;
    for (size_t q = 0; q < planes; ++q) {
      const auto* src =
          static_cast<const std::byte*>(d.src) + (planes > 1 ? q * d.src_plane_pitch : 0);
      auto* dst = static_cast<std::byte*>(d.dst) + (planes > 1 ? q * d.dst_plane_pitch : 0);
      for (size_t r = 0; r < rows; ++r) {
        if (rows > 1 && r + ahead < rows) PrefetchRow(src + (r + ahead) * d.src_pitch, src_row);
        std::byte* to = dst + (rows > 1 ? r * d.dst_pitch : 0);
        const std::byte* from = src + (rows > 1 ? r * d.src_pitch : 0);
        if (row != nullptr && !d.scaled()) {
          row(to, from, count);
        } else {
          scaled_row(to, from, count, d.src_scale, d.dst_scale);
        }
      }
    }
  }
}

}  // namespace kvferry

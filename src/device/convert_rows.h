// The element conversion loops of convert.cc, one row at a time: the portable one (each element
// through convert_core.h) and, on x86-64, AVX2+F16C and AVX-512 ones that give the same bytes.
// convert.cc picks among them (ConvertPath) and is this header's only includer: its definitions
// live in an anonymous namespace, one copy for that translation unit.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "device/convert.h"
#include "device/convert_core.h"

namespace kvferry {
namespace {

// Bytes per element, usable in constant expressions (the loops' strides).
constexpr size_t Width(ElementFormat format) {
  switch (format) {
    case ElementFormat::kFp32:
      return 4;
    case ElementFormat::kFp16:
    case ElementFormat::kBf16:
      return 2;
    case ElementFormat::kFp8E4m3:
      return 1;
  }
  return 0;
}

template <typename T>
T Load(const std::byte* p, size_t i) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}

template <typename T>
void Store(std::byte* p, size_t i, T v) {
  std::memcpy(p + i * sizeof(T), &v, sizeof(T));
}

// One element, by the shared arithmetic: the reference, and every row's tail.
template <ElementFormat F>
uint32_t WidenOne(const std::byte* src, size_t i) {
  if constexpr (F == ElementFormat::kFp32) return Load<uint32_t>(src, i);
  if constexpr (F == ElementFormat::kBf16) return convert::Bf16ToF32(Load<uint16_t>(src, i));
  if constexpr (F == ElementFormat::kFp16) return convert::Fp16ToF32(Load<uint16_t>(src, i));
  if constexpr (F == ElementFormat::kFp8E4m3) return convert::E4m3ToF32(Load<uint8_t>(src, i));
}

template <ElementFormat F>
void NarrowOne(uint32_t x, std::byte* dst, size_t i) {
  if constexpr (F == ElementFormat::kFp32) {  // NaN payloads become the quiet NaN here too
    const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
    Store<uint32_t>(dst, i, nan ? (x & 0x80000000u) | convert::kF32QuietNan : x);
  }
  if constexpr (F == ElementFormat::kBf16) {
    Store<uint16_t>(dst, i, static_cast<uint16_t>(convert::F32ToBf16(x)));
  }
  if constexpr (F == ElementFormat::kFp16) {
    Store<uint16_t>(dst, i, static_cast<uint16_t>(convert::F32ToFp16(x)));
  }
  if constexpr (F == ElementFormat::kFp8E4m3) {
    Store<uint8_t>(dst, i, static_cast<uint8_t>(convert::F32ToE4m3(x)));
  }
}

template <ElementFormat From, ElementFormat To>
void RowScalar(std::byte* dst, const std::byte* src, size_t begin, size_t n) {
  for (size_t i = begin; i < n; ++i) NarrowOne<To>(WidenOne<From>(src, i), dst, i);
}

// A row with scales (CopyDesc::src_scale, dst_scale): one element at a time through Rescale.
template <ElementFormat From, ElementFormat To>
void ScaledRow(std::byte* dst, const std::byte* src, size_t n, float src_scale, float dst_scale) {
  for (size_t i = 0; i < n; ++i) {
    NarrowOne<To>(convert::Rescale(WidenOne<From>(src, i), src_scale, dst_scale), dst, i);
  }
}

// The largest FiniteMagnitude of a plane's widened elements (per-block scales' amax): `rows` rows
// of `n` elements, `pitch` bytes apart. One element at a time: the reference, and every row's tail.
template <ElementFormat F>
uint32_t PlaneMaxScalar(const std::byte* src, size_t rows, size_t pitch, size_t n) {
  uint32_t m = 0;
  for (size_t r = 0; r < rows; ++r) {
    const std::byte* row = src + r * pitch;
    for (size_t i = 0; i < n; ++i) m = std::max(m, convert::FiniteMagnitude(WidenOne<F>(row, i)));
  }
  return m;
}

// Software prefetch distance: one core's loads alone do not keep enough misses in flight to stream
// from memory (AVX-512 bf16 -> fp8 ran 5.8 G elements/s within the caches, 1.9 from memory; 3.5
// with this).
constexpr size_t kPrefetchBytes = 2048;

#if defined(__x86_64__)
// Eight elements at a time with AVX2 and F16C, the same results as convert_core.h (tested against
// it exhaustively): scalar code of that shape runs at 0.2-2 GB/s here, the compiler vectorizing
// little of it.
#define KVF_AVX2 __attribute__((target("avx2,f16c")))

KVF_AVX2 inline __m256i Select(__m256i mask, __m256i yes, __m256i no) {
  return _mm256_blendv_epi8(no, yes, mask);
}

KVF_AVX2 inline __m256i SignOf(__m256i x) {
  return _mm256_and_si256(x, _mm256_set1_epi32(INT32_MIN));
}

KVF_AVX2 inline __m256i IsNan(__m256i x) {
  return _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                            _mm256_set1_epi32(0x7f800000));
}

// Any NaN to the quiet one, the sign kept.
KVF_AVX2 inline __m256i QuietNans(__m256i x) {
  return Select(IsNan(x), _mm256_or_si256(SignOf(x), _mm256_set1_epi32(0x7fc00000)), x);
}

// Round-to-integer of |x| * scale for the subnormal paths (as convert_core.h).
KVF_AVX2 inline __m256i ScaledInteger(__m256i ax, float scale) {
  const __m256 two23 = _mm256_set1_ps(convert::kTwo23);
  const __m256 v =
      _mm256_add_ps(_mm256_mul_ps(_mm256_castsi256_ps(ax), _mm256_set1_ps(scale)), two23);
  return _mm256_sub_epi32(_mm256_castps_si256(v), _mm256_castps_si256(two23));
}

template <ElementFormat F>
KVF_AVX2 inline __m256i Widen8(const std::byte* p) {
  if constexpr (F == ElementFormat::kFp32) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  if constexpr (F == ElementFormat::kBf16) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_slli_epi32(h, 16);  // NaNs made quiet when narrowed
  }
  if constexpr (F == ElementFormat::kFp16) {  // exact, subnormals included
    return _mm256_castps_si256(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  if constexpr (F == ElementFormat::kFp8E4m3) {
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i mag = _mm256_and_si256(q, _mm256_set1_epi32(0x7f));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(q, _mm256_set1_epi32(0x80)), 24);
    const __m256i normal =
        _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    const __m256i m = _mm256_and_si256(q, _mm256_set1_epi32(7));
    const __m256i sub =
        _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0.001953125f)));
    const __m256i exp0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
    const __m256i nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f));
    __m256i r = Select(exp0, sub, normal);
    r = Select(nan, _mm256_set1_epi32(0x7fc00000), r);
    return _mm256_or_si256(sign, r);
  }
}

// A narrow format's codes in 32-bit lanes (bf16, e4m3), as convert_core.h computes them.
KVF_AVX2 inline __m256i Bf16Codes(__m256i x) {
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), odd), 16);
  return Select(IsNan(x),
                _mm256_or_si256(_mm256_srli_epi32(SignOf(x), 16), _mm256_set1_epi32(0x7fc0)), r);
}

KVF_AVX2 inline __m256i E4m3Codes(__m256i x) {
  const __m256i ax = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(ax, 20), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_sub_epi32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(ax, _mm256_set1_epi32(0x7ffff)), odd),
                        20),
      _mm256_set1_epi32(120 << 3));
  __m256i mag = Select(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), ax),
                       ScaledInteger(ax, 512.0f), normal);
  mag = Select(_mm256_cmpgt_epi32(ax, _mm256_set1_epi32(0x43e00000)), _mm256_set1_epi32(0x7e), mag);
  mag = Select(_mm256_cmpgt_epi32(ax, _mm256_set1_epi32(0x7f800000)), _mm256_set1_epi32(0x7f), mag);
  return _mm256_or_si256(mag, _mm256_srli_epi32(SignOf(x), 24));
}

// Eight widened values times src_scale, divided by dst_scale (as Scales16 below: a scale of 1
// skipped, NaN kept NaN by the arithmetic and made the destination's quiet one by the narrowing).
struct Scales8 {
  KVF_AVX2 Scales8(float src_scale, float dst_scale)
      : src(_mm256_set1_ps(src_scale)),
        dst(_mm256_set1_ps(dst_scale)),
        mul(src_scale != 1.0f),
        div(dst_scale != 1.0f) {}
  KVF_AVX2 __m256i Apply(__m256i x) const {
    __m256 v = _mm256_castsi256_ps(x);
    if (mul) v = _mm256_mul_ps(v, src);
    if (div) v = _mm256_div_ps(v, dst);
    return _mm256_castps_si256(v);
  }
  __m256 src, dst;
  bool mul, div;
};

// 32 elements per step: four vectors of eight, narrowed and stored together (one 32-byte store
// of fp8 codes, two of 16-bit ones); with `scales`, scaled in between.
template <ElementFormat From, ElementFormat To, bool kScaled = false>
KVF_AVX2 void Step32(std::byte* dst, const std::byte* src, const Scales8* scales = nullptr) {
  constexpr size_t in = Width(From);
  __m256i x[4];
  for (int k = 0; k < 4; ++k) x[k] = Widen8<From>(src + 8 * k * in);
  if constexpr (kScaled) {
    for (int k = 0; k < 4; ++k) x[k] = scales->Apply(x[k]);
  }
  if constexpr (To == ElementFormat::kFp32) {
    for (int k = 0; k < 4; ++k)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * k), QuietNans(x[k]));
  }
  if constexpr (To == ElementFormat::kFp16) {  // IEEE round to nearest even; quiet NaNs first
    for (int k = 0; k < 4; ++k) {
      const __m128i h = _mm256_cvtps_ph(_mm256_castsi256_ps(QuietNans(x[k])),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * k), h);
    }
  }
  if constexpr (To == ElementFormat::kBf16) {
    for (int k = 0; k < 4; k += 2) {
      const __m256i w = _mm256_packus_epi32(Bf16Codes(x[k]), Bf16Codes(x[k + 1]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * k),
                          _mm256_permute4x64_epi64(w, 0xd8));
    }
  }
  if constexpr (To == ElementFormat::kFp8E4m3) {
    const __m256i w01 = _mm256_packus_epi32(E4m3Codes(x[0]), E4m3Codes(x[1]));
    const __m256i w23 = _mm256_packus_epi32(E4m3Codes(x[2]), E4m3Codes(x[3]));
    const __m256i b = _mm256_packus_epi16(w01, w23);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
}

template <ElementFormat From, ElementFormat To>
KVF_AVX2 void RowAvx2(std::byte* dst, const std::byte* src, size_t n) {
  constexpr size_t in = Width(From);
  constexpr size_t out = Width(To);
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(src + i * in) + kPrefetchBytes, _MM_HINT_T0);
    Step32<From, To>(dst + i * out, src + i * in);
  }
  // The scalar tail is a function compiled without AVX, reached by a tail jump before which GCC 12
  // emits no vzeroupper: the caller's SSE code then ran with the upper halves dirty, and rows of
  // 128 elements (a head row) converted at 0.59 G elements/s against 1.50 with this (AVX2,
  // bf16 -> fp8 with a scale, on the CI machine's EPYC). Every AVX loop clears them before it.
  _mm256_zeroupper();
  RowScalar<From, To>(dst, src, i, n);
}

// PlaneMaxScalar, 32 bytes a step: magnitudes of one format order as their codes, so the largest
// finite code (NaN and infinity masked to 0) is found in the format's own lanes and widened once.
// One element at a time (the scalar loop) ran 0.9 G elements/s here and took most of a per-block
// plane's time.
template <ElementFormat F>
KVF_AVX2 uint32_t PlaneMaxAvx2(const std::byte* src, size_t rows, size_t pitch, size_t n) {
  constexpr size_t w = Width(F), per = 32 / w;
  __m256i m = _mm256_setzero_si256();
  uint32_t tail = 0;
  for (size_t r = 0; r < rows; ++r) {
    const std::byte* row = src + r * pitch;
    size_t i = 0;
    for (; i + per <= n; i += per) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i * w));
      if constexpr (F == ElementFormat::kFp32) {
        const __m256i a = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
        const __m256i finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800000), a);
        m = _mm256_max_epu32(m, _mm256_and_si256(a, finite));
      } else if constexpr (F == ElementFormat::kBf16 || F == ElementFormat::kFp16) {
        constexpr int16_t kInf = F == ElementFormat::kBf16 ? 0x7f80 : 0x7c00;
        const __m256i a = _mm256_and_si256(x, _mm256_set1_epi16(0x7fff));
        const __m256i finite = _mm256_cmpgt_epi16(_mm256_set1_epi16(kInf), a);
        m = _mm256_max_epu16(m, _mm256_and_si256(a, finite));
      } else {  // e4m3: 0x7f (NaN) is its only non-finite magnitude
        const __m256i a = _mm256_and_si256(x, _mm256_set1_epi8(0x7f));
        m = _mm256_max_epu8(m,
                            _mm256_andnot_si256(_mm256_cmpeq_epi8(a, _mm256_set1_epi8(0x7f)), a));
      }
    }
    if (i < n) tail = std::max(tail, PlaneMaxScalar<F>(row + i * w, 1, 0, n - i));
  }
  alignas(32) std::array<std::byte, 32> lanes;
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes.data()), m);
  uint32_t best = 0;  // the lanes hold finite magnitudes: widened, they are their fp32 magnitudes
  for (size_t k = 0; k < per; ++k) best = std::max(best, WidenOne<F>(lanes.data(), k));
  return std::max(tail, best);
}

// A row with scales (ScaledRow's arithmetic), 32 elements a step.
template <ElementFormat From, ElementFormat To>
KVF_AVX2 void ScaledRowAvx2(std::byte* dst, const std::byte* src, size_t n, float src_scale,
                            float dst_scale) {
  constexpr size_t in = Width(From);
  constexpr size_t out = Width(To);
  const Scales8 k(src_scale, dst_scale);
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(src + i * in) + kPrefetchBytes, _MM_HINT_T0);
    Step32<From, To, true>(dst + i * out, src + i * in, &k);
  }
  _mm256_zeroupper();  // see RowAvx2
  ScaledRow<From, To>(dst + i * out, src + i * in, n - i, src_scale, dst_scale);
}

#define KVF_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
// GCC 12 warns that the intrinsics' own _mm512_undefined_* operands "may be used uninitialized".
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// Sixteen elements at a time with AVX-512 (compares into masks, 32-to-8 and 32-to-16 bit
// narrowing in one instruction): e4m3 narrowing is arithmetic-bound, 1.2 G elements/s with AVX2 on
// the CI machine's core.
template <ElementFormat F>
KVF_AVX512 inline __m512i Widen16(const std::byte* p) {
  if constexpr (F == ElementFormat::kFp32) return _mm512_loadu_si512(p);
  if constexpr (F == ElementFormat::kBf16) {
    return _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  }
  if constexpr (F == ElementFormat::kFp16) {
    return _mm512_castps_si512(
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  if constexpr (F == ElementFormat::kFp8E4m3) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i mag = _mm512_and_si512(q, _mm512_set1_epi32(0x7f));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0x80)), 24);
    const __m512i normal =
        _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    const __m512i sub = _mm512_castps_si512(
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(7))),
                      _mm512_set1_ps(0.001953125f)));
    __m512i r =
        _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), normal, sub);
    r = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)), r,
                                _mm512_set1_epi32(0x7fc00000));
    return _mm512_or_si512(sign, r);
  }
}

KVF_AVX512 inline __mmask16 NanMask16(__m512i x) {
  return _mm512_cmpgt_epi32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)),
                                 _mm512_set1_epi32(0x7f800000));
}

KVF_AVX512 inline __m512i Sign16(__m512i x) {
  return _mm512_and_si512(x, _mm512_set1_epi32(INT32_MIN));
}

template <ElementFormat F>
KVF_AVX512 inline void Narrow16(__m512i x, std::byte* p) {
  if constexpr (F == ElementFormat::kFp32) {
    _mm512_storeu_si512(
        p, _mm512_mask_blend_epi32(NanMask16(x), x,
                                   _mm512_or_si512(Sign16(x), _mm512_set1_epi32(0x7fc00000))));
  }
  if constexpr (F == ElementFormat::kFp16) {
    const __m512i quiet = _mm512_mask_blend_epi32(
        NanMask16(x), x, _mm512_or_si512(Sign16(x), _mm512_set1_epi32(0x7fc00000)));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(p),
        _mm512_cvtps_ph(_mm512_castsi512_ps(quiet), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  if constexpr (F == ElementFormat::kBf16) {
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), odd), 16);
    r = _mm512_mask_blend_epi32(
        NanMask16(x), r,
        _mm512_or_si512(_mm512_srli_epi32(Sign16(x), 16), _mm512_set1_epi32(0x7fc0)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  if constexpr (F == ElementFormat::kFp8E4m3) {
    const __m512i ax = _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(ax, 20), _mm512_set1_epi32(1));
    const __m512i normal = _mm512_sub_epi32(
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(ax, _mm512_set1_epi32(0x7ffff)), odd),
                          20),
        _mm512_set1_epi32(120 << 3));
    const __m512 two23 = _mm512_set1_ps(convert::kTwo23);
    const __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(
            _mm512_add_ps(_mm512_mul_ps(_mm512_castsi512_ps(ax), _mm512_set1_ps(512.0f)), two23)),
        _mm512_castps_si512(two23));
    // Above 448 (infinity too) saturates: min of the normal code and 0x7e (normal codes of larger
    // values are larger); below 2^-6 the subnormal code; NaN 0x7f.
    __m512i mag = _mm512_min_epu32(normal, _mm512_set1_epi32(0x7e));
    mag = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(ax, _mm512_set1_epi32(0x3c800000)), mag,
                                  sub);
    mag = _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(ax, _mm512_set1_epi32(0x7f800000)), mag,
                                  _mm512_set1_epi32(0x7f));
    const __m512i r = _mm512_or_si512(mag, _mm512_srli_epi32(Sign16(x), 24));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(r));
  }
}

// bf16 -> e4m3, thirty-two elements at a time in 16-bit lanes (Narrow16's results; 32-bit lanes
// made it arithmetic-bound at 5 G elements/s, in the caches and from memory alike; this runs 8-10).
// Normal results drop 4 of bf16's 7 mantissa bits, to nearest even, and rebias the exponent
// (127 -> 7) in integers; subnormal ones (below 2^-6) are |x| * 512 + 2^23 in fp32, rounded once,
// the integer left over being the code: unpacking to 32-bit lanes interleaves within 128-bit lanes
// and packing back undoes it.
KVF_AVX512 inline __m512i SubnormalE4m3Codes(__m512i wide) {
  const __m512 two23 = _mm512_set1_ps(convert::kTwo23);
  return _mm512_sub_epi32(_mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(wide),
                                                              _mm512_set1_ps(512.0f), two23)),
                          _mm512_castps_si512(two23));
}

KVF_AVX512 inline __m256i Bf16ToE4m3x32(__m512i b) {
  const __m512i a = _mm512_and_si512(b, _mm512_set1_epi16(0x7fff));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi16(b, 8), _mm512_set1_epi16(0x80));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_set1_epi16(1));
  __m512i mag = _mm512_srli_epi16(
      _mm512_add_epi16(_mm512_sub_epi16(a, _mm512_set1_epi16((120 << 7) - 7)), odd), 4);
  // Above 448 (infinity too) saturates: larger magnitudes give larger normal codes.
  mag = _mm512_min_epu16(mag, _mm512_set1_epi16(0x7e));
  const __m512i zero = _mm512_setzero_si512();
  mag = _mm512_mask_blend_epi16(
      _mm512_cmplt_epu16_mask(a, _mm512_set1_epi16(0x3c80)), mag,
      _mm512_packus_epi32(SubnormalE4m3Codes(_mm512_unpacklo_epi16(zero, a)),
                          SubnormalE4m3Codes(_mm512_unpackhi_epi16(zero, a))));
  mag = _mm512_mask_blend_epi16(_mm512_cmpgt_epu16_mask(a, _mm512_set1_epi16(0x7f80)), mag,
                                _mm512_set1_epi16(0x7f));  // NaN
  return _mm512_cvtepi16_epi8(_mm512_or_si512(mag, sign));
}

// fp16 -> e4m3, thirty-two elements at a time in 16-bit lanes, as bf16 -> e4m3 (32-bit lanes ran
// 4.8 G elements/s, 0.43 of memcpy): normal results drop 7 of fp16's 10 mantissa bits, to nearest
// even, and rebias the exponent (15 -> 7); subnormal ones (below 2^-6) from the fp32 values.
KVF_AVX512 inline __m256i Fp16ToE4m3x32(__m512i h) {
  const __m512i a = _mm512_and_si512(h, _mm512_set1_epi16(0x7fff));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi16(h, 8), _mm512_set1_epi16(0x80));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(a, 7), _mm512_set1_epi16(1));
  __m512i mag = _mm512_srli_epi16(
      _mm512_add_epi16(_mm512_sub_epi16(a, _mm512_set1_epi16((8 << 10) - 63)), odd), 7);
  mag = _mm512_min_epu16(mag, _mm512_set1_epi16(0x7e));  // above 448, infinity too: saturate
  const __m512i lo =
      SubnormalE4m3Codes(_mm512_castps_si512(_mm512_cvtph_ps(_mm512_castsi512_si256(a))));
  const __m512i hi =
      SubnormalE4m3Codes(_mm512_castps_si512(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(a, 1))));
  const __m512i sub = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
                                         _mm512_cvtepi32_epi16(hi), 1);
  mag = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(a, _mm512_set1_epi16(0x2400)), mag, sub);
  mag = _mm512_mask_blend_epi16(_mm512_cmpgt_epu16_mask(a, _mm512_set1_epi16(0x7c00)), mag,
                                _mm512_set1_epi16(0x7f));  // NaN
  return _mm512_cvtepi16_epi8(_mm512_or_si512(mag, sign));
}

// e4m3 -> bf16, thirty-two elements at a time in 16-bit lanes (through fp32 it ran 3.3 G elements
// a second, 0.58 of memcpy): every e4m3 value is exact in bf16; normal codes rebias the exponent
// (7 -> 127) and shift the mantissa, subnormal ones (m * 2^-9) come from an eight-entry table.
KVF_AVX512 inline __m512i E4m3ToBf16x32(__m256i bytes) {
  static const std::array<uint16_t, 32> kSubnormal = [] {
    std::array<uint16_t, 32> t{};
    for (uint32_t m = 0; m < 8; ++m) {
      t[m] = static_cast<uint16_t>(convert::F32ToBf16(convert::E4m3ToF32(m)));
    }
    return t;
  }();
  const __m512i q = _mm512_cvtepu8_epi16(bytes);
  const __m512i mag = _mm512_and_si512(q, _mm512_set1_epi16(0x7f));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(q, _mm512_set1_epi16(0x80)), 8);
  __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  r = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), r,
                              _mm512_permutexvar_epi16(mag, _mm512_loadu_si512(kSubnormal.data())));
  r = _mm512_mask_blend_epi16(_mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)), r,
                              _mm512_set1_epi16(0x7fc0));  // NaN
  return _mm512_or_si512(r, sign);
}

template <ElementFormat From, ElementFormat To>
KVF_AVX512 void RowAvx512(std::byte* dst, const std::byte* src, size_t n) {
  constexpr size_t in = Width(From);
  constexpr size_t out = Width(To);
  size_t i = 0;
  if constexpr (From == ElementFormat::kBf16 && To == ElementFormat::kFp8E4m3) {
    for (; i + 32 <= n; i += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(src + i * in) + kPrefetchBytes, _MM_HINT_T0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          Bf16ToE4m3x32(_mm512_loadu_si512(src + i * in)));
    }
  }
  if constexpr (From == ElementFormat::kFp16 && To == ElementFormat::kFp8E4m3) {
    for (; i + 32 <= n; i += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(src + i * in) + kPrefetchBytes, _MM_HINT_T0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          Fp16ToE4m3x32(_mm512_loadu_si512(src + i * in)));
    }
  }
  if constexpr (From == ElementFormat::kFp8E4m3 && To == ElementFormat::kBf16) {
    for (; i + 32 <= n; i += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(src + i) + kPrefetchBytes, _MM_HINT_T0);
      _mm512_storeu_si512(
          dst + i * out,
          E4m3ToBf16x32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    }
  }
  for (; i + 16 <= n; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(src + i * in) + kPrefetchBytes, _MM_HINT_T0);
    Narrow16<To>(Widen16<From>(src + i * in), dst + i * out);
  }
  _mm256_zeroupper();  // see RowAvx2
  RowScalar<From, To>(dst, src, i, n);
}

// fp32 values (two vectors of sixteen) to bf16 rounded to odd: truncated, the last bit set when
// any dropped bit was. bf16 keeps 4 more mantissa bits than e4m3, so rounding that to e4m3 to
// nearest even (Bf16ToE4m3x32) gives the fp32 value's own e4m3 rounding; NaN stays NaN, infinity
// and the largest values stay above 448.
KVF_AVX512 inline __m512i Bf16RoundedToOdd(__m512i lo, __m512i hi) {
  static const std::array<uint16_t, 32> kHighHalves = [] {
    std::array<uint16_t, 32> t{};
    for (uint16_t k = 0; k < 32; ++k) t[k] = static_cast<uint16_t>(2 * k + 1);
    return t;
  }();
  const __m512i high = _mm512_permutex2var_epi16(lo, _mm512_loadu_si512(kHighHalves.data()), hi);
  const __m512i low_bits = _mm512_set1_epi32(0xffff);
  const __mmask32 sticky =
      _mm512_kunpackw(_mm512_test_epi32_mask(hi, low_bits), _mm512_test_epi32_mask(lo, low_bits));
  return _mm512_or_si512(high, _mm512_maskz_set1_epi16(sticky, 1));
}

// Sixteen widened values times src_scale, divided by dst_scale; a scale of 1 is skipped
// (multiplying or dividing by it changes no value). The scales are finite and positive, so a value
// is NaN afterwards if and only if it was before, its sign kept (x86 returns a NaN operand,
// quieted): the narrowing makes every NaN the destination's quiet one.
struct Scales16 {
  KVF_AVX512 Scales16(float src_scale, float dst_scale)
      : src(_mm512_set1_ps(src_scale)),
        dst(_mm512_set1_ps(dst_scale)),
        mul(src_scale != 1.0f),
        div(dst_scale != 1.0f) {}
  KVF_AVX512 __m512i Apply(__m512i x) const {
    __m512 v = _mm512_castsi512_ps(x);
    if (mul) v = _mm512_mul_ps(v, src);
    if (div) v = _mm512_div_ps(v, dst);
    return _mm512_castps_si512(v);
  }
  __m512 src, dst;
  bool mul, div;
};

// fp32 to bf16 to nearest even, in integers, in the low half of each 32-bit lane (no NaN check).
KVF_AVX512 inline __m512i Bf16Rounded(__m512i x) {
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), odd),
                           16);
}

// A row with scales (ScaledRow's arithmetic, Scales16), sixteen elements at a time. Toward e4m3,
// thirty-two at a time: the narrowing of Bf16ToE4m3x32 through bf16 rounded to odd, half the work
// of Narrow16's 32-bit lanes.
template <ElementFormat From, ElementFormat To>
KVF_AVX512 void ScaledRowAvx512(std::byte* dst, const std::byte* src, size_t n, float src_scale,
                                float dst_scale) {
  constexpr size_t in = Width(From);
  constexpr size_t out = Width(To);
  const Scales16 k(src_scale, dst_scale);
  const auto scaled = [&k](const std::byte* p) KVF_AVX512 { return k.Apply(Widen16<From>(p)); };
  size_t i = 0;
  if constexpr (From == ElementFormat::kFp8E4m3 && To == ElementFormat::kBf16) {
    // Widened in 16-bit lanes (E4m3ToBf16x32, exact), to fp32 by unpacking (interleaved within
    // 128-bit lanes), scaled, rounded to bf16 to nearest even in integers (a NaN is e4m3's
    // canonical one, 0x7fc00000, and stays it), packed back in order.
    const __m512i zero = _mm512_setzero_si512();
    for (; i + 32 <= n; i += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(src + i) + kPrefetchBytes, _MM_HINT_T0);
      const __m512i b =
          E4m3ToBf16x32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
      _mm512_storeu_si512(
          dst + i * out, _mm512_packus_epi32(Bf16Rounded(k.Apply(_mm512_unpacklo_epi16(zero, b))),
                                             Bf16Rounded(k.Apply(_mm512_unpackhi_epi16(zero, b)))));
    }
  }
  if constexpr (To == ElementFormat::kFp8E4m3) {
    for (; i + 32 <= n; i += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(src + i * in) + kPrefetchBytes, _MM_HINT_T0);
      if constexpr (in == 4) {
        _mm_prefetch(reinterpret_cast<const char*>(src + i * in) + kPrefetchBytes + 64,
                     _MM_HINT_T0);
      }
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(dst + i),
          Bf16ToE4m3x32(Bf16RoundedToOdd(scaled(src + i * in), scaled(src + (i + 16) * in))));
    }
  }
  for (; i + 16 <= n; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(src + i * in) + kPrefetchBytes, _MM_HINT_T0);
    Narrow16<To>(scaled(src + i * in), dst + i * out);
  }
  _mm256_zeroupper();  // see RowAvx2
  ScaledRow<From, To>(dst + i * out, src + i * in, n - i, src_scale, dst_scale);
}
#pragma GCC diagnostic pop
#endif

}  // namespace
}  // namespace kvferry

// Element conversion's arithmetic (Stream::ConvertBatch), shared by the host loops (convert.cc)
// and, compiled by nvcc, by the CUDA kernel: one definition, so both produce the same bytes.
//
// Every conversion goes through fp32: widening fp16, bf16 or fp8 e4m3 to fp32 is exact, so the
// only rounding is the narrowing one, to nearest with ties to even. The rules (docs/conversion.md):
// - NaN becomes the destination's quiet NaN with the sign kept (fp32 0x7fc00000, bf16 0x7fc0,
//   fp16 0x7e00, e4m3 0x7f), whatever its payload;
// - fp16 and bf16 overflow to infinity (an IEEE cast, as torch's .to() does);
// - e4m3 has no infinity: anything above 448 in magnitude, infinities included, becomes +-448
//   (0x7e / 0xfe), as the engines' saturating casts (__NV_SATFINITE) do;
// - subnormals are kept on both sides (no flush to zero).
//
// Written branch-free (selects, not jumps) so the host compiler vectorizes the loops over a row.
// The subnormal paths round with a float addition of 2^23 (exact scaling first, so a fused
// multiply-add rounds the same): the host must run with the default rounding mode and without
// flush-to-zero, as C++ programs and CUDA kernels do.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVF_CONVERT_HD __host__ __device__ __forceinline__
#else
#define KVF_CONVERT_HD inline
#endif

namespace kvferry::convert {

KVF_CONVERT_HD float AsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

KVF_CONVERT_HD uint32_t AsBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

inline constexpr uint32_t kF32QuietNan = 0x7fc00000u;
inline constexpr float kTwo23 = 8388608.0f;  // adding it rounds [0, 2^22) to an integer

// ---- widening to fp32 bits (exact) ------------------------------------------------------------

KVF_CONVERT_HD uint32_t Bf16ToF32(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const bool nan = (h & 0x7fffu) > 0x7f80u;
  return nan ? (sign | kF32QuietNan) : (h << 16);
}

KVF_CONVERT_HD uint32_t Fp16ToF32(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  const uint32_t normal = ((e + 112u) << 23) | (m << 13);
  const uint32_t sub = AsBits(static_cast<float>(m) * 5.9604644775390625e-08f);  // m * 2^-24
  const uint32_t special = m != 0 ? kF32QuietNan : 0x7f800000u;
  return sign | (e == 0 ? sub : e == 31 ? special : normal);
}

KVF_CONVERT_HD uint32_t E4m3ToF32(uint32_t q) {
  const uint32_t sign = (q & 0x80u) << 24;
  const uint32_t e = (q >> 3) & 0xfu;
  const uint32_t m = q & 0x7u;
  const uint32_t normal = ((e + 120u) << 23) | (m << 20);
  const uint32_t sub = AsBits(static_cast<float>(m) * 0.001953125f);  // m * 2^-9
  const bool nan = (q & 0x7fu) == 0x7fu;
  return sign | (nan ? kF32QuietNan : e == 0 ? sub : normal);
}

// Scales (CopyDesc::src_scale, dst_scale): x * src_scale, then / dst_scale, each an fp32 operation
// rounded to nearest even (IEEE multiply and divide: no contraction into a fused operation, no
// reciprocal). With both scales 1 the value is unchanged. A NaN passes untouched: arithmetic on
// it gives the GPU's canonical NaN, without its sign, where the host keeps the sign.
KVF_CONVERT_HD uint32_t Rescale(uint32_t x, float src_scale, float dst_scale) {
  const float scaled = AsFloat(x) * src_scale;
  const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
  return nan ? x : AsBits(scaled / dst_scale);
}

// ---- per-block scales (CopyDesc::dst_scales) --------------------------------------------------

inline constexpr float kE4m3Max = 448.0f;
// The smallest computed scale: 1 / (448 * 512), as vLLM's dynamic fp8 quantization (a plane of
// zeros gets it).
inline constexpr float kMinBlockScale = 1.0f / (448.0f * 512.0f);
inline constexpr float kFloatMax = 3.40282347e+38f;

// The magnitude bits of a widened element for a plane's amax: |x|, or 0 for NaN and infinity
// (non-finite elements are left out). Magnitudes compare as their bits.
KVF_CONVERT_HD uint32_t FiniteMagnitude(uint32_t x) {
  const uint32_t ax = x & 0x7fffffffu;
  return ax < 0x7f800000u ? ax : 0u;
}

// The scale a plane is quantized to e4m3 with: (amax * src_scale) / 448, each an fp32 operation
// rounded to nearest even, clamped to [kMinBlockScale, kFloatMax]. amax_bits: the plane's largest
// FiniteMagnitude. Multiplying the maximum once equals the maximum of the products (rounding is
// monotone).
KVF_CONVERT_HD float BlockScale(uint32_t amax_bits, float src_scale) {
  const float amax = AsFloat(amax_bits) * src_scale;
  const float s = amax / kE4m3Max;
  return s < kMinBlockScale ? kMinBlockScale : s > kFloatMax ? kFloatMax : s;
}

// ---- narrowing from fp32 bits (round to nearest, ties to even) --------------------------------

KVF_CONVERT_HD uint32_t F32ToBf16(uint32_t x) {
  const uint32_t sign = (x >> 16) & 0x8000u;
  const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return nan ? (sign | 0x7fc0u) : rounded;
}

KVF_CONVERT_HD uint32_t F32ToFp16(uint32_t x) {
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  // Normal results: round away 13 mantissa bits (adding just under half an ulp, plus the kept
  // bit: ties go to even), rebias; a carry into the exponent is right.
  const uint32_t normal = ((ax + 0xfffu + ((ax >> 13) & 1u)) >> 13) - (112u << 10);
  // Below 2^-14: units of 2^-24, |x| * 2^24 < 1024 rounded to an integer.
  const uint32_t sub = AsBits(AsFloat(ax) * 16777216.0f + kTwo23) - AsBits(kTwo23);
  const uint32_t mag = ax > 0x7f800000u    ? 0x7e00u  // NaN
                       : ax >= 0x477ff000u ? 0x7c00u  // rounds to 65536 or more: infinity
                       : ax < 0x38800000u  ? sub
                                           : normal;
  return sign | mag;
}

KVF_CONVERT_HD uint32_t F32ToE4m3(uint32_t x) {
  const uint32_t sign = (x >> 24) & 0x80u;
  const uint32_t ax = x & 0x7fffffffu;
  const uint32_t normal = ((ax + 0x7ffffu + ((ax >> 20) & 1u)) >> 20) - (120u << 3);
  // Below 2^-6: units of 2^-9, |x| * 2^9 < 8 rounded to an integer.
  const uint32_t sub = AsBits(AsFloat(ax) * 512.0f + kTwo23) - AsBits(kTwo23);
  const uint32_t mag = ax > 0x7f800000u   ? 0x7fu  // NaN
                       : ax > 0x43e00000u ? 0x7eu  // above 448 (infinity too): saturate
                       : ax < 0x3c800000u ? sub
                                          : normal;
  return sign | mag;
}

}  // namespace kvferry::convert

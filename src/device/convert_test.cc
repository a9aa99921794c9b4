// Element conversion (convert.h, convert_core.h) against an independent reference: every value of
// each format decoded with ldexp, and narrowing as "the nearest value of the format's table, ties
// to the even code" by binary search over that table, never the bit tricks under test. Exhaustive
// over the 16- and 8-bit sources; fp32 sources over every exponent with random mantissas and the
// edge values (ties, the overflow and saturation thresholds, subnormal boundaries, NaN, infinity).
// Then a CPU stream's ConvertBatch over pitched 3-D descriptors, and the refusals.
#include "device/convert.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "kvferry/device.h"

namespace kvferry {
namespace {

constexpr ElementFormat kFormats[] = {ElementFormat::kFp32, ElementFormat::kFp16,
                                      ElementFormat::kBf16, ElementFormat::kFp8E4m3};

struct Spec {
  int exp_bits, mant_bits, bias;
  bool has_inf;  // e4m3: no infinity, the all-ones code is NaN, saturates at 448
};

Spec SpecOf(ElementFormat f) {
  switch (f) {
    case ElementFormat::kFp16:
      return {5, 10, 15, true};
    case ElementFormat::kBf16:
      return {8, 7, 127, true};
    case ElementFormat::kFp8E4m3:
      return {4, 3, 7, false};
    case ElementFormat::kFp32:
      return {8, 23, 127, true};
  }
  return {};
}

bool IsNanCode(ElementFormat f, uint32_t c) {
  const Spec s = SpecOf(f);
  const uint32_t mag = c & ((1u << (s.exp_bits + s.mant_bits)) - 1);
  const uint32_t exp_all = ((1u << s.exp_bits) - 1) << s.mant_bits;
  if (!s.has_inf) return mag == ((1u << (s.exp_bits + s.mant_bits)) - 1);
  return (mag & exp_all) == exp_all && (mag & ((1u << s.mant_bits) - 1)) != 0;
}

// The value of a code, by the definition (not by bit tricks).
double Decode(ElementFormat f, uint32_t c) {
  const Spec s = SpecOf(f);
  const int bits = 1 + s.exp_bits + s.mant_bits;
  const double sign = (c >> (bits - 1)) & 1 ? -1.0 : 1.0;
  const uint32_t e = (c >> s.mant_bits) & ((1u << s.exp_bits) - 1);
  const uint32_t m = c & ((1u << s.mant_bits) - 1);
  if (IsNanCode(f, c)) return std::nan("");
  if (s.has_inf && e == (1u << s.exp_bits) - 1) return sign * INFINITY;
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), 1 - s.bias - s.mant_bits);
  return sign * std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -s.mant_bits),
                           static_cast<int>(e) - s.bias);
}

uint32_t QuietNan(ElementFormat f) {
  switch (f) {
    case ElementFormat::kFp32:
      return 0x7fc00000u;
    case ElementFormat::kFp16:
      return 0x7e00u;
    case ElementFormat::kBf16:
      return 0x7fc0u;
    case ElementFormat::kFp8E4m3:
      return 0x7fu;
  }
  return 0;
}

int Bits(ElementFormat f) { return 8 * ElementFormatSize(f); }

// The nearest code of a narrow format (fp16, bf16, e4m3), ties to the even code.
class NarrowReference {
 public:
  explicit NarrowReference(ElementFormat f) : f_(f) {
    const uint32_t sign_bit = 1u << (Bits(f) - 1);
    for (uint32_t c = 0; c < sign_bit; ++c) {
      const double v = Decode(f, c);
      if (std::isfinite(v)) table_.push_back({v, c});
    }
    std::sort(table_.begin(), table_.end(), [](auto& a, auto& b) { return a.first < b.first; });
    const Spec s = SpecOf(f);
    // The value one step past the largest finite one: rounding there overflows.
    const double max = table_.back().first;
    past_max_ = max + std::ldexp(1.0, static_cast<int>(std::ilogb(max)) - s.mant_bits);
  }

  uint32_t operator()(double v) const {
    const uint32_t sign = std::signbit(v) ? 1u << (Bits(f_) - 1) : 0;
    if (std::isnan(v)) return sign | QuietNan(f_);
    const double a = std::fabs(v);
    const bool has_inf = SpecOf(f_).has_inf;
    const uint32_t inf = has_inf ? ((1u << SpecOf(f_).exp_bits) - 1) << SpecOf(f_).mant_bits : 0;
    if (!has_inf && a > table_.back().first) return sign | table_.back().second;  // saturate
    if (std::isinf(a)) return sign | inf;
    const auto hi = std::lower_bound(table_.begin(), table_.end(), a,
                                     [](auto& e, double x) { return e.first < x; });
    if (hi == table_.end()) {  // above the largest finite value: nearer to it or to overflow
      const double lo_v = table_.back().first;
      if (a - lo_v < past_max_ - a) return sign | table_.back().second;
      if (a - lo_v > past_max_ - a) return sign | inf;
      return sign | ((table_.back().second & 1) ? inf : table_.back().second);  // tie: even
    }
    if (hi->first == a || hi == table_.begin()) return sign | hi->second;
    const auto lo = hi - 1;
    if (a - lo->first < hi->first - a) return sign | lo->second;
    if (a - lo->first > hi->first - a) return sign | hi->second;
    return sign | ((lo->second & 1) ? hi->second : lo->second);
  }

 private:
  ElementFormat f_;
  std::vector<std::pair<double, uint32_t>> table_;
  double past_max_ = 0;
};

uint32_t ExpectedFromValue(ElementFormat to, double v) {
  if (to == ElementFormat::kFp32) {
    if (std::isnan(v)) return (std::signbit(v) ? 0x80000000u : 0) | QuietNan(to);
    return std::bit_cast<uint32_t>(static_cast<float>(v));  // exact: every source fits fp32
  }
  return NarrowReference(to)(v);
}

// Every loop this CPU runs (portable, AVX2, AVX-512) writes `want`, ConvertElements' bytes.
void ExpectEveryPathAgrees(const std::vector<std::byte>& want, const void* src, size_t count,
                           Conversion c) {
  for (ConvertPath path : {ConvertPath::kPortable, ConvertPath::kAvx2, ConvertPath::kAvx512}) {
    std::vector<std::byte> got(want.size());
    if (!ConvertElementsWith(path, got.data(), src, count, c)) {
      EXPECT_NE(path, ConvertPath::kPortable) << "the portable loops run everywhere";
      continue;
    }
    EXPECT_EQ(got, want) << "loops " << static_cast<int>(path) << " disagree";
  }
}

TEST(Convert, EveryNarrowSourceValueToEveryFormat) {
  for (ElementFormat from : kFormats) {
    if (from == ElementFormat::kFp32) continue;
    for (ElementFormat to : kFormats) {
      if (to == from) continue;
      SCOPED_TRACE(fmt::format("{} -> {}", ElementFormatName(from), ElementFormatName(to)));
      const NarrowReference* ref = nullptr;
      std::unique_ptr<NarrowReference> own;
      if (to != ElementFormat::kFp32) {
        own = std::make_unique<NarrowReference>(to);
        ref = own.get();
      }
      const uint32_t codes = 1u << Bits(from);
      std::vector<std::byte> src(codes * ElementFormatSize(from));
      std::vector<std::byte> dst(codes * ElementFormatSize(to));
      for (uint32_t c = 0; c < codes; ++c) {
        std::memcpy(src.data() + c * ElementFormatSize(from), &c, ElementFormatSize(from));
      }
      ConvertElements(dst.data(), src.data(), codes, {from, to});
      ExpectEveryPathAgrees(dst, src.data(), codes, {from, to});
      int bad = 0;
      for (uint32_t c = 0; c < codes && bad < 5; ++c) {
        uint32_t got = 0;
        std::memcpy(&got, dst.data() + c * ElementFormatSize(to), ElementFormatSize(to));
        double v = Decode(from, c);
        if (std::isnan(v)) v = std::copysign(v, (c >> (Bits(from) - 1)) ? -1.0 : 1.0);
        const uint32_t want = ref ? (*ref)(v) : ExpectedFromValue(to, v);
        if (got != want) {
          ADD_FAILURE() << fmt::format("code {:#x} ({}) -> {:#x}, expected {:#x}", c, v, got, want);
          ++bad;
        }
      }
    }
  }
}

TEST(Convert, NarrowSourcesRoundTripThroughEveryWiderFormat) {
  // fp16 and bf16 codes survive fp32; e4m3 codes survive fp16, bf16 and fp32 (NaN: the quiet one).
  for (auto [narrow, wide] : {std::pair{ElementFormat::kFp16, ElementFormat::kFp32},
                              {ElementFormat::kBf16, ElementFormat::kFp32},
                              {ElementFormat::kFp8E4m3, ElementFormat::kFp16},
                              {ElementFormat::kFp8E4m3, ElementFormat::kBf16},
                              {ElementFormat::kFp8E4m3, ElementFormat::kFp32}}) {
    for (uint32_t c = 0; c < (1u << Bits(narrow)); ++c) {
      const uint32_t back = ConvertElement(ConvertElement(c, {narrow, wide}), {wide, narrow});
      const uint32_t sign = c & (1u << (Bits(narrow) - 1));
      ASSERT_EQ(back, IsNanCode(narrow, c) ? (sign | QuietNan(narrow)) : c)
          << ElementFormatName(narrow) << " via " << ElementFormatName(wide) << " code " << c;
    }
  }
}

std::vector<uint32_t> Fp32Samples() {
  std::vector<uint32_t> v;
  std::mt19937 rng(12345);
  for (uint32_t e = 0; e < 256; ++e) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      for (int i = 0; i < 300; ++i) v.push_back(sign | (e << 23) | (rng() & 0x7fffffu));
      for (uint32_t m : {0u, 1u, 0x7fffffu, 0x400000u, 0x1000u, 0xfffu, 0x1001u, 0x3000u, 0x8000u,
                         0x18000u, 0x80000u, 0x7ffffu, 0x80001u, 0x180000u})
        v.push_back(sign | (e << 23) | m);
    }
  }
  for (float f : {448.0f,   464.0f,   464.0001f,     480.0f,     65504.0f,      65519.99f, 65520.0f,
                  65536.0f, 0x1p-6f,  0x1p-9f,       0x1p-10f,   0x1.0001p-10f, 0x1.8p-9f, 0x1p-14f,
                  0x1p-24f, 0x1p-25f, 0x1.0001p-25f, 0x1.8p-24f, 3e38f,         INFINITY,  0.0f})
    for (float s : {1.0f, -1.0f}) v.push_back(std::bit_cast<uint32_t>(f * s));
  return v;
}

TEST(Convert, Fp32ToEveryNarrowFormatRoundsToNearestEven) {
  const std::vector<uint32_t> samples = Fp32Samples();
  for (ElementFormat to : kFormats) {
    if (to == ElementFormat::kFp32) continue;
    const NarrowReference ref(to);
    std::vector<std::byte> dst(samples.size() * ElementFormatSize(to));
    ConvertElements(dst.data(), samples.data(), samples.size(), {ElementFormat::kFp32, to});
    ExpectEveryPathAgrees(dst, samples.data(), samples.size(), {ElementFormat::kFp32, to});
    // The scaled loops (toward e4m3 through bf16 rounded to odd): with unit scales every path
    // writes the same bytes; with others every path writes the portable loop's.
    std::vector<std::byte> portable(dst.size());
    ASSERT_TRUE(ConvertElementsScaledWith(ConvertPath::kPortable, portable.data(), samples.data(),
                                          samples.size(), {ElementFormat::kFp32, to}, 0.37f, 1.9f));
    for (ConvertPath path : {ConvertPath::kPortable, ConvertPath::kAvx2, ConvertPath::kAvx512}) {
      std::vector<std::byte> got(dst.size());
      if (!ConvertElementsScaledWith(path, got.data(), samples.data(), samples.size(),
                                     {ElementFormat::kFp32, to}, 1.0f, 1.0f)) {
        continue;
      }
      EXPECT_EQ(got, dst) << "scaled loops " << static_cast<int>(path) << ", unit scales, -> "
                          << ElementFormatName(to);
      ASSERT_TRUE(ConvertElementsScaledWith(path, got.data(), samples.data(), samples.size(),
                                            {ElementFormat::kFp32, to}, 0.37f, 1.9f));
      EXPECT_EQ(got, portable) << "scaled loops " << static_cast<int>(path) << " -> "
                               << ElementFormatName(to);
    }
    int bad = 0;
    for (size_t i = 0; i < samples.size() && bad < 5; ++i) {
      uint32_t got = 0;
      std::memcpy(&got, dst.data() + i * ElementFormatSize(to), ElementFormatSize(to));
      const double v = std::bit_cast<float>(samples[i]);
      const uint32_t want =
          ref(std::isnan(v) ? std::copysign(v, (samples[i] >> 31) ? -1.0 : 1.0) : v);
      if (got != want) {
        ADD_FAILURE() << fmt::format("fp32 {:#010x} ({}) -> {} {:#x}, expected {:#x}", samples[i],
                                     v, ElementFormatName(to), got, want);
        ++bad;
      }
    }
  }
}

TEST(Convert, NamedEdgeValues) {
  const Conversion to_fp8{ElementFormat::kFp32, ElementFormat::kFp8E4m3};
  EXPECT_EQ(ConvertElement(std::bit_cast<uint32_t>(448.0f), to_fp8), 0x7eu);
  EXPECT_EQ(ConvertElement(std::bit_cast<uint32_t>(1e9f), to_fp8), 0x7eu);
  EXPECT_EQ(ConvertElement(std::bit_cast<uint32_t>(-INFINITY), to_fp8), 0xfeu);
  EXPECT_EQ(ConvertElement(0xffc12345u, to_fp8), 0xffu);                       // NaN keeps its sign
  EXPECT_EQ(ConvertElement(std::bit_cast<uint32_t>(0x1p-9f), to_fp8), 0x01u);  // smallest
  EXPECT_EQ(ConvertElement(std::bit_cast<uint32_t>(0x1p-10f), to_fp8), 0x00u);  // tie to 0
  const Conversion to_fp16{ElementFormat::kFp32, ElementFormat::kFp16};
  EXPECT_EQ(ConvertElement(std::bit_cast<uint32_t>(65520.0f), to_fp16), 0x7c00u);  // infinity
  EXPECT_EQ(ConvertElement(std::bit_cast<uint32_t>(65519.0f), to_fp16), 0x7bffu);
  EXPECT_EQ(ConvertElement(0x7f800001u, to_fp16), 0x7e00u);
  const Conversion to_bf16{ElementFormat::kFp32, ElementFormat::kBf16};
  EXPECT_EQ(ConvertElement(0x3f808000u, to_bf16), 0x3f80u);  // tie to even (down)
  EXPECT_EQ(ConvertElement(0x3f818000u, to_bf16), 0x3f82u);  // tie to even (up)
  EXPECT_EQ(ConvertElement(0x7f7fffffu, to_bf16), 0x7f80u);  // overflows to infinity
  EXPECT_EQ(ConvertElement(0xff800001u, to_bf16), 0xffc0u);
  // fp32 NaN payloads to fp32 (through another format) are canonical.
  EXPECT_EQ(ConvertElement(0x7d01u, {ElementFormat::kFp16, ElementFormat::kFp32}), 0x7fc00000u);
}

TEST(Convert, CpuStreamConvertsPitchedPlanes) {
  auto dev = OpenDevice("cpu");
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  auto stream = (*dev)->CreateStream();
  ASSERT_TRUE(stream.ok());
  // bf16 source: 3 planes of 4 rows of 40 elements (80 bytes), pitches with gaps; fp8 out, rows
  // 40 bytes, other pitches.
  const size_t n = 40, rows = 4, planes = 3;
  std::vector<uint16_t> src(planes * 512 / 2);
  std::mt19937 rng(7);
  for (auto& v : src) v = static_cast<uint16_t>(rng());
  std::vector<uint8_t> dst(planes * 256, 0xee);
  CopyDesc d{};
  d.src = src.data();
  d.dst = dst.data();
  d.bytes = n;  // destination bytes: 40 fp8 elements
  d.rows = rows;
  d.src_pitch = 100;
  d.dst_pitch = 48;
  d.planes = planes;
  d.src_plane_pitch = 512;
  d.dst_plane_pitch = 256;
  const Conversion c{ElementFormat::kBf16, ElementFormat::kFp8E4m3};
  ASSERT_TRUE((*stream)->ConvertBatch({&d, 1}, c).ok());
  ASSERT_TRUE((*stream)->Synchronize(DeadlineIn(std::chrono::seconds(10))).ok());
  for (size_t q = 0; q < planes; ++q) {
    for (size_t r = 0; r < rows; ++r) {
      for (size_t i = 0; i < 48; ++i) {
        const uint8_t got = dst[q * 256 + r * 48 + i];
        if (i >= n) {
          ASSERT_EQ(got, 0xee) << "wrote past a row";
          continue;
        }
        uint16_t s;
        std::memcpy(&s, reinterpret_cast<const std::byte*>(src.data()) + q * 512 + r * 100 + 2 * i,
                    2);
        ASSERT_EQ(got, ConvertElement(s, c)) << q << " " << r << " " << i;
      }
    }
    for (size_t i = rows * 48; i < 256; ++i) ASSERT_EQ(dst[q * 256 + i], 0xee);
  }
}

// Scales (CopyDesc::src_scale, dst_scale): every 8- and 16-bit source code, dequantized by a
// source scale, quantized by a destination scale, or both (fp8 -> fp8 requantized), through a CPU
// stream's ConvertBatch, against the reference: the value times src_scale, divided by dst_scale
// in fp32 (as the engines compute it), then the reference's nearest code.
TEST(Convert, ScalesAgainstTheReference) {
  auto dev = OpenDevice("cpu");
  ASSERT_TRUE(dev.ok());
  auto stream = (*dev)->CreateStream();
  ASSERT_TRUE(stream.ok());
  struct Case {
    ElementFormat from, to;
    float src_scale, dst_scale;
  };
  const Case cases[] = {
      {ElementFormat::kBf16, ElementFormat::kFp8E4m3, 1.0f, 0.0137f},
      {ElementFormat::kBf16, ElementFormat::kFp8E4m3, 1.0f, 3.0f},
      {ElementFormat::kFp16, ElementFormat::kFp8E4m3, 1.0f, 0.21f},
      // Both scales: products with all of fp32's mantissa bits, narrowed through bf16 rounded to
      // odd by the AVX-512 loop.
      {ElementFormat::kBf16, ElementFormat::kFp8E4m3, 0.75f, 0.3f},
      {ElementFormat::kFp16, ElementFormat::kFp8E4m3, 1.3f, 0.0071f},
      {ElementFormat::kFp8E4m3, ElementFormat::kBf16, 0.0137f, 1.0f},
      {ElementFormat::kFp8E4m3, ElementFormat::kBf16, 3.5f, 0.7f},
      {ElementFormat::kFp8E4m3, ElementFormat::kBf16, 1.0e38f, 1.0f},  // overflows to infinity
      {ElementFormat::kFp8E4m3, ElementFormat::kFp16, 7.5f, 1.0f},
      {ElementFormat::kFp8E4m3, ElementFormat::kFp32, 0.3f, 1.0f},
      {ElementFormat::kFp8E4m3, ElementFormat::kFp8E4m3, 0.0137f, 0.05f},
      {ElementFormat::kFp8E4m3, ElementFormat::kFp8E4m3, 2.0f, 0.5f},
      {ElementFormat::kBf16, ElementFormat::kBf16, 1.0f, 1.0f},  // a copy, NaNs made quiet
      {ElementFormat::kFp16, ElementFormat::kBf16, 1.5f, 0.75f},
  };
  for (const Case& k : cases) {
    const Conversion c{k.from, k.to};
    const std::optional<NarrowReference> narrow =
        k.to == ElementFormat::kFp32 ? std::nullopt : std::optional(NarrowReference(k.to));
    const int in = ElementFormatSize(k.from), out = ElementFormatSize(k.to);
    const uint32_t codes = 1u << (8 * in);
    std::vector<std::byte> src(codes * in), dst(codes * out);
    for (uint32_t v = 0; v < codes; ++v) std::memcpy(src.data() + v * in, &v, in);
    // Two descriptors: the codes' first half scaled, the second half too (rows of a 2-D copy).
    CopyDesc d[2]{};
    for (int h = 0; h < 2; ++h) {
      d[h].src = src.data() + h * (codes / 2) * in;
      d[h].dst = dst.data() + h * (codes / 2) * out;
      d[h].bytes = codes / 4 * out;
      d[h].rows = 2;
      d[h].src_pitch = codes / 4 * in;
      d[h].dst_pitch = codes / 4 * out;
      d[h].src_scale = k.src_scale;
      d[h].dst_scale = k.dst_scale;
    }
    ASSERT_TRUE((*stream)->ConvertBatch(d, c).ok());
    ASSERT_TRUE((*stream)->Synchronize(DeadlineIn(std::chrono::seconds(30))).ok());
    for (uint32_t v = 0; v < codes; ++v) {
      uint32_t got = 0;
      std::memcpy(&got, dst.data() + v * out, out);
      const double value = Decode(k.from, v);
      const float scaled = static_cast<float>(value) * k.src_scale / k.dst_scale;
      const bool negative = (v >> (8 * in - 1)) & 1u;
      const uint32_t want = IsNanCode(k.from, v)
                                ? ((negative ? 1u << (8 * out - 1) : 0u) | QuietNan(k.to))
                            : narrow ? (*narrow)(scaled)
                                     : ExpectedFromValue(k.to, scaled);
      ASSERT_EQ(got, want) << ElementFormatName(k.from) << " -> " << ElementFormatName(k.to)
                           << " code " << v << " scales " << k.src_scale << ", " << k.dst_scale;
      ASSERT_EQ(ConvertElement(v, c, k.src_scale, k.dst_scale), want);
    }
    // Every scaled loop this CPU runs (portable, AVX2, AVX-512) writes the same bytes.
    for (ConvertPath path : {ConvertPath::kPortable, ConvertPath::kAvx2, ConvertPath::kAvx512}) {
      std::vector<std::byte> got(dst.size());
      if (!ConvertElementsScaledWith(path, got.data(), src.data(), codes, c, k.src_scale,
                                     k.dst_scale)) {
        EXPECT_NE(path, ConvertPath::kPortable) << "the portable loops run everywhere";
        continue;
      }
      EXPECT_EQ(got, dst) << "scaled loops " << static_cast<int>(path)
                          << " disagree: " << ElementFormatName(k.from) << " -> "
                          << ElementFormatName(k.to);
    }
  }
}

// Per-block scales (CopyDesc::src_scales, dst_scales): each plane a scale group. Quantizing to
// fp8, a plane's scale is its largest finite |value| times the source scale over 448 (a plane of
// zeros gets kMinBlockScale; NaN and infinity are left out of the maximum, NaN passes, infinity
// saturates), and its elements are the reference's nearest code of value * src / scale.
// Dequantizing reads each plane's scale; fp8 -> fp8 with both arrays moves codes and scales
// unchanged.
TEST(Convert, PerBlockScalesAgainstTheReference) {
  auto dev = OpenDevice("cpu");
  ASSERT_TRUE(dev.ok());
  auto stream = (*dev)->CreateStream();
  ASSERT_TRUE(stream.ok());
  constexpr size_t kRows = 3, kElems = 40, kPlanes = 4;
  constexpr size_t kPlaneElems = kRows * kElems;
  std::mt19937 rng(26);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  // bf16 source planes: random; all zeros; with NaN and infinities; one huge value.
  std::vector<uint16_t> src(kPlanes * kPlaneElems);
  for (size_t i = 0; i < src.size(); ++i) {
    const float v = i / kPlaneElems == 1 ? 0.0f : normal(rng);
    src[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(v) >> 16);
  }
  src[2 * kPlaneElems + 5] = 0x7fc1;  // NaN
  src[2 * kPlaneElems + 6] = 0x7f80;  // +infinity
  src[2 * kPlaneElems + 7] = 0xff80;  // -infinity
  src[3 * kPlaneElems + 9] = 0xc7c3;  // -99840
  const float kSrcScale = 0.5f;
  std::vector<uint8_t> q(kPlanes * kPlaneElems, 0xee);
  std::vector<float> scales(2 * kPlanes, -1.0f);  // stride 2: the odd ones stay untouched
  CopyDesc d{};
  d.src = src.data();
  d.dst = q.data();
  d.bytes = kElems;
  d.rows = kRows;
  d.src_pitch = kElems * 2;
  d.dst_pitch = kElems;
  d.planes = kPlanes;
  d.src_plane_pitch = kPlaneElems * 2;
  d.dst_plane_pitch = kPlaneElems;
  d.src_scale = kSrcScale;
  d.dst_scales = scales.data();
  d.dst_scale_stride = 2;
  const Conversion to_fp8{ElementFormat::kBf16, ElementFormat::kFp8E4m3};
  ASSERT_TRUE((*stream)->ConvertBatch({&d, 1}, to_fp8).ok());
  ASSERT_TRUE((*stream)->Synchronize(DeadlineIn(std::chrono::seconds(30))).ok());
  const NarrowReference narrow(ElementFormat::kFp8E4m3);
  for (size_t p = 0; p < kPlanes; ++p) {
    float amax = 0;
    for (size_t i = 0; i < kPlaneElems; ++i) {
      const double v = Decode(ElementFormat::kBf16, src[p * kPlaneElems + i]);
      if (std::isfinite(v)) amax = std::max(amax, static_cast<float>(std::fabs(v)));
    }
    const float want_scale = std::max(amax * kSrcScale / 448.0f, 1.0f / (448.0f * 512.0f));
    ASSERT_EQ(scales[2 * p], want_scale) << "plane " << p;
    ASSERT_EQ(scales[2 * p + 1], -1.0f);
    for (size_t i = 0; i < kPlaneElems; ++i) {
      const uint16_t v = src[p * kPlaneElems + i];
      const uint8_t got = q[p * kPlaneElems + i];
      if (IsNanCode(ElementFormat::kBf16, v)) {
        ASSERT_EQ(got, 0x7f) << p << " " << i;
        continue;
      }
      const float x = static_cast<float>(Decode(ElementFormat::kBf16, v)) * kSrcScale / want_scale;
      ASSERT_EQ(got, narrow(x)) << "plane " << p << " element " << i;
    }
  }
  EXPECT_EQ(scales[2], 1.0f / (448.0f * 512.0f));  // the plane of zeros
  EXPECT_EQ(q[2 * kPlaneElems + 6], 0x7e);         // +infinity saturates
  EXPECT_EQ(q[2 * kPlaneElems + 7], 0xfe);
  EXPECT_EQ(q[3 * kPlaneElems + 9], 0xfe);  // the plane's largest value becomes -448

  // Back to bf16 with each plane's scale read (stride 2).
  std::vector<uint16_t> back(src.size(), 0xeeee);
  CopyDesc b{};
  b.src = q.data();
  b.dst = back.data();
  b.bytes = kElems * 2;
  b.rows = kRows;
  b.src_pitch = kElems;
  b.dst_pitch = kElems * 2;
  b.planes = kPlanes;
  b.src_plane_pitch = kPlaneElems;
  b.dst_plane_pitch = kPlaneElems * 2;
  b.src_scales = scales.data();
  b.src_scale_stride = 2;
  ASSERT_TRUE(
      (*stream)->ConvertBatch({&b, 1}, {ElementFormat::kFp8E4m3, ElementFormat::kBf16}).ok());
  ASSERT_TRUE((*stream)->Synchronize(DeadlineIn(std::chrono::seconds(30))).ok());
  const NarrowReference to_bf16(ElementFormat::kBf16);
  for (size_t i = 0; i < back.size(); ++i) {
    const uint8_t v = q[i];
    if (IsNanCode(ElementFormat::kFp8E4m3, v)) continue;
    const float x =
        static_cast<float>(Decode(ElementFormat::kFp8E4m3, v)) * scales[2 * (i / kPlaneElems)];
    ASSERT_EQ(back[i], to_bf16(x)) << i;
  }

  // fp8 -> fp8 with both arrays: codes and scales travel unchanged.
  std::vector<uint8_t> moved(q.size(), 0);
  std::vector<float> moved_scales(kPlanes, 0.0f);
  CopyDesc m{};
  m.src = q.data();
  m.dst = moved.data();
  m.bytes = kPlaneElems;
  m.planes = kPlanes;
  m.src_plane_pitch = kPlaneElems;
  m.dst_plane_pitch = kPlaneElems;
  m.src_scales = scales.data();
  m.src_scale_stride = 2;
  m.dst_scales = moved_scales.data();
  const Conversion same{ElementFormat::kFp8E4m3, ElementFormat::kFp8E4m3};
  ASSERT_TRUE((*stream)->ConvertBatch({&m, 1}, same).ok());
  ASSERT_TRUE((*stream)->Synchronize(DeadlineIn(std::chrono::seconds(30))).ok());
  EXPECT_EQ(moved, q);
  for (size_t p = 0; p < kPlanes; ++p) EXPECT_EQ(moved_scales[p], scales[2 * p]);
}

// The amax of per-block scales on every path this CPU runs: the portable loop's result (the
// largest finite magnitude; NaN and infinity left out) for random codes of every format, planes
// of 1-5 rows with vector bodies and scalar tails, unaligned pitches, the largest value in a tail,
// and planes with nothing finite.
TEST(Convert, PlaneMaxMagnitudeOnEveryPath) {
  std::mt19937 rng(7);
  for (ElementFormat f : {ElementFormat::kFp32, ElementFormat::kFp16, ElementFormat::kBf16,
                          ElementFormat::kFp8E4m3}) {
    const size_t w = static_cast<size_t>(ElementFormatSize(f));
    for (size_t rows : {1, 2, 5}) {
      for (size_t n : {1, 31, 40, 128, 257}) {
        for (int kind = 0; kind < 3; ++kind) {  // random codes; largest in a tail; no finite one
          SCOPED_TRACE(fmt::format("{} {} x {} kind {}", ElementFormatName(f), rows, n, kind));
          const uint32_t big = f == ElementFormat::kFp8E4m3 ? 0x5a  // a finite code
                               : w == 2                     ? 0x4a00
                                                            : 0x47000000;
          const size_t pitch = (n + 3) * w + 1;
          std::vector<std::byte> plane(rows * pitch + 32);
          for (auto& b : plane) b = static_cast<std::byte>(rng());
          if (kind > 0) {  // small finite values everywhere (sign random), then the case's own
            for (size_t r = 0; r < rows; ++r) {
              for (size_t i = 0; i < n; ++i) {
                const uint32_t code = kind == 1 ? (rng() & 0x1) : 0x7fffffffu;  // NaN codes
                std::byte* e = plane.data() + 1 + r * pitch + i * w;
                const uint32_t bits = f == ElementFormat::kFp8E4m3 ? (code & 0x7f) | 0x80
                                      : w == 2                     ? (code & 0x7fff) | 0x8000
                                                                   : code | 0x80000000u;
                std::memcpy(e, &bits, w);
              }
            }
            if (kind == 1) {  // the plane's largest: the last element of the last row
              std::memcpy(plane.data() + 1 + (rows - 1) * pitch + (n - 1) * w, &big, w);
            }
          }
          uint32_t want = 0;
          ASSERT_TRUE(PlaneMaxMagnitudeWith(ConvertPath::kPortable, f, plane.data() + 1, rows,
                                            pitch, n, &want));
          if (kind == 1) {
            EXPECT_EQ(want, ConvertElement(big, {f, ElementFormat::kFp32}));
          } else if (kind == 2) {
            EXPECT_EQ(want, 0u);
          }
          for (ConvertPath path : {ConvertPath::kAvx2, ConvertPath::kAvx512}) {
            uint32_t got = 0;
            if (!PlaneMaxMagnitudeWith(path, f, plane.data() + 1, rows, pitch, n, &got)) continue;
            EXPECT_EQ(got, want) << "path " << static_cast<int>(path);
          }
        }
      }
    }
  }
}

TEST(Convert, RefusesPerBlockScalesItCannotCompute) {
  auto dev = OpenDevice("cpu");
  ASSERT_TRUE(dev.ok());
  auto stream = (*dev)->CreateStream();
  ASSERT_TRUE(stream.ok());
  std::vector<std::byte> a(64), b(64);
  float scales[2] = {};
  CopyDesc d{};
  d.src = a.data();
  d.dst = b.data();
  d.bytes = 8;
  d.dst_scales = scales;
  Status s = (*stream)->ConvertBatch({&d, 1}, {ElementFormat::kFp32, ElementFormat::kBf16});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("computed for fp8 only, and the destination is bf16"),
            std::string::npos)
      << s.ToString();
  d.planes = 2;
  d.src_plane_pitch = 16;
  d.dst_plane_pitch = 8;
  d.dst_scale_stride = 0;
  s = (*stream)->ConvertBatch({&d, 1}, {ElementFormat::kBf16, ElementFormat::kFp8E4m3});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("2 planes would write one destination scale"), std::string::npos)
      << s.ToString();
}

TEST(Convert, RefusesBadScalesAndPartialElements) {
  auto dev = OpenDevice("cpu");
  ASSERT_TRUE(dev.ok());
  auto stream = (*dev)->CreateStream();
  ASSERT_TRUE(stream.ok());
  std::vector<std::byte> a(64), b(64);
  CopyDesc d{};
  d.src = a.data();
  d.dst = b.data();
  d.bytes = 3;
  Status s = (*stream)->ConvertBatch({&d, 1}, {ElementFormat::kFp32, ElementFormat::kFp16});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("3 bytes are not whole fp16 elements"), std::string::npos)
      << s.ToString();
  d.bytes = 4;
  for (float bad : {0.0f, -1.0f, INFINITY, NAN}) {
    d.dst_scale = bad;
    s = (*stream)->ConvertBatch({&d, 1}, {ElementFormat::kBf16, ElementFormat::kFp8E4m3});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("must be finite and positive"), std::string::npos) << s.ToString();
  }
}

}  // namespace
}  // namespace kvferry

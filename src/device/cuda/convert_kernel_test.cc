// The CUDA conversion kernel (Stream::ConvertBatch, convert_kernel.cu) against the host's loops
// (convert.h, themselves checked against an independent reference in convert_test.cc), byte for
// byte: every code of the 16- and 8-bit formats and random fp32 bit patterns, each conversion
// pair, in 8-element groups and element by element (unaligned rows), pitched 3-D descriptors
// between device and pinned host memory, nothing written outside the rows; pageable memory is
// refused. Timed beside one cudaMemcpy of the destination bytes (the same-run baseline). Skips
// without a GPU.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "device/convert.h"
#include "kvferry/device.h"
#include "testing/cuda_copy_test_support.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

constexpr ElementFormat kFormats[] = {ElementFormat::kFp32, ElementFormat::kFp16,
                                      ElementFormat::kBf16, ElementFormat::kFp8E4m3};

class CudaConvertTest : public copy_test::GpuCopyTest {
 protected:
  // Converts `src` (count elements of c.from) on the GPU as `rows` rows with the given pitches
  // (planes of them), from `src_kind` to `dst_kind` memory; returns the destination bytes.
  std::vector<std::byte> Run(const std::vector<std::byte>& src, Conversion c, const CopyDesc& shape,
                             size_t dst_size, MemoryKind src_kind, MemoryKind dst_kind) {
    auto s = NewStream();
    Buffer host = Alloc(MemoryKind::kPinnedHost, std::max(src.size(), dst_size));
    Buffer in = Alloc(src_kind, src.size()), out = Alloc(dst_kind, dst_size);
    std::memcpy(host.data(), src.data(), src.size());
    EXPECT_TRUE(s->Copy(in.data(), host.data(), src.size()).ok());
    EXPECT_TRUE(s->Fill(out.data(), 0xEE, dst_size).ok());
    CopyDesc d = shape;
    d.src = static_cast<const std::byte*>(in.data()) + reinterpret_cast<uintptr_t>(shape.src);
    d.dst = static_cast<std::byte*>(out.data()) + reinterpret_cast<uintptr_t>(shape.dst);
    Status st = s->ConvertBatch({&d, 1}, c);
    EXPECT_TRUE(st.ok()) << st.ToString();
    EXPECT_TRUE(s->Copy(host.data(), out.data(), dst_size).ok());
    EXPECT_TRUE(s->Synchronize(DeadlineIn(milliseconds(20000))).ok());
    return std::vector<std::byte>(host.data(), host.data() + dst_size);
  }
};

// The host's answer for the same descriptor (offsets relative to the buffers).
std::vector<std::byte> HostAnswer(const std::vector<std::byte>& src, Conversion c,
                                  const CopyDesc& shape, size_t dst_size) {
  std::vector<std::byte> out(dst_size, std::byte{0xEE});
  CopyDesc d = shape;
  d.src = src.data() + reinterpret_cast<uintptr_t>(shape.src);
  d.dst = out.data() + reinterpret_cast<uintptr_t>(shape.dst);
  ConvertHostBatch({&d, 1}, c);
  return out;
}

std::vector<std::byte> EveryCode(ElementFormat f, size_t count) {
  std::vector<std::byte> v(count * ElementFormatSize(f));
  std::mt19937 rng(5);
  for (size_t i = 0; i < count; ++i) {
    uint32_t code = ElementFormatSize(f) == 4 ? rng() : static_cast<uint32_t>(i);
    std::memcpy(v.data() + i * ElementFormatSize(f), &code, ElementFormatSize(f));
  }
  return v;
}

TEST_F(CudaConvertTest, EveryCodeOfEveryPairMatchesTheHost) {
  for (ElementFormat from : kFormats) {
    for (ElementFormat to : kFormats) {
      if (from == to) continue;
      SCOPED_TRACE(fmt::format("{} -> {}", ElementFormatName(from), ElementFormatName(to)));
      const size_t count = 65536;  // every 16-bit code, each 8-bit one 256 times
      const std::vector<std::byte> src = EveryCode(from, count);
      CopyDesc one{};
      one.bytes = count * ElementFormatSize(to);
      const size_t dst_size = one.bytes;
      const auto want = HostAnswer(src, {from, to}, one, dst_size);
      EXPECT_EQ(Run(src, {from, to}, one, dst_size, MemoryKind::kDevice, MemoryKind::kDevice),
                want);
    }
  }
}

// Scales (CopyDesc::src_scale, dst_scale): every code of every pair, from == to included (fp8
// requantized), grouped and element by element, matches the host's scaled loop.
TEST_F(CudaConvertTest, ScaledEveryCodeOfEveryPairMatchesTheHost) {
  for (ElementFormat from : kFormats) {
    for (ElementFormat to : kFormats) {
      SCOPED_TRACE(fmt::format("{} -> {} scaled", ElementFormatName(from), ElementFormatName(to)));
      const size_t count = 65536;
      const std::vector<std::byte> src = EveryCode(from, count + 1);
      for (size_t offset : {size_t{0}, size_t{1}}) {  // aligned groups, then element by element
        CopyDesc one{};
        one.src = reinterpret_cast<const void*>(offset * ElementFormatSize(from));
        one.bytes = count * ElementFormatSize(to);
        one.src_scale = 0.0137f;
        one.dst_scale = 0.21f;
        const size_t dst_size = one.bytes;
        const auto want = HostAnswer(src, {from, to}, one, dst_size);
        EXPECT_EQ(Run(src, {from, to}, one, dst_size, MemoryKind::kDevice, MemoryKind::kDevice),
                  want);
      }
    }
  }
}

TEST_F(CudaConvertTest, PitchedPlanesAlignedAndNotMatchTheHost) {
  struct Shape {
    size_t elements, rows, planes, src_skew, dst_skew;  // skew: elements of padding
  };
  const Shape shapes[] = {{128, 16, 4, 0, 0}, {128, 16, 4, 3, 5}, {37, 9, 3, 1, 0},
                          {8, 64, 1, 0, 0},   {1000, 1, 1, 0, 0}, {1001, 1, 2, 7, 1}};
  const MemoryKind kinds[][2] = {{MemoryKind::kDevice, MemoryKind::kDevice},
                                 {MemoryKind::kDevice, MemoryKind::kPinnedHost},
                                 {MemoryKind::kPinnedHost, MemoryKind::kDevice}};
  for (ElementFormat from : kFormats) {
    for (ElementFormat to : kFormats) {
      if (from == to) continue;
      for (const Shape& sh : shapes) {
        const size_t in = ElementFormatSize(from), out = ElementFormatSize(to);
        CopyDesc d{};
        d.bytes = sh.elements * out;
        d.rows = sh.rows;
        d.src_pitch = (sh.elements + sh.src_skew) * in;
        d.dst_pitch = (sh.elements + sh.dst_skew) * out;
        d.planes = sh.planes;
        d.src_plane_pitch = d.src_pitch * sh.rows + 64 * in;
        d.dst_plane_pitch = d.dst_pitch * sh.rows + 32 * out;
        d.src = reinterpret_cast<const void*>(sh.src_skew * in);
        d.dst = reinterpret_cast<void*>(sh.dst_skew * out);
        const size_t src_size = sh.src_skew * in + sh.planes * d.src_plane_pitch;
        const size_t dst_size = sh.dst_skew * out + sh.planes * d.dst_plane_pitch;
        std::vector<std::byte> src(src_size);
        std::mt19937 rng(static_cast<uint32_t>(sh.elements + sh.rows));
        for (auto& b : src) b = static_cast<std::byte>(rng());
        const auto want = HostAnswer(src, {from, to}, d, dst_size);
        for (const auto& k : kinds) {
          SCOPED_TRACE(fmt::format(
              "{} -> {}, {} elements x {} rows x {} planes, skew {}/{}, {} -> {}",
              ElementFormatName(from), ElementFormatName(to), sh.elements, sh.rows, sh.planes,
              sh.src_skew, sh.dst_skew, MemoryKindName(k[0]), MemoryKindName(k[1])));
          ASSERT_EQ(Run(src, {from, to}, d, dst_size, k[0], k[1]), want);
        }
      }
    }
  }
}

// Per-block scales (CopyDesc::src_scales, dst_scales): descriptors of planes, each a scale group,
// aligned and not, scale arrays strided, in device and pinned memory: the same codes and scales
// as the host (quantizing computes each plane's scale: its amax reduced in one thread block).
TEST_F(CudaConvertTest, PerBlockScalesMatchTheHost) {
  struct Case {
    ElementFormat from, to;
    bool src_array, dst_array;
  };
  const Case cases[] = {{ElementFormat::kBf16, ElementFormat::kFp8E4m3, false, true},
                        {ElementFormat::kFp16, ElementFormat::kFp8E4m3, false, true},
                        {ElementFormat::kFp32, ElementFormat::kFp8E4m3, false, true},
                        {ElementFormat::kFp8E4m3, ElementFormat::kFp8E4m3, true, false},
                        {ElementFormat::kFp8E4m3, ElementFormat::kBf16, true, false},
                        {ElementFormat::kFp8E4m3, ElementFormat::kFp8E4m3, true, true},
                        {ElementFormat::kBf16, ElementFormat::kFp8E4m3, true, true}};
  struct Shape {
    size_t elements, rows, planes, skew;
  };
  // Aligned planes of one register tile (2,048 elements), of four, of one and a bit (the last
  // tile partial); unaligned ones (skew, odd lengths).
  const Shape shapes[] = {{128, 16, 40, 0}, {128, 64, 5, 0}, {256, 9, 4, 0},
                          {128, 16, 3, 5},  {37, 9, 7, 1},   {2048, 1, 300, 0}};
  auto s = NewStream();
  for (const Case& k : cases) {
    for (const Shape& sh : shapes) {
      for (MemoryKind dst_kind : {MemoryKind::kDevice, MemoryKind::kPinnedHost}) {
        SCOPED_TRACE(fmt::format("{} -> {} arrays {}/{}, {} x {} x {} skew {}, into {}",
                                 ElementFormatName(k.from), ElementFormatName(k.to), k.src_array,
                                 k.dst_array, sh.elements, sh.rows, sh.planes, sh.skew,
                                 MemoryKindName(dst_kind)));
        const size_t in = ElementFormatSize(k.from), out = ElementFormatSize(k.to);
        CopyDesc d{};
        d.bytes = sh.elements * out;
        d.rows = sh.rows;
        d.src_pitch = (sh.elements + sh.skew) * in;
        d.dst_pitch = (sh.elements + sh.skew) * out;
        d.planes = sh.planes;
        d.src_plane_pitch = d.src_pitch * sh.rows + 16 * in;
        d.dst_plane_pitch = d.dst_pitch * sh.rows;
        d.src_scale = 0.75f;
        d.dst_scale = 0.031f;
        d.src_scale_stride = 3;
        d.dst_scale_stride = 2;
        const size_t src_size = sh.skew * in + sh.planes * d.src_plane_pitch;
        const size_t dst_size = sh.skew * out + sh.planes * d.dst_plane_pitch;
        std::vector<std::byte> src(src_size);
        std::mt19937 rng(static_cast<uint32_t>(sh.elements * 7 + sh.planes));
        for (auto& b : src) b = static_cast<std::byte>(rng());
        std::vector<float> src_scales(3 * sh.planes), dst_scales(2 * sh.planes, -1.0f);
        for (float& v : src_scales) v = 0.001f + static_cast<float>(rng() % 1000) / 97.0f;
        // The host's answer.
        std::vector<std::byte> want(dst_size, std::byte{0xEE});
        std::vector<float> want_scales = dst_scales;
        CopyDesc h = d;
        h.src = src.data() + sh.skew * in;
        h.dst = want.data() + sh.skew * out;
        h.src_scales = k.src_array ? src_scales.data() : nullptr;
        h.dst_scales = k.dst_array ? want_scales.data() : nullptr;
        ConvertHostBatch({&h, 1}, {k.from, k.to});
        // The GPU's, the scale arrays in device memory.
        Buffer host = Alloc(MemoryKind::kPinnedHost, std::max(src_size, dst_size));
        Buffer a = Alloc(MemoryKind::kDevice, src_size), b = Alloc(dst_kind, dst_size);
        Buffer ss = Alloc(MemoryKind::kDevice, src_scales.size() * 4);
        Buffer ds = Alloc(MemoryKind::kDevice, dst_scales.size() * 4);
        std::memcpy(host.data(), src.data(), src_size);
        ASSERT_TRUE(s->Copy(a.data(), host.data(), src_size).ok());
        ASSERT_TRUE(s->Synchronize(DeadlineIn(milliseconds(20000))).ok());
        std::memcpy(host.data(), src_scales.data(), src_scales.size() * 4);
        ASSERT_TRUE(s->Copy(ss.data(), host.data(), src_scales.size() * 4).ok());
        ASSERT_TRUE(s->Synchronize(DeadlineIn(milliseconds(20000))).ok());
        std::memcpy(host.data(), dst_scales.data(), dst_scales.size() * 4);
        ASSERT_TRUE(s->Copy(ds.data(), host.data(), dst_scales.size() * 4).ok());
        ASSERT_TRUE(s->Fill(b.data(), 0xEE, dst_size).ok());
        CopyDesc g = d;
        g.src = a.data() + sh.skew * in;
        g.dst = b.data() + sh.skew * out;
        g.src_scales = k.src_array ? reinterpret_cast<const float*>(ss.data()) : nullptr;
        g.dst_scales = k.dst_array ? reinterpret_cast<float*>(ds.data()) : nullptr;
        Status st = s->ConvertBatch({&g, 1}, {k.from, k.to});
        ASSERT_TRUE(st.ok()) << st.ToString();
        ASSERT_TRUE(s->Copy(host.data(), b.data(), dst_size).ok());
        ASSERT_TRUE(s->Synchronize(DeadlineIn(milliseconds(20000))).ok());
        ASSERT_EQ(std::vector<std::byte>(host.data(), host.data() + dst_size), want);
        ASSERT_TRUE(s->Copy(host.data(), ds.data(), dst_scales.size() * 4).ok());
        ASSERT_TRUE(s->Synchronize(DeadlineIn(milliseconds(20000))).ok());
        std::vector<float> got_scales(dst_scales.size());
        std::memcpy(got_scales.data(), host.data(), got_scales.size() * 4);
        ASSERT_EQ(got_scales, want_scales);
      }
    }
  }
}

TEST_F(CudaConvertTest, PageableMemoryIsRefused) {
  auto s = NewStream();
  Buffer dev = Alloc(MemoryKind::kDevice, 4096);
  std::vector<std::byte> pageable(4096);
  CopyDesc d{};
  d.src = pageable.data();
  d.dst = dev.data();
  d.bytes = 1024;
  Status st = s->ConvertBatch({&d, 1}, {ElementFormat::kBf16, ElementFormat::kFp8E4m3});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("can't reach"), std::string_view::npos) << st.ToString();
}

// Best of five, seconds: ConvertBatch of `descs` (its host enqueue alone, and with the GPU's
// work), alternated with one copy of `copy_bytes` from `copy_src` to `copy_dst`.
struct Timing {
  double conv = 1e9, enqueue = 1e9, copy = 1e9;
};
void TimeBesideOneCopy(Stream& s, const std::vector<CopyDesc>& descs, Conversion c,
                       std::byte* copy_dst, const std::byte* copy_src, size_t copy_bytes,
                       Timing* t) {
  const auto since = [](std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(s.ConvertBatch(descs, c).ok());
    t->enqueue = std::min(t->enqueue, since(t0));
    ASSERT_TRUE(s.Synchronize(DeadlineIn(milliseconds(20000))).ok());
    t->conv = std::min(t->conv, since(t0));
    t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(s.Copy(copy_dst, copy_src, copy_bytes).ok());
    ASSERT_TRUE(s.Synchronize(DeadlineIn(milliseconds(20000))).ok());
    t->copy = std::min(t->copy, since(t0));
  }
}

// Throughput of the kernel on one large batch of Llama-3-8B-like rows (128 elements, K/V head
// slices), beside one cudaMemcpy of the destination bytes in the same run. Printed, not asserted
// (a measurement, not a test of speed); bench transfer is the tool.
TEST_F(CudaConvertTest, ThroughputBesideOneCopy) {
  auto s = NewStream();
  const size_t rows = 1 << 20, elements = 128;  // 128 Mi elements
  for (auto [from, to] : {std::pair{ElementFormat::kBf16, ElementFormat::kFp8E4m3},
                          {ElementFormat::kFp8E4m3, ElementFormat::kBf16},
                          {ElementFormat::kBf16, ElementFormat::kFp16}}) {
    const size_t in = rows * elements * ElementFormatSize(from);
    const size_t out = rows * elements * ElementFormatSize(to);
    Buffer a = Alloc(MemoryKind::kDevice, in), b = Alloc(MemoryKind::kDevice, out);
    Buffer c = Alloc(MemoryKind::kDevice, out);
    ASSERT_TRUE(s->Fill(a.data(), 0x3c, in).ok());
    std::vector<CopyDesc> descs;
    for (size_t k = 0; k < 64; ++k) {  // 64 descriptors of rows/64 rows each
      CopyDesc d{};
      d.src = a.data() + k * in / 64;
      d.dst = b.data() + k * out / 64;
      d.bytes = elements * ElementFormatSize(to);
      d.rows = rows / 64;
      d.src_pitch = elements * ElementFormatSize(from);
      d.dst_pitch = d.bytes;
      descs.push_back(d);
    }
    Timing t;
    TimeBesideOneCopy(*s, descs, {from, to}, c.data(), b.data(), out, &t);
    if (HasFatalFailure()) return;
    const double conv = t.conv, copy = t.copy;
    fmt::print(
        "convert {} -> {}: {:.0f} GB/s of destination ({:.0f} of source); one copy of the "
        "destination bytes {:.0f} GB/s; ratio {:.2f}\n",
        ElementFormatName(from), ElementFormatName(to), out / conv / 1e9, in / conv / 1e9,
        out / copy / 1e9, copy / conv);
  }
  // bf16 -> fp8 with per-block scales: Llama-3-8B blocks of 16 tokens, a plane (scale group) per
  // (block, layer, K/V, head) of 16 rows of 128 elements, against one copy of the source bytes.
  // Three batches of the same bytes: a descriptor per (block, layer, K/V) of 8 heads interleaved
  // (NHD, as the planner makes them); 512 contiguous planes a descriptor (HND, 64x fewer
  // descriptors); the NHD batch with a tensor scale instead (the plain conversion kernel). The
  // host's share is ConvertBatch's own time (descriptors checked and written to the ring).
  const size_t heads = 8, tokens = 16, dim = 128, groups = (size_t{1} << 27) / (tokens * dim);
  const size_t in = groups * tokens * dim * 2, out = groups * tokens * dim;
  Buffer a = Alloc(MemoryKind::kDevice, in), b = Alloc(MemoryKind::kDevice, out);
  Buffer c = Alloc(MemoryKind::kDevice, in), sc = Alloc(MemoryKind::kDevice, groups * 4);
  ASSERT_TRUE(s->Fill(a.data(), 0x3c, in).ok());
  for (const char* batch : {"nhd", "hnd", "tensor"}) {
    const bool hnd = batch[0] == 'h', tensor = batch[0] == 't';
    const size_t per_desc = hnd ? 512 : heads;  // planes a descriptor
    std::vector<CopyDesc> descs;
    for (size_t t = 0; t < groups / per_desc; ++t) {
      CopyDesc d{};
      d.src = a.data() + t * per_desc * tokens * dim * 2;
      d.dst = b.data() + t * per_desc * tokens * dim;
      d.bytes = dim;
      d.rows = tokens;
      d.src_pitch = (hnd ? 1 : heads) * dim * 2;
      d.dst_pitch = (hnd ? 1 : heads) * dim;
      d.planes = per_desc;
      d.src_plane_pitch = (hnd ? tokens : 1) * dim * 2;
      d.dst_plane_pitch = (hnd ? tokens : 1) * dim;
      if (tensor) {
        d.dst_scale = 0.02f;
      } else {
        d.dst_scales = reinterpret_cast<float*>(sc.data()) + t * per_desc;
      }
      descs.push_back(d);
    }
    Timing t;
    TimeBesideOneCopy(*s, descs, {ElementFormat::kBf16, ElementFormat::kFp8E4m3}, c.data(),
                      a.data(), in, &t);
    if (HasFatalFailure()) return;
    const double conv = t.conv, copy = t.copy, enqueue = t.enqueue;
    fmt::print(
        "convert bf16 -> fp8 {} ({} groups of 16 x 128, {} descriptors of {} planes): {:.0f} GB/s "
        "of source; one copy of the source bytes {:.0f} GB/s; ratio {:.2f}; {:.0f} us of the "
        "{:.0f} in ConvertBatch's host enqueue\n",
        tensor ? "tensor scale" : "per-block scales", groups, descs.size(), per_desc,
        in / conv / 1e9, in / copy / 1e9, copy / conv, enqueue * 1e6, conv * 1e6);
  }
}

}  // namespace
}  // namespace kvferry

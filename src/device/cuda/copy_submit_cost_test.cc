// What one CopyBatch costs the calling thread to submit, by how its descriptors spread over
// allocations. Why: on the H200 a context rank sending vLLM per-layer HND pools spends ~200 us of
// progress-thread CPU per request in the peer-memory submit (CopyBatch + Record, profile phase
// copy_submit) at 256 and at 1024 tokens alike, against 12-16 us for block-major pools (session
// 23). A per-layer pool is 32 allocations (one per layer) on each side, so a request's batch
// touches 64 regions; a block-major pool is one. This test submits the same 64 descriptors
// (same sizes, same route) between 32 + 32 allocations and between two, times the submission on
// the host (median of many, warm), and checks the copied bytes. It skips without a GPU; it prints
// the numbers and asserts only the bytes and that submission worked.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kvferry/device.h"
#include "testing/cuda_copy_test_support.h"

namespace kvferry {
namespace {

constexpr int kRegions = 32;
constexpr size_t kPiece = 512 << 10;         // one (layer, kv) run of a 256-token request
constexpr size_t kRegionBytes = 8 * kPiece;  // room for K and V pieces at a stride

class CopySubmitCost : public copy_test::GpuCopyTest {
 protected:
  // 64 descriptors: two pieces per region pair, `regions` of them (1: all in one allocation).
  std::vector<CopyDesc> Descs(const std::vector<Buffer>& dst, const std::vector<Buffer>& src,
                              bool two_d) {
    std::vector<CopyDesc> out;
    for (int i = 0; i < 2 * kRegions; ++i) {
      const size_t r = static_cast<size_t>(i / 2) % dst.size();
      const size_t at = dst.size() == 1 ? static_cast<size_t>(i) * 2 * kPiece
                                        : static_cast<size_t>(i % 2) * 2 * kPiece;
      CopyDesc c{};
      c.dst = dst[r].data() + at;
      c.src = src[r].data() + at;
      if (two_d) {  // 16 rows of 32 KiB at a 64 KiB pitch (HND head slices)
        c.bytes = 32 << 10;
        c.rows = 16;
        c.dst_pitch = c.src_pitch = 64 << 10;
      } else {
        c.bytes = kPiece;
        c.rows = 1;
        c.dst_pitch = c.src_pitch = kPiece;
      }
      out.push_back(c);
    }
    return out;
  }

  // 4096 descriptors of 32 KiB (a 1024-token request of scattered 16-token blocks: one per block,
  // layer and kv), each region's in turn, so consecutive descriptors never share an allocation.
  std::vector<CopyDesc> Scattered(const std::vector<Buffer>& dst, const std::vector<Buffer>& src) {
    std::vector<CopyDesc> out;
    constexpr size_t kBlock = 32 << 10;
    for (size_t i = 0; i < 4096; ++i) {
      const size_t r = i % dst.size();
      const size_t at = dst.size() == 1 ? i * kBlock : (i / dst.size()) * kBlock;
      CopyDesc c{};
      c.dst = dst[r].data() + at;
      c.src = src[r].data() + at;
      c.bytes = kBlock;
      c.rows = 1;
      c.dst_pitch = c.src_pitch = kBlock;
      out.push_back(c);
    }
    return out;
  }

  // The median host time of CopyBatch + Record, in microseconds.
  double SubmitUs(Stream& s, const std::vector<CopyDesc>& descs) {
    auto ev = dev_->CreateEvent();
    EXPECT_TRUE(ev.ok());
    std::vector<double> us;
    for (int i = 0; i < 220; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      Status st = s.CopyBatch(descs);
      if (st.ok()) st = s.Record(**ev);
      const auto t1 = std::chrono::steady_clock::now();
      EXPECT_TRUE(st.ok()) << st.ToString();
      if (i >= 20) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      if (i % 16 == 15) {
        EXPECT_TRUE(s.Synchronize(copy_test::Soon()).ok());
      }
    }
    EXPECT_TRUE(s.Synchronize(copy_test::Soon()).ok());
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  }

  // Every descriptor's destination bytes equal its source's.
  void ExpectCopied(Stream& s, const std::vector<CopyDesc>& descs) {
    std::vector<std::byte> a(64 << 10), b(64 << 10);
    for (const CopyDesc& c : descs) {
      const size_t n = std::min(a.size(), c.bytes);  // the first row's head
      ASSERT_TRUE(s.Copy(a.data(), c.src, n).ok());
      ASSERT_TRUE(s.Copy(b.data(), c.dst, n).ok());
      ASSERT_TRUE(s.Synchronize(copy_test::Soon()).ok());
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), n));
    }
  }
};

TEST_F(CopySubmitCost, ManyAllocationsAgainstOne) {
  auto s = NewStream();
  ASSERT_NE(s, nullptr);
  std::vector<Buffer> dst_many, src_many, dst_one, src_one;
  for (int r = 0; r < kRegions; ++r) {
    dst_many.push_back(Alloc(MemoryKind::kDevice, kRegionBytes));
    src_many.push_back(Alloc(MemoryKind::kDevice, kRegionBytes));
    ASSERT_TRUE(s->Fill(src_many.back().data(), static_cast<uint8_t>(r + 1), kRegionBytes).ok());
  }
  dst_one.push_back(Alloc(MemoryKind::kDevice, kRegionBytes * kRegions));
  src_one.push_back(Alloc(MemoryKind::kDevice, kRegionBytes * kRegions));
  ASSERT_TRUE(s->Fill(src_one[0].data(), 0x3C, kRegionBytes * kRegions).ok());
  // Times both batches, checks their bytes and prints them beside each other.
  auto compare = [&](const std::vector<CopyDesc>& many, const std::vector<CopyDesc>& one,
                     const char* what) {
    const double many_us = SubmitUs(*s, many);
    const double one_us = SubmitUs(*s, one);
    ExpectCopied(*s, many);
    ExpectCopied(*s, one);
    std::printf(
        "copy submit, %s: 32+32 allocations %.1f us, 1+1 allocation %.1f us (median of 200, "
        "host clock, CopyBatch + Record)\n",
        what, many_us, one_us);
    EXPECT_GT(many_us, 0);
    EXPECT_GT(one_us, 0);
  };
  compare(Descs(dst_many, src_many, false), Descs(dst_one, src_one, false),
          "64 descriptors of 512 KiB");
  compare(Descs(dst_many, src_many, true), Descs(dst_one, src_one, true),
          "64 descriptors of 16 rows of 32 KiB");
  compare(Scattered(dst_many, src_many), Scattered(dst_one, src_one),
          "4096 descriptors of 32 KiB, the allocations in turn");
}

}  // namespace
}  // namespace kvferry

#include "model/coalesce.h"

#include <gtest/gtest.h>

#include <random>
#include <set>
#include <utility>
#include <vector>

namespace kvferry {
namespace {

StridedRun Linear(int32_t region, int64_t offset, int64_t bytes) {
  return StridedRun{.src_region = region,
                    .src_offset = offset,
                    .dst_region = region,
                    .dst_offset = offset,
                    .bytes = bytes};
}

StridedRun Rows(int64_t src, int64_t dst, int64_t bytes, int64_t rows = 1, int64_t sp = 0,
                int64_t dp = 0) {
  return StridedRun{.src_offset = src,
                    .src_pitch = sp,
                    .dst_offset = dst,
                    .dst_pitch = dp,
                    .bytes = bytes,
                    .rows = rows};
}

// The (source, destination) byte pairs a run copies.
std::set<std::pair<int64_t, int64_t>> Bytes(const StridedRun& r) {
  std::set<std::pair<int64_t, int64_t>> out;
  for (int64_t row = 0; row < r.rows; ++row) {
    for (int64_t b = 0; b < r.bytes; ++b) {
      out.insert({r.src_offset + row * r.src_pitch + b, r.dst_offset + row * r.dst_pitch + b});
    }
  }
  return out;
}

TEST(MergeRuns, TouchingRunsMerge) {
  StridedRun a = Linear(0, 100, 16);
  EXPECT_TRUE(MergeRuns(a, Linear(0, 116, 8), RunMerge::kLinear));
  EXPECT_EQ(a.src_offset, 100);
  EXPECT_EQ(a.bytes, 24);
  EXPECT_EQ(a.rows, 1);
}

TEST(MergeRuns, GapsStayApartWhenLinear) {
  StridedRun a = Linear(0, 100, 16);
  const StridedRun before = a;
  EXPECT_FALSE(MergeRuns(a, Linear(0, 117, 8), RunMerge::kLinear));  // one byte of gap
  EXPECT_FALSE(MergeRuns(a, Linear(0, 84, 16), RunMerge::kLinear));  // touching, but before
  EXPECT_FALSE(MergeRuns(a, Linear(1, 116, 8), RunMerge::kLinear));  // another region
  EXPECT_EQ(a.bytes, before.bytes);
  EXPECT_EQ(a.src_offset, before.src_offset);
}

TEST(MergeRuns, OverlappingRunsAreRefused) {
  StridedRun a = Linear(0, 100, 16);
  EXPECT_FALSE(MergeRuns(a, Linear(0, 108, 16), RunMerge::kLinear));
  EXPECT_FALSE(MergeRuns(a, Linear(0, 100, 16), RunMerge::kStrided));  // the same bytes again
  EXPECT_FALSE(MergeRuns(a, Linear(0, 108, 16), RunMerge::kStrided));  // rows 8 apart, 16 wide
  EXPECT_EQ(a.bytes, 16);
  EXPECT_EQ(a.rows, 1);
  // Side by side, rows that would grow into the next row.
  StridedRun r = Rows(0, 0, 8, 4, 12, 12);
  EXPECT_FALSE(MergeRuns(r, Rows(8, 8, 8, 4, 12, 12), RunMerge::kStrided));
  EXPECT_EQ(r.bytes, 8);
}

TEST(MergeRuns, EmptyRunsAreNotMerged) {
  StridedRun a = Linear(0, 100, 16);
  EXPECT_FALSE(MergeRuns(a, Linear(0, 116, 0), RunMerge::kLinear));
  StridedRun empty = Linear(0, 100, 0);
  EXPECT_FALSE(MergeRuns(empty, Linear(0, 100, 8), RunMerge::kStrided));
  EXPECT_EQ(a.bytes, 16);
}

TEST(MergeRuns, BothSidesMustTouch) {
  StridedRun a = Rows(0, 1000, 16);
  EXPECT_FALSE(MergeRuns(a, Rows(16, 1020, 16), RunMerge::kLinear));  // destination gap
  EXPECT_TRUE(MergeRuns(a, Rows(16, 1016, 16), RunMerge::kLinear));
  EXPECT_EQ(a.bytes, 32);
}

TEST(MergeRuns, StridedRowsStackAtOnePitch) {
  StridedRun a = Rows(0, 0, 8);
  ASSERT_TRUE(MergeRuns(a, Rows(32, 16, 8), RunMerge::kStrided));  // sets the pitches
  EXPECT_EQ(a.rows, 2);
  EXPECT_EQ(a.src_pitch, 32);
  EXPECT_EQ(a.dst_pitch, 16);
  ASSERT_TRUE(MergeRuns(a, Rows(64, 32, 8, 2, 32, 16), RunMerge::kStrided));  // a 2-row run
  EXPECT_EQ(a.rows, 4);
  EXPECT_FALSE(MergeRuns(a, Rows(160, 64, 8), RunMerge::kStrided));   // source pitch breaks
  EXPECT_FALSE(MergeRuns(a, Rows(128, 64, 16), RunMerge::kStrided));  // another width
  EXPECT_FALSE(MergeRuns(a, Rows(128, 64, 8, 2, 64, 16), RunMerge::kStrided));  // its pitch
  EXPECT_TRUE(MergeRuns(a, Rows(128, 64, 8), RunMerge::kStrided));
  EXPECT_EQ(a.rows, 5);
  // The same stack is refused when runs must stay linear.
  StridedRun b = Rows(0, 0, 8);
  EXPECT_FALSE(MergeRuns(b, Rows(32, 16, 8), RunMerge::kLinear));
  // Backwards steps never make rows.
  StridedRun c = Rows(64, 64, 8);
  EXPECT_FALSE(MergeRuns(c, Rows(32, 96, 8), RunMerge::kStrided));
}

TEST(MergeRuns, SideBySideRowsWiden) {
  StridedRun a = Rows(0, 0, 8, 4, 64, 32);
  ASSERT_TRUE(MergeRuns(a, Rows(8, 8, 8, 4, 64, 32), RunMerge::kStrided));
  EXPECT_EQ(a.bytes, 16);
  EXPECT_EQ(a.rows, 4);
  EXPECT_FALSE(MergeRuns(a, Rows(16, 16, 8, 4, 64, 16), RunMerge::kStrided));  // pitch differs
}

// Whatever merges covers exactly the bytes of both runs.
TEST(MergeRuns, AMergedRunCopiesExactlyBothRuns) {
  std::mt19937 rng(11);
  int merged = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    auto pick = [&] {
      const int64_t rows = 1 + rng() % 3;
      return Rows(rng() % 40, rng() % 40, 1 + rng() % 8, rows, rows > 1 ? 1 + rng() % 16 : 0,
                  rows > 1 ? 1 + rng() % 16 : 0);
    };
    // The second run is random, or placed beside or after the first, sometimes off by a byte.
    const StridedRun x = pick();
    StridedRun y = pick();
    const int64_t nudge[] = {-1, 0, 0, 0, 1};
    if (trial % 3 == 1) {
      y.rows = x.rows;
      y.src_pitch = x.src_pitch;
      y.dst_pitch = x.dst_pitch;
      y.src_offset = x.src_offset + x.bytes + nudge[rng() % 5];
      y.dst_offset = x.dst_offset + x.bytes + nudge[rng() % 5];
    } else if (trial % 3 == 2) {
      y.bytes = x.bytes;
      const int64_t sp = x.rows > 1 ? x.src_pitch : 1 + rng() % 16;
      const int64_t dp = x.rows > 1 ? x.dst_pitch : 1 + rng() % 16;
      y.src_offset = x.src_offset + x.rows * sp + nudge[rng() % 5];
      y.dst_offset = x.dst_offset + x.rows * dp + nudge[rng() % 5];
      if (y.rows > 1) {
        y.src_pitch = sp;
        y.dst_pitch = dp;
      }
    }
    auto want = Bytes(x);
    const auto by = Bytes(y);
    // Only runs whose rows each copy distinct bytes, disjoint from each other, are fair input.
    if (static_cast<int64_t>(want.size()) != x.bytes * x.rows ||
        static_cast<int64_t>(by.size()) != y.bytes * y.rows) {
      continue;
    }
    want.insert(by.begin(), by.end());
    StridedRun m = x;
    for (RunMerge how : {RunMerge::kLinear, RunMerge::kStrided}) {
      m = x;
      if (!MergeRuns(m, y, how)) continue;
      ++merged;
      ASSERT_EQ(static_cast<int64_t>(want.size()), x.bytes * x.rows + y.bytes * y.rows);
      EXPECT_EQ(Bytes(m), want) << "trial " << trial;
      EXPECT_EQ(m.bytes * m.rows, x.bytes * x.rows + y.bytes * y.rows);
    }
  }
  EXPECT_GT(merged, 300);
}

TEST(FoldContiguous, NoAxesKeepTheRun) {
  const ContiguousRun r = FoldContiguous({}, 0, 256);
  EXPECT_EQ(r.bytes, 256);
  EXPECT_EQ(r.axes, 0u);
}

TEST(FoldContiguous, FoldsAxesContiguousOnBothSidesInAnyOrder) {
  // (token 4 : 128B, head 8 : 512B, layer 3 : 4096B) on the source; the destination puts heads
  // outside tokens of another block (stride 1024), so only tokens fold on both.
  const CopyAxis axes[] = {{3, 4096, 8192}, {8, 512, 1024}, {4, 128, 128}};
  const ContiguousRun r = FoldContiguous(axes, 0b111, 128);
  EXPECT_EQ(r.bytes, 512);
  EXPECT_EQ(r.axes, 0b100u);
  // Same strides on both sides: everything folds, whatever the axis order.
  const CopyAxis same[] = {{3, 4096, 4096}, {8, 512, 512}, {4, 128, 128}};
  EXPECT_EQ(FoldContiguous(same, 0b111, 128).bytes, 128 * 4 * 8 * 3);
  EXPECT_EQ(FoldContiguous(same, 0b111, 128).axes, 0b111u);
}

TEST(FoldContiguous, IneligibleAndSingleAxesAreSkipped) {
  const CopyAxis axes[] = {{4, 128, 128}, {1, 512, 512}, {2, 512, 512}};
  EXPECT_EQ(FoldContiguous(axes, 0b110, 128).bytes, 128);  // the token axis is not eligible
  const ContiguousRun r = FoldContiguous(axes, 0b111, 128);
  EXPECT_EQ(r.bytes, 1024);
  EXPECT_EQ(r.axes, 0b101u);  // n == 1 adds nothing and is not folded
}

TEST(FoldContiguous, AGapStopsTheRun) {
  const CopyAxis axes[] = {{4, 256, 256}};  // rows of 128 bytes every 256: a gap
  EXPECT_EQ(FoldContiguous(axes, 1, 128).bytes, 128);
  EXPECT_EQ(FoldContiguous(axes, 1, 128).axes, 0u);
}

TEST(ChainRows, ChainsAxesOfUniformPitch) {
  // Heads every 1 KiB, tokens-of-next-layer 8 heads later: one chain of 16 rows; a third axis at
  // another pitch stays out.
  const CopyAxis axes[] = {{8, 1024, 256}, {2, 8192, 2048}, {3, 100000, 7000}};
  const RowChain c = ChainRows(axes, 0b111, 0);
  EXPECT_EQ(c.rows, 16);
  EXPECT_EQ(c.src_pitch, 1024);
  EXPECT_EQ(c.dst_pitch, 256);
  EXPECT_EQ(c.axes, 0b011u);
  // Started at the outer axis, nothing steps over it.
  const RowChain d = ChainRows(axes, 0b111, 1);
  EXPECT_EQ(d.rows, 2);
  EXPECT_EQ(d.axes, 0b010u);
  // Not eligible: left out even when the pitch fits.
  EXPECT_EQ(ChainRows(axes, 0b001, 0).rows, 8);
}

}  // namespace
}  // namespace kvferry

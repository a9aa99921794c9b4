#include "tiering/copy_plan.h"

#include <gtest/gtest.h>

#include <random>

#include "testing/tiering_test_util.h"
#include "tiering/priority_lru.h"

namespace kvferry::tiering {
namespace {

using testing::MakePool;

struct Views {
  explicit Views(const BlockPool& p) {
    for (int32_t r = 0; r < p.num_regions(); ++r) ptrs.push_back(p.region(r));
    view = TierView{&p.layout(), ptrs};
  }
  std::vector<std::byte*> ptrs;
  TierView view;
};

TEST(CopyPlan, BlockMajorRunOfWholeBlocksIsOneDescriptor) {
  auto dev = OpenCpuDevice();
  auto a = MakePool(*dev, LayoutKind::kBlockMajor, MemoryKind::kDevice, 8);
  auto b = MakePool(*dev, LayoutKind::kBlockMajor, MemoryKind::kHost, 8);
  Views va(a), vb(b);
  std::vector<CopyDesc> out;
  EXPECT_EQ(AppendRunCopies(va.view, 2, vb.view, 5, 3, 4, out), 1u);
  EXPECT_EQ(out[0].bytes, static_cast<size_t>(3 * a.layout().block_bytes()));
  EXPECT_EQ(out[0].src, a.region(0) + 2 * a.layout().block_bytes());
  EXPECT_EQ(out[0].dst, b.region(0) + 5 * b.layout().block_bytes());
}

TEST(CopyPlan, BlockMajorPartialIsOneTwoDimensionalDescriptor) {
  auto dev = OpenCpuDevice();
  auto a = MakePool(*dev, LayoutKind::kBlockMajor, MemoryKind::kDevice, 8);
  auto b = MakePool(*dev, LayoutKind::kBlockMajor, MemoryKind::kHost, 8);
  Views va(a), vb(b);
  std::vector<CopyDesc> out;
  EXPECT_EQ(AppendRunCopies(va.view, 0, vb.view, 0, 2, 3, out), 1u);
  // Rows: blocks x layers x kv x heads, each 3 tokens x 8 dims x 2 bytes, pitch 4 tokens.
  EXPECT_EQ(out[0].rows, 2u * 3 * 2 * 2);
  EXPECT_EQ(out[0].bytes, 3u * 8 * 2);
  EXPECT_EQ(out[0].src_pitch, 4u * 8 * 2);
}

TEST(CopyPlan, PerLayerIsOneDescriptorPerLayer) {
  auto dev = OpenCpuDevice();
  auto a = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, 8);
  auto b = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kHost, 6);
  Views va(a), vb(b);
  std::vector<CopyDesc> out;
  EXPECT_EQ(AppendRunCopies(va.view, 1, vb.view, 2, 3, 4, out), 3u);  // 3 layers
  EXPECT_EQ(out[0].rows, 2u);                                         // K and V
  EXPECT_EQ(out[0].bytes, 3u * 4 * 2 * 8 * 2);  // 3 blocks x tokens x heads x dim x 2 B
  out.clear();
  // Partial: a run per (layer, kv), rows over the blocks.
  EXPECT_EQ(AppendRunCopies(va.view, 1, vb.view, 2, 3, 2, out), 6u);
  EXPECT_EQ(out[0].rows, 3u);
}

TEST(CopyPlan, PackedLayoutKeepsTheInBlockOrder) {
  auto dev = OpenCpuDevice();
  auto a = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, 8);
  auto packed = PackedLayoutLike(a.layout(), 4);
  ASSERT_TRUE(packed.ok());
  EXPECT_TRUE(packed->block_contiguous());
  EXPECT_EQ(packed->block_bytes(), a.layout().block_bytes());
  Views va(a);
  Buffer buf = std::move(dev->Allocate(MemoryKind::kPinnedHost, packed->total_bytes())).value();
  std::byte* reg[1] = {buf.data()};
  TierView vp{&*packed, reg};
  std::vector<CopyDesc> out;
  // One run of (tokens x heads x dim) per (layer, kv) of a per-layer block: layers x 1 descriptor
  // with K and V as rows.
  EXPECT_EQ(AppendRunCopies(va.view, 3, vp, 0, 1, 4, out), 3u);
  EXPECT_EQ(out[0].rows, 2u);
}

// Random runs between random layouts and dtypes, executed with plain memcpy, against the
// element-by-element reference.
TEST(CopyPlan, RandomRunsMatchTheReference) {
  auto dev = OpenCpuDevice();
  std::mt19937 rng(7);
  const LayoutKind kinds[] = {LayoutKind::kBlockMajor, LayoutKind::kPerLayer};
  const DType dtypes[] = {DType::kInt8, DType::kBf16, DType::kFp32};
  for (int iter = 0; iter < 60; ++iter) {
    const DType dt = dtypes[rng() % 3];
    auto a = MakePool(*dev, kinds[rng() % 2], MemoryKind::kDevice, 7, dt);
    auto b = MakePool(*dev, kinds[rng() % 2], MemoryKind::kHost, 6, dt);
    testing::FillAll(a, 1);
    testing::FillAll(b, 50);
    const int64_t count = 1 + rng() % 4;
    const int64_t sb = rng() % (7 - count + 1), db = rng() % (6 - count + 1);
    const int64_t tokens = 1 + rng() % 4;
    auto src = testing::Snapshot(a);
    auto want = testing::Snapshot(b);
    for (int64_t i = 0; i < count; ++i) {
      testing::ReferenceCopy(a, src, sb + i, b, want, db + i, tokens);
    }
    Views va(a), vb(b);
    std::vector<CopyDesc> out;
    AppendRunCopies(va.view, sb, vb.view, db, count, tokens, out);
    for (const CopyDesc& c : out) {
      for (size_t r = 0; r < c.rows; ++r) {
        std::memcpy(static_cast<std::byte*>(c.dst) + r * c.dst_pitch,
                    static_cast<const std::byte*>(c.src) + r * c.src_pitch, c.bytes);
      }
    }
    ASSERT_EQ(testing::Snapshot(b), want)
        << "iter " << iter << ": " << a.layout().ToString() << " -> " << b.layout().ToString()
        << " blocks " << sb << "->" << db << " x" << count << " tokens " << tokens;
  }
}

TEST(PriorityLru, LowestPriorityFirstThenOldest) {
  PriorityLru lru(8);
  lru.Push(3, 50);
  lru.Push(1, 10);
  lru.Push(5, 50);
  lru.Push(2, 10);
  lru.Push(7, 100);
  EXPECT_EQ(lru.size(), 5);
  lru.Remove(1);
  EXPECT_FALSE(lru.Contains(1));
  EXPECT_EQ(lru.PopVictim(), 2);
  EXPECT_EQ(lru.PopVictim(), 3);
  lru.Push(3, 50);  // re-queued: now the newest of 50
  EXPECT_EQ(lru.PopVictim(), 5);
  EXPECT_EQ(lru.PopVictim(), 3);
  EXPECT_EQ(lru.PopVictim(), 7);
  EXPECT_EQ(lru.PopVictim(), -1);
  EXPECT_EQ(lru.size(), 0);
}

}  // namespace
}  // namespace kvferry::tiering

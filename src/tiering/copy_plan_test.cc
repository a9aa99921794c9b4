#include "tiering/copy_plan.h"

#include <gtest/gtest.h>

#include "tiering/tiering_test_util.h"

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

}  // namespace
}  // namespace kvferry::tiering

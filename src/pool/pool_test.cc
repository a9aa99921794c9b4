#include "kvferry/pool.h"

#include <gtest/gtest.h>

namespace kvferry {
namespace {

PoolSpec Spec(LayoutKind layout) {
  PoolSpec s;
  s.shape = KvShape{8, 4, 16, DType::kFp16, 2, 8};
  s.parallel = ParallelConfig{2, 2, {}, 1, 0};
  s.rank = 3;
  s.layout = layout;
  s.memory = MemoryKind::kHost;
  s.blocks = 6;
  return s;
}

TEST(BlockPool, AllocatesRegionsForEachPreset) {
  auto dev = OpenCpuDevice();
  auto bm = BlockPool::Create(*dev, Spec(LayoutKind::kBlockMajor));
  ASSERT_TRUE(bm.ok()) << bm.status().ToString();
  EXPECT_EQ(bm->num_regions(), 1);
  EXPECT_EQ(bm->slice().layer_begin, 4);
  EXPECT_EQ(bm->slice().head_begin, 2);
  EXPECT_EQ(bm->layout().block_bytes(), 4 * 2 * 2 * 8 * 16 * 2);
  auto pl = BlockPool::Create(*dev, Spec(LayoutKind::kPerLayer));
  ASSERT_TRUE(pl.ok());
  EXPECT_EQ(pl->num_regions(), 4);
  EXPECT_EQ(pl->layout().total_bytes(), bm->layout().total_bytes());
}

TEST(BlockPool, RejectsBadSpecs) {
  auto dev = OpenCpuDevice();
  PoolSpec s = Spec(LayoutKind::kBlockMajor);
  s.rank = 4;
  EXPECT_NE(BlockPool::Create(*dev, s).status().message().find("rank=4"), std::string_view::npos);
  s = Spec(LayoutKind::kBlockMajor);
  s.blocks = 0;
  EXPECT_NE(BlockPool::Create(*dev, s).status().message().find("blocks=0"), std::string_view::npos);
  s = Spec(LayoutKind::kBlockMajor);
  s.memory = MemoryKind::kFile;
  EXPECT_FALSE(BlockPool::Create(*dev, s).ok());
}

TEST(BlockPool, BlockExtentsCoalesceNeighbours) {
  auto dev = OpenCpuDevice();
  auto bm = BlockPool::Create(*dev, Spec(LayoutKind::kBlockMajor));
  ASSERT_TRUE(bm.ok());
  std::vector<int64_t> ids{1, 2, 3, 5};
  auto e = bm->BlockExtents(ids);
  ASSERT_TRUE(e.ok());
  ASSERT_EQ(e->size(), 2u);
  EXPECT_EQ((*e)[0].bytes, 3 * bm->layout().block_bytes());
  std::vector<int64_t> bad{9};
  EXPECT_NE(bm->BlockExtents(bad).status().message().find("block id 9"), std::string_view::npos);
  auto pl = BlockPool::Create(*dev, Spec(LayoutKind::kPerLayer));
  auto pe = pl->BlockExtents(ids);
  ASSERT_TRUE(pe.ok());
  // Order-preserving: per block, one extent per (layer, kv); blocks are never interleaved.
  EXPECT_EQ(pe->size(), 4u * 4 * 2);
}

}  // namespace
}  // namespace kvferry

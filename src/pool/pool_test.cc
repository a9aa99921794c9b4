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

// Per-block scales: [block][layer][kv][head] over the rank's own layers and heads, allocated with
// the pool or attached to a wrapped one; fp8 pools only.
TEST(BlockPool, PerBlockScalesAreAllocatedOrAttached) {
  auto dev = OpenCpuDevice();
  PoolSpec s = Spec(LayoutKind::kPerLayer);
  s.block_scales = true;
  auto fp16 = BlockPool::Create(*dev, s);
  ASSERT_FALSE(fp16.ok());
  EXPECT_EQ(fp16.status().message(),
            "pool: per-block scales are for an fp8 (e4m3) cache; this pool's dtype is fp16");
  s.shape.dtype = DType::kFp8E4M3;
  auto pool = BlockPool::Create(*dev, s);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ASSERT_NE(pool->block_scales(), nullptr);
  // Rank 3 of TP2 x PP2: 4 layers, 2 heads, K and V, 6 blocks.
  EXPECT_EQ(pool->block_scale_count(), 6 * 4 * 2 * 2);
  EXPECT_EQ(pool->BlockScaleIndex(0, 0, 0, 1), 1);
  EXPECT_EQ(pool->BlockScaleIndex(0, 0, 1, 0), 2);
  EXPECT_EQ(pool->BlockScaleIndex(0, 1, 0, 0), 4);
  EXPECT_EQ(pool->BlockScaleIndex(5, 3, 1, 1), 6 * 4 * 2 * 2 - 1);
  pool->block_scales()[pool->block_scale_count() - 1] = 2.0f;  // owned, writable
  const auto region = [](void* base, int64_t bytes, MemoryKind kind) {
    ExternalRegion r;
    r.base = base;
    r.bytes = bytes;
    r.memory = kind;
    return r;
  };
  EXPECT_FALSE(
      pool->AttachBlockScales(region(pool->block_scales(), 1 << 20, MemoryKind::kHost)).ok())
      << "has them";

  s.block_scales = false;
  auto plain = BlockPool::Create(*dev, s);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->block_scales(), nullptr);
  std::vector<float> engine(static_cast<size_t>(plain->block_scale_count()));
  const int64_t bytes = plain->block_scale_count() * 4;
  auto st = plain->AttachBlockScales(region(engine.data(), bytes - 4, MemoryKind::kHost));
  EXPECT_EQ(st.message(),
            "pool: per-block scales of 380 bytes; the pool takes 384 (6 blocks x 4 layers x 2 kv x "
            "2 heads, fp32)");
  st = plain->AttachBlockScales(region(engine.data(), bytes, MemoryKind::kPinnedHost));
  EXPECT_NE(st.message().find("are pinned-host memory"), std::string_view::npos) << st.ToString();
  ASSERT_TRUE(plain->AttachBlockScales(region(engine.data(), bytes, MemoryKind::kHost)).ok());
  EXPECT_EQ(plain->block_scales(), engine.data());
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

#include "testing/testdata.h"

#include <gtest/gtest.h>

#include <cstring>

namespace kvferry {
namespace {

BlockPool MakePool(Device& dev, DType dtype, LayoutKind layout, ParallelConfig p, int rank) {
  PoolSpec s;
  s.shape = KvShape{6, 4, 8, dtype, 2, 4};
  s.parallel = p;
  s.rank = rank;
  s.layout = layout;
  s.memory = MemoryKind::kHost;
  s.blocks = 3;
  return std::move(BlockPool::Create(dev, s)).value();
}

TEST(TestData, FillThenCheckEveryDtypeAndLayout) {
  auto dev = OpenCpuDevice();
  for (DType dt : {DType::kFp32, DType::kFp16, DType::kBf16, DType::kFp8E4M3, DType::kInt8}) {
    for (LayoutKind lk : {LayoutKind::kBlockMajor, LayoutKind::kPerLayer}) {
      BlockPool pool = MakePool(*dev, dt, lk, ParallelConfig{2, 1, {}, 1, 0}, 1);
      BlockTokens where{1, 8, 4};
      ASSERT_TRUE(FillBlock(pool, 77, where).ok());
      auto m = CheckBlock(pool, 77, where);
      ASSERT_TRUE(m.ok());
      EXPECT_FALSE(m->has_value()) << (*m)->ToString();
      auto other = CheckBlock(pool, 78, where);  // another request's values differ
      ASSERT_TRUE(other.ok());
      EXPECT_TRUE(other->has_value());
    }
  }
}

TEST(TestData, ValuesDependOnGlobalCoordinatesOnly) {
  // The same global element held by two differently split ranks has the same bytes.
  auto dev = OpenCpuDevice();
  BlockPool whole =
      MakePool(*dev, DType::kBf16, LayoutKind::kBlockMajor, ParallelConfig{1, 1, {}, 1, 0}, 0);
  BlockPool part =
      MakePool(*dev, DType::kBf16, LayoutKind::kPerLayer, ParallelConfig{2, 2, {}, 1, 0}, 3);
  ASSERT_TRUE(FillBlock(whole, 5, {0, 0, 4}).ok());
  ASSERT_TRUE(FillBlock(part, 5, {2, 0, 4}).ok());
  // part holds global layers 3..5, heads 2..3. Compare layer 4, kv 1, head 3, token 2.
  const RankSlice& s = part.slice();
  int64_t lw = 4, hw = 3, ll = lw - s.layer_begin, hl = hw - s.head_begin;
  auto* a = whole.region(0) + whole.layout().ByteOffset(0, lw, 1, hw, 2, 0);
  auto* b =
      part.region(part.layout().RegionOf(ll, 1)) + part.layout().ByteOffset(2, ll, 1, hl, 2, 0);
  EXPECT_EQ(std::memcmp(a, b, 8 * 2), 0);
}

TEST(TestData, FindsACorruptedElementAndNamesIt) {
  auto dev = OpenCpuDevice();
  BlockPool pool =
      MakePool(*dev, DType::kFp16, LayoutKind::kBlockMajor, ParallelConfig{1, 1, {}, 1, 0}, 0);
  ASSERT_TRUE(FillBlock(pool, 1, {2, 0, 4}).ok());
  pool.region(0)[pool.layout().ByteOffset(2, 3, 1, 2, 1, 5)] ^= std::byte{1};
  auto m = CheckBlock(pool, 1, {2, 0, 4});
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(m->has_value());
  EXPECT_EQ((*m)->at.layer, 3);
  EXPECT_EQ((*m)->at.kv, 1);
  EXPECT_EQ((*m)->at.head, 2);
  EXPECT_EQ((*m)->at.token, 1);
  EXPECT_EQ((*m)->at.dim, 5);
  // Tokens past valid_tokens are not checked: a prompt ending mid-block.
  pool.region(0)[pool.layout().ByteOffset(2, 3, 1, 2, 1, 5)] ^= std::byte{1};
  pool.region(0)[pool.layout().ByteOffset(2, 0, 0, 0, 3, 0)] ^= std::byte{1};
  auto m2 = CheckBlock(pool, 1, {2, 0, 3});
  ASSERT_TRUE(m2.ok());
  EXPECT_FALSE(m2->has_value());
  EXPECT_FALSE(CheckBlock(pool, 1, {3, 0, 4}).ok());
  EXPECT_FALSE(FillBlock(pool, 1, {0, 0, 5}).ok());
}

}  // namespace
}  // namespace kvferry

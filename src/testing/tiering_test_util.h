// Helpers shared by the tiering tests: small pools and a CPU reference of partial copies.
#pragma once

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "kvferry/pool.h"
#include "testing/memory_slab_store.h"
#include "testing/testdata.h"

namespace kvferry::tiering::testing {

// A store whose reads and writes hang while it is closed (a stuck disk).
class GatedSlabStore final : public SlabStoreWrapper {
 public:
  using SlabStoreWrapper::SlabStoreWrapper;
  void Close() {
    std::lock_guard l(mu_);
    open_ = false;
  }
  void Open() {
    {
      std::lock_guard l(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  std::vector<Status> Write(std::span<const SlotWrite> w) override {
    Pass();
    return SlabStoreWrapper::Write(w);
  }
  std::vector<Status> Read(std::span<const SlotRead> r) override {
    Pass();
    return SlabStoreWrapper::Read(r);
  }

 private:
  void Pass() {
    std::unique_lock l(mu_);
    cv_.wait(l, [&] { return open_; });
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
};

inline KvShape SmallShape(DType dtype = DType::kBf16) {
  return KvShape{/*layers=*/3,          /*kv_heads=*/2, /*head_dim=*/8, dtype,
                 /*kv_factor=*/2,
                 /*tokens_per_block=*/4};
}

inline BlockPool MakePool(Device& dev, LayoutKind layout, MemoryKind memory, int64_t blocks,
                          DType dtype = DType::kBf16) {
  PoolSpec s;
  s.shape = SmallShape(dtype);
  s.layout = layout;
  s.memory = memory;
  s.blocks = blocks;
  auto p = BlockPool::Create(dev, s);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(p).value();
}

// Fills every block of a pool; block b gets request `request + b`.
inline void FillAll(const BlockPool& pool, uint64_t request) {
  const int64_t tpb = pool.shape().tokens_per_block;
  for (int64_t b = 0; b < pool.blocks(); ++b) {
    ASSERT_TRUE(FillBlock(pool, request + b, BlockTokens{b, 0, tpb}).ok());
  }
}

// All bytes of a pool, region after region.
inline std::vector<std::byte> Snapshot(const BlockPool& pool) {
  std::vector<std::byte> out;
  for (int32_t r = 0; r < pool.num_regions(); ++r) {
    const std::byte* p = pool.region(r);
    out.insert(out.end(), p, p + pool.layout().region_bytes());
  }
  return out;
}

// The CPU reference: copies tokens [0, tokens) of every plane element by element, on snapshots.
inline void ReferenceCopy(const BlockPool& src, const std::vector<std::byte>& src_bytes,
                          int64_t src_block, const BlockPool& dst,
                          std::vector<std::byte>& dst_bytes, int64_t dst_block, int64_t tokens) {
  const PoolLayout& sl = src.layout();
  const PoolLayout& dl = dst.layout();
  const PoolDims& d = sl.dims();
  const int64_t eb = sl.element_bytes();
  for (int64_t l = 0; l < d[kLayerAxis]; ++l)
    for (int64_t kv = 0; kv < d[kKvAxis]; ++kv)
      for (int64_t h = 0; h < d[kHeadAxis]; ++h)
        for (int64_t t = 0; t < tokens; ++t)
          for (int64_t x = 0; x < d[kDimAxis]; ++x) {
            int64_t so =
                sl.RegionOf(l, kv) * sl.region_bytes() + sl.ByteOffset(src_block, l, kv, h, t, x);
            int64_t dof =
                dl.RegionOf(l, kv) * dl.region_bytes() + dl.ByteOffset(dst_block, l, kv, h, t, x);
            std::memcpy(&dst_bytes[dof], &src_bytes[so], eb);
          }
}

inline void ExpectBlockHolds(const BlockPool& pool, int64_t block, uint64_t request,
                             int64_t tokens = -1) {
  if (tokens < 0) tokens = pool.shape().tokens_per_block;
  auto r = CheckBlock(pool, request, BlockTokens{block, 0, tokens});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->has_value()) << "block " << block << ": " << (*r)->ToString();
}

}  // namespace kvferry::tiering::testing

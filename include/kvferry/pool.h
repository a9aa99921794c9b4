// BlockPool: one rank's KV blocks in memory of one kind, laid out by a PoolLayout.
//
// A pool owns one allocation per layout region (one for block-major, one per layer for per-layer
// pools). Block ids are 0..blocks-1. Views of a block's (layer, kv, head, token) ranges are byte
// extents, coalesced, which copy engines, transports and file tiers consume directly.
// Thread-safety: const methods are thread-safe; the bytes themselves are the caller's to order.
#pragma once

#include <cstdint>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/kv_model.h"

namespace kvferry {

struct PoolSpec {
  KvShape shape;
  ParallelConfig parallel;
  int32_t rank = 0;
  LayoutKind layout = LayoutKind::kBlockMajor;
  MemoryKind memory = MemoryKind::kDevice;
  int64_t blocks = 0;
};

class BlockPool {
 public:
  // Validates the spec (shape, parallel config, rank, block count) and allocates the regions.
  static StatusOr<BlockPool> Create(Device& device, const PoolSpec& spec);

  BlockPool(BlockPool&&) noexcept = default;
  BlockPool& operator=(BlockPool&&) noexcept = default;

  const PoolSpec& spec() const { return spec_; }
  const KvShape& shape() const { return spec_.shape; }
  const RankSlice& slice() const { return slice_; }
  const PoolLayout& layout() const { return layout_; }
  MemoryKind memory() const { return spec_.memory; }
  int64_t blocks() const { return spec_.blocks; }
  int32_t num_regions() const { return static_cast<int32_t>(regions_.size()); }
  std::byte* region(int32_t i) const { return regions_[i].data(); }

  std::byte* Address(const Extent& e) const { return regions_[e.region].data() + e.offset; }
  // Byte extents of a box in local coordinates; errors name the offending range or block id.
  StatusOr<std::vector<Extent>> Extents(const BlockBox& box) const;
  // Extents of whole blocks, in the order given; an extent merges with the one before it when
  // they touch (consecutive blocks of a block-major pool become one extent).
  StatusOr<std::vector<Extent>> BlockExtents(std::span<const int64_t> blocks) const;

 private:
  BlockPool(PoolSpec spec, RankSlice slice, PoolLayout layout, std::vector<Buffer> regions)
      : spec_(std::move(spec)),
        slice_(slice),
        layout_(std::move(layout)),
        regions_(std::move(regions)) {}

  PoolSpec spec_;
  RankSlice slice_;
  PoolLayout layout_;
  std::vector<Buffer> regions_;
};

}  // namespace kvferry

// BlockPool: one rank's KV blocks in memory of one kind, laid out by a PoolLayout.
//
// A pool either owns one allocation per layout region (Create: one for block-major, one per layer
// for per-layer pools), or wraps memory an inference engine already owns (Wrap: vLLM's, SGLang's
// or FlashInfer's per-layer K/V tensors, TensorRT-LLM's block pool), which it never frees; every
// consumer (planner, transceiver, tiering, transports) sees the two alike, through region(i),
// region_info(i), Address() and the extents below. Block ids are 0..blocks-1. Views of a block's
// (layer, kv, head, token) ranges are byte extents, coalesced, which copy engines, transports and
// file tiers consume directly. Thread-safety: const methods are thread-safe; the bytes themselves
// are the caller's to order.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/kv_model.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

struct PoolSpec {
  KvShape shape;
  ParallelConfig parallel;
  int32_t rank = 0;
  LayoutKind layout = LayoutKind::kBlockMajor;
  MemoryKind memory = MemoryKind::kDevice;
  int64_t blocks = 0;
  // Per-block KV scales (ScaleGranularity::kBlock, an fp8 pool): Create allocates them beside the
  // blocks, in the pool's memory kind (BlockPool::block_scales); a wrapped pool takes the engine's
  // (AttachBlockScales).
  bool block_scales = false;
};

// One region of memory an engine owns (a tensor's data_ptr and size), for BlockPool::Wrap.
struct ExternalRegion {
  void* base = nullptr;
  int64_t bytes = 0;  // bytes usable from base (at least the layout's region_bytes())
  MemoryKind memory = MemoryKind::kDevice;
  int32_t device = 0;  // GPU ordinal for device memory (the CPU device is 0); ignored for host
  // The local layers and kv this region holds. Both empty ({0, 0}): the region's position in the
  // list decides (region r of the layout's split). Otherwise regions may come in any order.
  Range layers;
  Range kv;
};

// What BlockPool reports about each region (owned or wrapped).
struct PoolRegion {
  std::byte* base = nullptr;
  int64_t bytes = 0;  // usable bytes from base
  MemoryKind memory = MemoryKind::kDevice;
  int32_t device = 0;
  Range layers;  // local layers and kv held
  Range kv;
};

class BlockPool {
 public:
  // Validates the spec (shape, parallel config, rank, block count) and allocates the regions.
  static StatusOr<BlockPool> Create(Device& device, const PoolSpec& spec);
  // The same with explicit strides (PoolLayout::Custom): `layout` must have the dims of spec's
  // rank (RankPoolDims) and its element size; spec.layout is ignored (the pool's kind is
  // layout.kind()). Custom layouts transfer too: handles and FETCH messages carry their strides.
  static StatusOr<BlockPool> Create(Device& device, const PoolSpec& spec, const PoolLayout& layout);
  // Wraps engine-owned memory laid out as spec.layout (a named layout; the regions must match its
  // split: one, one per layer, or one per (layer, kv)). The pool never frees the memory, which
  // must outlive it. Validated before anything is touched, with errors naming the region and
  // values: region count, null base, a base not aligned to the element size, a region smaller
  // than its layout needs (largest element offset + one element), regions that overlap, a memory
  // kind other than spec.memory, a device ordinal other than `device`'s.
  static StatusOr<BlockPool> Wrap(Device& device, const PoolSpec& spec,
                                  std::span<const ExternalRegion> regions);
  // The same with explicit strides (e.g. PoolLayout::FromByteStrides from a tensor's strides);
  // `layout` must have the dims of spec's rank (RankPoolDims). spec.layout is ignored: the pool's
  // kind is layout.kind() (kCustom when the strides match no named layout; every rank of an
  // instance that transfers must then have the same strides).
  static StatusOr<BlockPool> Wrap(Device& device, const PoolSpec& spec, const PoolLayout& layout,
                                  std::span<const ExternalRegion> regions);

  BlockPool(BlockPool&&) noexcept = default;
  BlockPool& operator=(BlockPool&&) noexcept = default;

  const PoolSpec& spec() const { return spec_; }
  const KvShape& shape() const { return spec_.shape; }
  const RankSlice& slice() const { return slice_; }
  const PoolLayout& layout() const { return layout_; }
  MemoryKind memory() const { return spec_.memory; }
  int64_t blocks() const { return spec_.blocks; }
  int32_t num_regions() const { return static_cast<int32_t>(regions_.size()); }
  std::byte* region(int32_t i) const { return regions_[i].base; }
  // Base, usable size, memory kind, device and contents of region i (for registration).
  const PoolRegion& region_info(int32_t i) const { return regions_[i]; }
  int64_t region_size(int32_t i) const { return regions_[i].bytes; }
  MemoryKind region_memory(int32_t i) const { return regions_[i].memory; }
  // True when the memory belongs to the engine (Wrap), false when the pool allocated it.
  bool wrapped() const { return owned_.empty(); }

  std::byte* Address(const Extent& e) const { return regions_[e.region].base + e.offset; }
  // Byte extents of a box in local coordinates; errors name the offending range or block id.
  StatusOr<std::vector<Extent>> Extents(const BlockBox& box) const;
  // Extents of whole blocks, in the order given; an extent merges with the one before it when
  // they touch (consecutive blocks of a block-major pool become one extent).
  StatusOr<std::vector<Extent>> BlockExtents(std::span<const int64_t> blocks) const;

  // Per-block scales: fp32, one per (block, local layer, kv, local head), laid out
  // [block][layer][kv][head] over the rank's own layers and heads (BlockScaleIndex), so a block's
  // scales are contiguous and its heads' scales neighbours. A scale s says the block's stored fp8
  // values q of that layer, kv and head stand for q * s. Null when the pool has none. Written by
  // the engine as it quantizes, and by transfers into this pool (docs/conversion.md); their bytes
  // are the caller's to order, like the blocks'.
  float* block_scales() const { return scales_; }
  int64_t block_scale_count() const;
  int64_t BlockScaleIndex(int64_t block, int64_t local_layer, int64_t kv, int64_t local_head) const;
  // Gives a wrapped pool the engine's per-block scales: at least block_scale_count() floats of
  // the pool's memory kind and device, aligned to 4 bytes, never freed by the pool. Refused for a
  // pool that has them already (Create with spec.block_scales) and for a pool that is not fp8.
  Status AttachBlockScales(const ExternalRegion& scales);

 private:
  BlockPool(PoolSpec spec, RankSlice slice, PoolLayout layout, std::vector<PoolRegion> regions,
            std::vector<Buffer> owned)
      : spec_(std::move(spec)),
        slice_(slice),
        layout_(std::move(layout)),
        regions_(std::move(regions)),
        owned_(std::move(owned)) {}

  PoolSpec spec_;
  RankSlice slice_;
  PoolLayout layout_;
  std::vector<PoolRegion> regions_;
  std::vector<Buffer> owned_;  // empty for a wrapped pool
  float* scales_ = nullptr;    // per-block scales (block_scales), owned or attached
  std::vector<Buffer> owned_scales_;
};

}  // namespace kvferry
#pragma GCC visibility pop

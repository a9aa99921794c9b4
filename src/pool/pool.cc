#include "kvferry/pool.h"

#include <fmt/format.h>

namespace kvferry {

StatusOr<BlockPool> BlockPool::Create(Device& device, const PoolSpec& spec) {
  KVF_ASSIGN_OR_RETURN(RankSlice slice, SliceOf(spec.shape, spec.parallel, spec.rank));
  if (spec.blocks < 1) {
    return Status::InvalidArgument(fmt::format("pool: blocks={} must be at least 1", spec.blocks));
  }
  if (spec.memory == MemoryKind::kFile) {
    return Status::InvalidArgument("pool: a BlockPool lives in memory; file tiers are separate");
  }
  KVF_ASSIGN_OR_RETURN(PoolLayout layout,
                       PoolLayout::Make(spec.layout, RankPoolDims(spec.shape, slice, spec.blocks),
                                        spec.shape.ElementBytes()));
  std::vector<Buffer> regions;
  for (int32_t r = 0; r < layout.num_regions(); ++r) {
    auto buf = device.Allocate(spec.memory, static_cast<size_t>(layout.region_bytes()));
    if (!buf.ok())
      return buf.status().WithContext(fmt::format("pool region {} of {}", r, layout.num_regions()));
    regions.push_back(std::move(buf).value());
  }
  return BlockPool(spec, slice, std::move(layout), std::move(regions));
}

StatusOr<std::vector<Extent>> BlockPool::Extents(const BlockBox& box) const {
  KVF_RETURN_IF_ERROR(layout_.CheckBox(box));
  return layout_.Extents(box);
}

StatusOr<std::vector<Extent>> BlockPool::BlockExtents(std::span<const int64_t> blocks) const {
  std::vector<Extent> out;
  for (int64_t b : blocks) {
    BlockBox box = layout_.WholeBlock(b);
    KVF_RETURN_IF_ERROR(layout_.CheckBox(box));
    layout_.AppendExtents(box, out);
  }
  return out;
}

}  // namespace kvferry

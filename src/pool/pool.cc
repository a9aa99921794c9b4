#include "kvferry/pool.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <numeric>

namespace kvferry {
namespace {

Status CheckSpec(const PoolSpec& spec) {
  if (spec.blocks < 1) {
    return Status::InvalidArgument(fmt::format("pool: blocks={} must be at least 1", spec.blocks));
  }
  if (spec.memory == MemoryKind::kFile) {
    return Status::InvalidArgument("pool: a BlockPool lives in memory; file tiers are separate");
  }
  return Status::Ok();
}

// Per-block scales quantize an fp8 (e4m3) cache.
Status CheckScaledDtype(const PoolSpec& spec) {
  if (spec.shape.dtype == DType::kFp8E4M3) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("pool: per-block scales are for an fp8 (e4m3) cache; this pool's dtype is {}",
                  DTypeName(spec.shape.dtype)));
}

std::string RangeText(Range r) { return fmt::format("[{}, {})", r.begin, r.end); }

// Which of the layout's regions external region i is, from its declared ranges or its position.
StatusOr<int32_t> RegionSlot(const PoolLayout& layout, const ExternalRegion& r, int32_t i) {
  const bool positional = r.layers == Range{} && r.kv == Range{};
  if (positional) return i;
  for (int32_t slot = 0; slot < layout.num_regions(); ++slot) {
    if (layout.RegionLayers(slot) == r.layers && layout.RegionKv(slot) == r.kv) return slot;
  }
  return Status::InvalidArgument(fmt::format(
      "wrap: region {} holds layers {} kv {}, which is no region of layout {} (regions {}: "
      "region 0 holds layers {} kv {})",
      i, RangeText(r.layers), RangeText(r.kv), layout.ToString(), RegionSplitName(layout.split()),
      RangeText(layout.RegionLayers(0)), RangeText(layout.RegionKv(0))));
}

Status CheckRegion(const Device& device, const PoolSpec& spec, const PoolLayout& layout,
                   const ExternalRegion& r, int32_t i) {
  if (r.base == nullptr) {
    return Status::InvalidArgument(fmt::format("wrap: region {} has a null base pointer", i));
  }
  if (r.memory != spec.memory) {
    return Status::InvalidArgument(
        fmt::format("wrap: region {} is {} memory but the pool's spec says {}", i,
                    MemoryKindName(r.memory), MemoryKindName(spec.memory)));
  }
  if (r.memory == MemoryKind::kDevice && r.device != device.info().ordinal) {
    return Status::InvalidArgument(
        fmt::format("wrap: region {} is on device {} but the pool's device is {}:{} ({})", i,
                    r.device, device.info().platform, device.info().ordinal, device.info().name));
  }
  const auto addr = reinterpret_cast<uintptr_t>(r.base);
  const auto eb = static_cast<uintptr_t>(layout.element_bytes());
  if (addr % eb != 0) {
    return Status::InvalidArgument(
        fmt::format("wrap: region {} base {} is not aligned to the {}-byte element", i, r.base,
                    layout.element_bytes()));
  }
  if (r.bytes < layout.region_bytes()) {
    return Status::InvalidArgument(fmt::format(
        "wrap: region {} has {} bytes but layout {} needs {} (largest element offset {} + one "
        "{}-byte element)",
        i, r.bytes, layout.ToString(), layout.region_bytes(),
        layout.region_bytes() - layout.element_bytes(), layout.element_bytes()));
  }
  return Status::Ok();
}

// No two regions may share a byte of the spans their layout touches. `source` maps a region to
// its index in the caller's list (errors name that one).
Status CheckDisjoint(const std::vector<PoolRegion>& regions, const std::vector<int32_t>& source,
                     int64_t span) {
  std::vector<int32_t> order(regions.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return regions[a].base < regions[b].base; });
  for (size_t k = 1; k < order.size(); ++k) {
    const PoolRegion& lo = regions[order[k - 1]];
    const PoolRegion& hi = regions[order[k]];
    const auto lo_end = reinterpret_cast<uintptr_t>(lo.base) + static_cast<uintptr_t>(span);
    if (reinterpret_cast<uintptr_t>(hi.base) < lo_end) {
      int32_t a = source[order[k - 1]], b = source[order[k]];
      const PoolRegion* ra = &lo;
      const PoolRegion* rb = &hi;
      if (a > b) {
        std::swap(a, b);
        std::swap(ra, rb);
      }
      return Status::InvalidArgument(fmt::format(
          "wrap: regions {} [{}, +{}) and {} [{}, +{}) overlap (aliasing); interleaved views of "
          "one tensor are one region with a layer stride (e.g. block-major-nhd)",
          a, static_cast<const void*>(ra->base), span, b, static_cast<const void*>(rb->base),
          span));
    }
  }
  return Status::Ok();
}

}  // namespace

namespace {
// An explicit layout must have the rank's dims and the dtype's element size.
Status CheckLayoutFits(const PoolSpec& spec, const RankSlice& slice, const PoolLayout& layout,
                       std::string_view what) {
  const PoolDims want = RankPoolDims(spec.shape, slice, spec.blocks);
  if (layout.dims() != want) {
    return Status::InvalidArgument(
        fmt::format("{}: layout dims (blk,L,kv,h,t,d)=({}) differ from rank {}'s pool ({})", what,
                    fmt::join(layout.dims(), ","), spec.rank, fmt::join(want, ",")));
  }
  if (layout.element_bytes() != spec.shape.ElementBytes()) {
    return Status::InvalidArgument(fmt::format(
        "{}: layout elements are {} bytes but dtype {} has {}", what, layout.element_bytes(),
        DTypeName(spec.shape.dtype), spec.shape.ElementBytes()));
  }
  return Status::Ok();
}
}  // namespace

StatusOr<BlockPool> BlockPool::Create(Device& device, const PoolSpec& spec) {
  KVF_ASSIGN_OR_RETURN(RankSlice slice, SliceOf(spec.shape, spec.parallel, spec.rank));
  KVF_RETURN_IF_ERROR(CheckSpec(spec));
  KVF_ASSIGN_OR_RETURN(PoolLayout layout,
                       PoolLayout::Make(spec.layout, RankPoolDims(spec.shape, slice, spec.blocks),
                                        spec.shape.ElementBytes()));
  return Create(device, spec, layout);
}

StatusOr<BlockPool> BlockPool::Create(Device& device, const PoolSpec& spec,
                                      const PoolLayout& layout) {
  KVF_ASSIGN_OR_RETURN(RankSlice slice, SliceOf(spec.shape, spec.parallel, spec.rank));
  KVF_RETURN_IF_ERROR(CheckSpec(spec));
  KVF_RETURN_IF_ERROR(CheckLayoutFits(spec, slice, layout, "create"));
  std::vector<Buffer> owned;
  std::vector<PoolRegion> regions;
  for (int32_t r = 0; r < layout.num_regions(); ++r) {
    auto buf = device.Allocate(spec.memory, static_cast<size_t>(layout.region_bytes()));
    if (!buf.ok())
      return buf.status().WithContext(fmt::format("pool region {} of {}", r, layout.num_regions()));
    regions.push_back(PoolRegion{buf->data(), layout.region_bytes(), spec.memory,
                                 device.info().ordinal, layout.RegionLayers(r),
                                 layout.RegionKv(r)});
    owned.push_back(std::move(buf).value());
  }
  PoolSpec kept = spec;
  kept.layout = layout.kind();
  BlockPool pool(kept, slice, layout, std::move(regions), std::move(owned));
  if (spec.block_scales) {
    KVF_RETURN_IF_ERROR(CheckScaledDtype(spec));
    auto buf = device.Allocate(spec.memory, static_cast<size_t>(pool.block_scale_count()) * 4);
    if (!buf.ok()) return buf.status().WithContext("pool: per-block scales");
    pool.scales_ = reinterpret_cast<float*>(buf->data());
    pool.owned_scales_.push_back(std::move(buf).value());
  }
  return pool;
}

StatusOr<BlockPool> BlockPool::Wrap(Device& device, const PoolSpec& spec,
                                    std::span<const ExternalRegion> regions) {
  KVF_ASSIGN_OR_RETURN(RankSlice slice, SliceOf(spec.shape, spec.parallel, spec.rank));
  KVF_RETURN_IF_ERROR(CheckSpec(spec));
  if (spec.layout == LayoutKind::kCustom) {
    return Status::InvalidArgument(
        "wrap: a custom layout needs strides: pass a PoolLayout (PoolLayout::FromByteStrides)");
  }
  KVF_ASSIGN_OR_RETURN(PoolLayout layout,
                       PoolLayout::Make(spec.layout, RankPoolDims(spec.shape, slice, spec.blocks),
                                        spec.shape.ElementBytes()));
  return Wrap(device, spec, layout, regions);
}

StatusOr<BlockPool> BlockPool::Wrap(Device& device, const PoolSpec& spec, const PoolLayout& layout,
                                    std::span<const ExternalRegion> regions) {
  KVF_ASSIGN_OR_RETURN(RankSlice slice, SliceOf(spec.shape, spec.parallel, spec.rank));
  KVF_RETURN_IF_ERROR(CheckSpec(spec));
  KVF_RETURN_IF_ERROR(CheckLayoutFits(spec, slice, layout, "wrap"));
  if (static_cast<int64_t>(regions.size()) != layout.num_regions()) {
    return Status::InvalidArgument(
        fmt::format("wrap: {} regions given but layout {} has {} (regions {})", regions.size(),
                    layout.ToString(), layout.num_regions(), RegionSplitName(layout.split())));
  }
  std::vector<PoolRegion> placed(regions.size());
  std::vector<int32_t> source(regions.size(), -1);
  for (int32_t i = 0; i < static_cast<int32_t>(regions.size()); ++i) {
    const ExternalRegion& r = regions[i];
    KVF_RETURN_IF_ERROR(CheckRegion(device, spec, layout, r, i));
    KVF_ASSIGN_OR_RETURN(int32_t slot, RegionSlot(layout, r, i));
    if (source[slot] >= 0) {
      return Status::InvalidArgument(
          fmt::format("wrap: regions {} and {} both hold layers {} kv {}", source[slot], i,
                      RangeText(layout.RegionLayers(slot)), RangeText(layout.RegionKv(slot))));
    }
    source[slot] = i;
    placed[slot] = PoolRegion{static_cast<std::byte*>(r.base),
                              r.bytes,
                              r.memory,
                              r.memory == MemoryKind::kDevice ? r.device : 0,
                              layout.RegionLayers(slot),
                              layout.RegionKv(slot)};
  }
  KVF_RETURN_IF_ERROR(CheckDisjoint(placed, source, layout.region_bytes()));
  if (spec.block_scales) KVF_RETURN_IF_ERROR(CheckScaledDtype(spec));
  PoolSpec kept = spec;
  kept.layout = layout.kind();
  return BlockPool(std::move(kept), slice, layout, std::move(placed), {});
}

StatusOr<std::vector<Extent>> BlockPool::Extents(const BlockBox& box) const {
  KVF_RETURN_IF_ERROR(layout_.CheckBox(box));
  return layout_.Extents(box);
}

int64_t BlockPool::block_scale_count() const {
  return spec_.blocks * slice_.layer_count * spec_.shape.kv_factor * slice_.head_count;
}

int64_t BlockPool::BlockScaleIndex(int64_t block, int64_t local_layer, int64_t kv,
                                   int64_t local_head) const {
  return ((block * slice_.layer_count + local_layer) * spec_.shape.kv_factor + kv) *
             slice_.head_count +
         local_head;
}

Status BlockPool::AttachBlockScales(const ExternalRegion& scales) {
  if (scales_ != nullptr) return Status::InvalidArgument("pool: it has per-block scales already");
  KVF_RETURN_IF_ERROR(CheckScaledDtype(spec_));
  const int64_t need = block_scale_count() * 4;
  if (scales.base == nullptr || reinterpret_cast<uintptr_t>(scales.base) % 4 != 0) {
    return Status::InvalidArgument(fmt::format(
        "pool: per-block scales at {} are not 4-byte aligned fp32 values", scales.base));
  }
  if (scales.bytes < need) {
    return Status::InvalidArgument(fmt::format(
        "pool: per-block scales of {} bytes; the pool takes {} ({} blocks x {} layers x {} kv x "
        "{} heads, fp32)",
        scales.bytes, need, spec_.blocks, slice_.layer_count, spec_.shape.kv_factor,
        slice_.head_count));
  }
  if (scales.memory != spec_.memory || (scales.memory == MemoryKind::kDevice && !regions_.empty() &&
                                        scales.device != regions_.front().device)) {
    return Status::InvalidArgument(fmt::format(
        "pool: per-block scales are {} memory (device {}), the pool's blocks {} (device {})",
        MemoryKindName(scales.memory), scales.device, MemoryKindName(spec_.memory),
        regions_.empty() ? 0 : regions_.front().device));
  }
  scales_ = static_cast<float*>(scales.base);
  return Status::Ok();
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

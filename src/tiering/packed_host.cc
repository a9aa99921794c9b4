// PackedHostLayout and CreatePackedHostPool (include/kvferry/tiering.h): the host tier that lets
// the TransferManager stage a fragmented primary block through device memory and cross the link
// as one copy per block. The test is the one device staging applies (device_staging.cc): a block
// packed in the primary's own in-block order (PackedLayoutLike) must copy into one host block as
// one run.
#include <fmt/format.h>

#include "kvferry/tiering.h"
#include "tiering/copy_plan.h"

namespace kvferry {

StatusOr<LayoutKind> PackedHostLayout(const BlockPool& primary) {
  const PoolLayout& like = primary.layout();
  PoolDims dims = like.dims();
  dims[kBlockAxis] = 1;
  KVF_ASSIGN_OR_RETURN(PoolLayout packed, tiering::PackedLayoutLike(like, 1));
  std::byte* fake[1] = {nullptr};
  const tiering::TierView from{&packed, fake};
  std::vector<CopyDesc> probe;
  for (LayoutKind kind : {LayoutKind::kBlockMajor, LayoutKind::kBlockMajorNhd}) {
    KVF_ASSIGN_OR_RETURN(PoolLayout host, PoolLayout::Make(kind, dims, like.element_bytes()));
    std::vector<std::byte*> regions(static_cast<size_t>(host.num_regions()), nullptr);
    probe.clear();
    const size_t runs = tiering::AppendRunCopies(from, 0, tiering::TierView{&host, regions}, 0, 1,
                                                 dims[kTokenAxis], probe);
    if (runs == 1) return kind;
  }
  return Status::InvalidArgument(
      fmt::format("packed host layout: no named layout keeps the in-block order of a {} pool "
                  "(strides {}, {}, {}, {}, {}, {})",
                  LayoutKindName(like.kind()), like.strides()[0], like.strides()[1],
                  like.strides()[2], like.strides()[3], like.strides()[4], like.strides()[5]));
}

StatusOr<BlockPool> CreatePackedHostPool(Device& device, const BlockPool& primary, int64_t blocks) {
  if (blocks < 1) {
    return Status::InvalidArgument(
        fmt::format("packed host pool: blocks={} must be at least 1", blocks));
  }
  KVF_ASSIGN_OR_RETURN(LayoutKind kind, PackedHostLayout(primary));
  PoolSpec spec = primary.spec();
  spec.layout = kind;
  spec.memory = MemoryKind::kPinnedHost;
  spec.blocks = blocks;
  return BlockPool::Create(device, spec);
}

}  // namespace kvferry

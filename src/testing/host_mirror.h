// Helpers for code that fills or checks KV test data in pools a host thread may not touch (the
// primary pool lives in GPU memory on the CUDA device): a host "mirror" pool with the same spec,
// and whole-block / whole-pool copies between the two through a stream. Test, bench and demo
// paths only (they allocate and synchronize). Thread-compatible.
#pragma once

#include <span>

#include "kvferry/pool.h"

namespace kvferry::tiering {

// A pool like `like` in ordinary host memory.
inline StatusOr<BlockPool> MakeHostMirror(Device& device, const BlockPool& like) {
  PoolSpec spec = like.spec();
  spec.memory = MemoryKind::kHost;
  return BlockPool::Create(device, spec);
}

// Copies `blocks` of `src` into the same blocks of `dst` (same layout), then waits.
inline Status CopySameBlocks(Stream& stream, const BlockPool& src, const BlockPool& dst,
                             std::span<const int64_t> blocks) {
  if (!(src.layout() == dst.layout())) {
    return Status::InvalidArgument("CopySameBlocks: the pools' layouts differ");
  }
  KVF_ASSIGN_OR_RETURN(std::vector<Extent> ex, src.BlockExtents(blocks));
  for (const Extent& e : ex) {
    KVF_RETURN_IF_ERROR(stream.Copy(dst.Address(e), src.Address(e), static_cast<size_t>(e.bytes)));
  }
  return stream.Synchronize(Clock::now() + std::chrono::minutes(10));
}

// Copies every region of `src` into `dst` (same layout), then waits.
inline Status CopyWholePool(Stream& stream, const BlockPool& src, const BlockPool& dst) {
  if (!(src.layout() == dst.layout())) {
    return Status::InvalidArgument("CopyWholePool: the pools' layouts differ");
  }
  for (int32_t r = 0; r < src.num_regions(); ++r) {
    KVF_RETURN_IF_ERROR(stream.Copy(dst.region(r), src.region(r),
                                    static_cast<size_t>(src.layout().region_bytes())));
  }
  return stream.Synchronize(Clock::now() + std::chrono::minutes(10));
}

}  // namespace kvferry::tiering

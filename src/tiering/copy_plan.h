// Copy planning for the tiered KV cache: turns "copy tokens [0, n) of k consecutive blocks of pool
// A into k consecutive blocks of pool B" into the fewest CopyDescs (2-D where the pitch is
// uniform), by merging axes that are contiguous on both sides.
//
// Pure and allocation-free apart from appending to the caller's reused vector. Thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/kv_model.h"

namespace kvferry::tiering {

// A layout plus the base addresses of its regions (a BlockPool, or a staging buffer).
struct TierView {
  const PoolLayout* layout = nullptr;
  std::span<std::byte* const> regions;
};

// True when the two layouts hold blocks of the same shape (every axis but the block axis equal,
// same element size), so blocks can be copied between them.
bool SameBlockShape(const PoolLayout& a, const PoolLayout& b);

// Appends the descriptors that copy tokens [0, tokens) of every (layer, kv, head) plane of blocks
// src_block .. src_block + count - 1 of `src` into dst_block .. of `dst`. tokens is clamped to
// tokens_per_block. The layouts must have the same block shape (SameBlockShape); ids must be in
// range (the caller validates). Returns the number of descriptors appended.
size_t AppendRunCopies(const TierView& src, int64_t src_block, const TierView& dst,
                       int64_t dst_block, int64_t count, int64_t tokens,
                       std::vector<CopyDesc>& out);

// A layout for `blocks` packed blocks: each block one contiguous range, and inside it the axes in
// the same order as in `like` (so copying a block of `like` into it merges into few long runs).
// Used for the staging buffer of the file tier.
StatusOr<PoolLayout> PackedLayoutLike(const PoolLayout& like, int64_t blocks);

}  // namespace kvferry::tiering

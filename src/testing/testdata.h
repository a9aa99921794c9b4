// The KV test-data generator every test and selftest uses.
//
// Each element's bytes are a deterministic function of (request, global layer, kv, global head,
// global token, dim), so any receiver can check any element it holds without the sender, whatever
// the parallel split and layout on either side. Values are raw bit patterns of the dtype's width
// (compared as bytes; no float semantics). Pure and thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kvferry/pool.h"

namespace kvferry {

// Global coordinates of one element.
struct ElementCoord {
  uint64_t request = 0;
  int64_t layer = 0, kv = 0, head = 0, token = 0, dim = 0;
};

// The element's bits, in the low DTypeSize bytes.
uint64_t TestValue(const ElementCoord& c);

// Where a block's tokens sit in the request: token t of `block` is global token
// first_token + t. `valid_tokens` (<= tokens_per_block) limits fill and check to a prefix of the
// block, for prompts that end mid-block.
struct BlockTokens {
  int64_t block = 0;
  int64_t first_token = 0;
  int64_t valid_tokens = 0;
};

// A per-block scale of the test data: positive, finite, from 2^-6 to 2^6, a function of
// (request, global layer, kv, global head, the block's index in the request).
float TestBlockScale(uint64_t request, int64_t layer, int64_t kv, int64_t head, int64_t block);

// Fills a host-accessible pool's block (all local layers, kv, heads; tokens [0, valid_tokens)),
// and its per-block scales (TestBlockScale of block first_token / tokens_per_block) when the pool
// has them.
Status FillBlock(const BlockPool& pool, uint64_t request, const BlockTokens& where);

// A mismatch found by CheckBlock.
struct Mismatch {
  ElementCoord at;
  uint64_t expected = 0;
  uint64_t actual = 0;
  std::string ToString() const;
};

// Checks a host-accessible pool's block (same ranges as FillBlock); the first wrong element if
// any, or an error for bad arguments. With `sent_as` (the dtype the values were filled in, when
// it differs from the pool's) or scales that differ (`sent_scales`, the sender's, and
// `own_scales`, the pool's: a transfer that Converts), each expected value is the filled one
// converted to the pool's dtype with the element's scales (Stream::ConvertBatch's rules).
// Per-block scales (ScaleGranularity::kBlock): the sender's are TestBlockScale (FillBlock's); the
// pool's, checked too (a mismatch names dim -1 and the scale's bits), are the sender's when both
// are fp8 per block, else computed from the group's filled values (convert_core.h BlockScale).
StatusOr<std::optional<Mismatch>> CheckBlock(const BlockPool& pool, uint64_t request,
                                             const BlockTokens& where,
                                             std::optional<DType> sent_as = std::nullopt,
                                             const KvScales& sent_scales = {},
                                             const KvScales& own_scales = {});

}  // namespace kvferry

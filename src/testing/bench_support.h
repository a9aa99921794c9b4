// What the tools' benchmarks need of the testing target, through public types only (the tools
// see no src/ header): the copy descriptors the TransferManager would issue for block moves (the
// memcpy-loop baseline of `kvferry bench offload`), and the in-memory file tier (MemorySlabStore,
// the "memory" backend). Thread-compatible.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/pool.h"
#include "kvferry/slab_store.h"
#include "kvferry/tiering.h"

namespace kvferry {

// The descriptors copying each move's first `tokens` tokens (all when 0) of block `src` of `from`
// into block `dst` of `to`, appended to `out`. The pools must hold blocks of the same shape;
// ids must be in range (the caller validates).
void AppendBlockCopies(const BlockPool& from, const BlockPool& to, std::span<const BlockMove> moves,
                       std::vector<CopyDesc>& out);

// An in-memory SlabStore of `max_slots` slots of `slot_payload_bytes`
// (testing/memory_slab_store.h).
std::unique_ptr<SlabStore> NewMemorySlabStore(int64_t slot_payload_bytes, int64_t max_slots);

}  // namespace kvferry

// The context side's peer-memory send path (transfer.peer_memory; ACCEPT mode peer memory): a
// generation rank on the same host offers its pool regions as Device::ExportMemory handles; this
// rank maps them once (Engine::MapPeerPool) and its own stream copies every piece of a chunk
// straight into the destination blocks: no transport operation, staging slot or credit. Many
// chunks go out in one CopyBatch (one gather-kernel launch and one batched copy-engine submission
// on a GPU), and the CHUNK messages that tell the generation rank its bytes are in place are
// coalesced: the batches that landed since the last report go out as one message once nothing
// is being copied for the pair, so a request whose batches are all in flight at once costs one
// CHUNK, not one per batch (each control message is a syscall round on both sides).
//
// Pure helpers: no state beyond their arguments; called from the progress thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/pool.h"
#include "kvferry/status.h"
#include "planner/planner.h"
#include "transceiver/messages.h"

namespace kvferry {

// Bytes of chunks one CopyBatch covers at most.
inline constexpr int64_t kPeerBatchBytes = int64_t{64} << 20;

// Every mapping of a FETCH's offered pool holds at least the bytes its target region declares;
// the error names the region and both sizes.
Status CheckPeerPool(std::span<PeerMapping* const> mapped, const RmaTarget& target);

// Appends the copies of chunk `c` from `pool` into the mapped generation pool `peer_pool` (one
// mapping per generation region) to `out`, each checked to lie inside its mapped region.
Status PeerCopies(const Chunk& c, std::span<PeerMapping* const> peer_pool, const BlockPool& pool,
                  std::vector<CopyDesc>& out);

// The next batch of `plan`: consecutive chunks from `next` whose layers are ready (last layer
// below `ready_end`), up to kPeerBatchBytes, or exactly one when `one_chunk` (a checksum covers
// one chunk). Their copies replace the contents of `out`. Returns how many chunks (0: the next
// one is not ready, or there is none), or the error naming the chunk.
StatusOr<uint32_t> CollectPeerBatch(const PairPlan& plan, size_t next, int32_t ready_end,
                                    bool one_chunk, std::span<PeerMapping* const> peer_pool,
                                    const BlockPool& pool, std::vector<CopyDesc>& out);

// Chunks that landed in the generation pool and were not reported yet: one contiguous range,
// since a pair's batches complete in order on one stream.
struct LandedChunks {
  size_t first = 0;
  uint32_t count = 0;
  void Add(size_t chunk, uint32_t n) {
    if (count == 0) first = chunk;
    count += n;
  }
};

}  // namespace kvferry

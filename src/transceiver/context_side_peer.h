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
// PeerSender keeps a pair's state; the other helpers are pure. All run on the progress thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/pool.h"
#include "kvferry/status.h"
#include "planner/planner.h"
#include "transceiver/leases.h"
#include "transceiver/messages.h"

namespace kvferry {

// Bytes and chunks one CopyBatch covers at most.
inline constexpr int64_t kPeerBatchBytes = int64_t{64} << 20;
inline constexpr uint32_t kPeerBatchChunks = 1u << 16;

// Every mapping of a FETCH's offered pool holds at least the bytes its target region declares;
// the error names the region and both sizes.
Status CheckPeerPool(std::span<PeerMapping* const> mapped, const RmaTarget& target);

// Appends the copies of chunk `c` from `pool` into the mapped generation pool `peer_pool` (one
// mapping per generation region) to `out`, each checked to lie inside its mapped region.
Status PeerCopies(const Chunk& c, std::span<PeerMapping* const> peer_pool, const BlockPool& pool,
                  std::vector<CopyDesc>& out);

// The next batch of `plan`: consecutive chunks from `next` whose layers are ready (last layer
// below `ready_end`), up to kPeerBatchBytes and kPeerBatchChunks, or exactly one when `one_chunk`
// (a checksum covers one chunk). Their copies replace the contents of `out`. Returns how many
// chunks (0: the next one is not ready, or there is none), or the error naming the chunk.
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

// One (request, generation rank) pair's peer-memory sends: the batches copying on the context
// rank's stream (in order: one stream), and the landed chunks not yet reported. Used by the
// progress thread only. Each batch holds the lease of its pooled event (the context side's Engine
// pool) and gives it back when it is reaped or abandoned, or when the sender goes.
class PeerSender {
 public:
  // A batch that landed: chunks [chunk, chunk + count), with the checksum of its one chunk when
  // the pair asked for checksums (then it is reported on its own, not coalesced).
  struct Landed {
    size_t chunk = 0;
    uint32_t count = 0;
    bool has_checksum = false;
    uint64_t checksum = 0;
    Clock::time_point started;
  };

  PeerSender(std::vector<PeerMapping*> peer_pool, bool checksum)
      : peer_pool_(std::move(peer_pool)), checksum_(checksum) {}

  // The chunk digest of a chunk's source bytes (Engine::ChunkDigest), for checksummed pairs.
  using Digester = std::function<StatusOr<uint64_t>(const Chunk&)>;

  // Copies the ready chunks of `plan` from `next` (advanced past them) in batches, keeping at most
  // `max_inflight` batches copying on `stream`, each ending on an event of `events`; `scratch`
  // holds the descriptors; `digest` sums each chunk of a checksummed pair before it is copied.
  // True when it launched a batch; an error names the chunk or the failed copy.
  StatusOr<bool> Launch(const PairPlan& plan, size_t& next, int32_t ready_end,
                        const BlockPool& pool, Stream& stream, int64_t max_inflight,
                        std::vector<CopyDesc>& scratch, EventPool& events, const Digester& digest);
  // Appends the batches that completed since the last call, in order, to `out` (cleared first);
  // their events go back to their pool. Batches without a checksum join the coalesced report.
  void Reap(std::vector<Landed>& out);
  // The range to report by one CHUNK now: something landed unreported and nothing is copying.
  std::optional<LandedChunks> TakeReport();
  size_t copying() const { return copying_.size(); }
  // Gives every event back without waiting (a request abandoned after its grace period).
  void Abandon();

 private:
  struct Batch {
    Landed what;
    EventLease done;
  };
  const std::vector<PeerMapping*> peer_pool_;
  const bool checksum_;
  std::deque<Batch> copying_;
  LandedChunks unreported_;
};

}  // namespace kvferry

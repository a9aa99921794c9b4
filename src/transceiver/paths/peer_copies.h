// The context side's peer-memory copies (transfer.peer_memory; paths/peer_memory.h): a
// generation rank on the same host offers its pool regions as Device::ExportMemory handles; this
// rank maps them once (PeerMappings::Map) and its own stream copies every piece of a chunk
// straight into the destination blocks: no transport operation, staging slot or credit. Many
// chunks go out in one CopyBatch (one gather-kernel launch and one batched copy-engine submission
// on a GPU), and the CHUNK messages that tell the generation rank its bytes are in place are
// coalesced: the batches that landed since the last report go out as one message once nothing
// is being copied for the pair, so a request whose batches are all in flight at once costs one
// CHUNK, not one per batch (each control message is a syscall round on both sides).
//
// PeerSender keeps a pair's state; the other helpers are pure. All run on the progress thread.
#pragma once

#include <algorithm>
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
#include "transceiver/engine/leases.h"
#include "transceiver/engine/progress_profile.h"
#include "transceiver/paths/data_path.h"
#include "transceiver/wire/messages.h"

namespace kvferry {

// Bytes (the default of transfer.peer_batch_bytes) and chunks one CopyBatch covers at most. Long
// launches: ranks sharing one GPU time-slice it without MPS, and each switch costs. Measured on
// the H200 (gather_kernel_bench_test), two processes copying at once keep 0.70 of one process's
// rate with 64 MiB per launch, 0.87 with 512 MiB; bench transfer TP2 -> TP4 (4k tokens, 131 MB
// per pair and request) moved 1432 GB/s with 1 GiB batches against 1322 with 64 MiB ones.
inline constexpr int64_t kPeerBatchBytes = int64_t{1} << 30;
inline constexpr uint32_t kPeerBatchChunks = 1u << 16;

// Every mapping of a FETCH's offered pool holds at least the bytes its target region declares;
// the error names the region and both sizes.
Status CheckPeerPool(std::span<PeerMapping* const> mapped, const RmaTarget& target);

// Appends `next` to `prev` when it continues it: rows of the same length, at the same pitches,
// starting where prev's next row would (TP2 -> TP4 head slices of consecutive blocks in both
// pools: one tall 2-D copy instead of one per block). True when merged.
bool ExtendRows(CopyDesc& prev, const CopyDesc& next);

// Appends the copies of chunk `c` from `pool` into the mapped generation pool `peer_pool` (one
// mapping per generation region) to `out`, each checked to lie inside its mapped region; a copy
// that continues the last one in `out` (ExtendRows) extends it, unless the pair `converts` dtypes
// (its descriptors are then for Stream::ConvertBatch). Per-block scales: the context's read from
// `pool`, the generation's written into `peer_scales` (its pool's, mapped), checked likewise.
Status PeerCopies(const Chunk& c, std::span<PeerMapping* const> peer_pool, const BlockPool& pool,
                  std::vector<CopyDesc>& out, bool converts = false,
                  const PeerMapping* peer_scales = nullptr);

// The next batch of `plan`: consecutive chunks from `next` whose layers are ready (last layer
// below `ready_end`), up to `max_bytes` and kPeerBatchChunks, or exactly one when `one_chunk`
// (a checksum covers one chunk). Their copies replace the contents of `out`. Returns how many
// chunks (0: the next one is not ready, or there is none), or the error naming the chunk.
StatusOr<uint32_t> CollectPeerBatch(const PairPlan& plan, size_t next, int32_t ready_end,
                                    bool one_chunk, std::span<PeerMapping* const> peer_pool,
                                    const BlockPool& pool, std::vector<CopyDesc>& out,
                                    int64_t max_bytes = kPeerBatchBytes, bool converts = false,
                                    const PeerMapping* peer_scales = nullptr);

// Every peer-memory batch copying on the context rank's one stream, oldest first, with the lease
// of the event that ends it. A stream finishes its work in order, so the oldest batch's event
// speaks for every later one: Poll queries events only up to the first batch still copying (while
// copies run, one event query per progress iteration, not one per pair and request in flight)
// and gives each finished batch's event back.
//
// Nor does it query the oldest batch before it can have finished: a batch starts no earlier than
// it was enqueued and than the last query that found the batch before it still copying, and moves
// its bytes no faster than kPeerCopyBytesPerNs. On the H200 a 4k-token request (525 MB) copies
// for about 260 us, polled once per progress iteration: 26 of the 105 us of context CPU per
// request went to event queries. Progress thread only.
inline constexpr int64_t kPeerCopyBytesPerNs = 4000;  // 4 TB/s: above any copy within one GPU
class PeerCompletions {
 public:
  explicit PeerCompletions(ProgressProfile* profile)
      : profile_(profile != nullptr && profile->on() ? profile : nullptr) {}
  // A batch of `bytes` whose end `done` records; returns its ticket.
  uint64_t Add(EventLease done, int64_t bytes = 0);
  // Notes the batches that finished; true when any did.
  bool Poll();
  bool Finished(uint64_t ticket) const { return ticket < finished_; }
  // The ticket the next Add returns.
  uint64_t next_ticket() const { return finished_ + open_.size(); }
  size_t copying() const { return open_.size(); }

 private:
  struct Open {
    EventLease done;
    uint64_t meter = 0;    // the profile's meter ticket
    int64_t enqueued = 0;  // steady-clock ns
    int64_t bytes = 0;
    int64_t not_before = 0;  // no query before this (set when the batch becomes the oldest)
  };
  ProgressProfile* const profile_;
  std::deque<Open> open_;
  int64_t seen_copying_ = 0;  // the last query that found the oldest batch copying (ns)
  uint64_t finished_ = 0;     // tickets below this have finished
};

// The batches of the pairs found ready, copied by one CopyBatch behind one event
// (transfer.peer_merge_pairs): a context rank of TP2 -> TP4 feeds two generation ranks, and ranks
// sharing one GPU time-slice it, each switch costing (kPeerBatchBytes), so launches are made long:
// - across pairs and requests: everything found ready in one progress iteration goes together;
// - across iterations (transfer.peer_hold_launches; by default 2 on the CPU device, off on CUDA):
//   while that many launches are on the stream (one copying, the next queued behind it), new
//   batches wait and join one launch, which goes out once the stream is down to fewer (it is
//   never idle: the queued one still copies). In steady state a launch's requests end together
//   and come back together, so launches stay as long as the work in flight allows, not one pair
//   each as FETCHes trickle in. On the CPU device that puts the head slices several generation
//   ranks take of the same source rows into one CopyBatch, which reads each row once
//   (CopyHostBatch).
// Batches added carry the ticket of the Flush that copies them; Discard drops a request's (it
// ended before they went out: its senders abandoned them). Progress thread only.
class PeerLaunch {
 public:
  // `hold_launches` 0: every batch goes out in the iteration that found it.
  PeerLaunch(PeerCompletions& completions, int64_t max_bytes, ProgressProfile* profile,
             int64_t hold_launches = 0)
      : completions_(completions),
        max_bytes_(max_bytes),
        hold_launches_(hold_launches),
        profile_(profile != nullptr && profile->on() ? profile : nullptr) {}
  // No more batches join once the launch holds this many bytes.
  bool full() const { return bytes_ >= max_bytes_; }
  bool empty() const { return descs_.empty(); }
  // Batches wait, and they should go out now: the launch is full, or fewer than hold_launches
  // launches are on the stream, except that with hold_launches > 0 a launch whose every request
  // still awaits FETCHes of other pairs on this rank (`awaits_pairs(request)`, asked only then)
  // waits while anything copies: the pairs of one request then share a launch (on the CPU
  // device, one pass over the source rows their head slices share). A request ends only when all
  // its pairs did, so the wait costs the request nothing while the stream is busy, and an idle
  // stream ends it.
  template <class AwaitsPairs>
  bool due(AwaitsPairs awaits_pairs) const {
    if (empty()) return false;
    if (full() || hold_launches_ <= 0) return true;
    const int64_t copying = static_cast<int64_t>(completions_.copying());
    if (copying >= hold_launches_) return false;
    return copying == 0 || !std::all_of(parts_.begin(), parts_.end(),
                                        [&](const Part& p) { return awaits_pairs(p.owner); });
  }
  bool due() const {
    return due([](uint64_t) { return false; });
  }
  // Adds a batch of request `owner` of `bytes` copied by `copies`; returns the ticket the next
  // Flush carries.
  uint64_t Add(uint64_t owner, std::span<const CopyDesc> copies, int64_t bytes);
  // The requests whose batches wait (each once).
  std::vector<uint64_t> owners() const;
  // One CopyBatch of every copy added since the last Flush, one event behind it.
  Status Flush(Stream& stream, EventPool& events);
  // Drops the waiting batches of `owner`.
  void Discard(uint64_t owner);
  void Discard();

 private:
  struct Part {  // descs_[begin, end) of one owner
    uint64_t owner = 0;
    size_t begin = 0, end = 0;
    int64_t bytes = 0;
  };
  PeerCompletions& completions_;
  const int64_t max_bytes_;
  const int64_t hold_launches_;
  ProgressProfile* const profile_;
  std::vector<CopyDesc> descs_;
  std::vector<Part> parts_;
  int64_t bytes_ = 0;
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

  // `completions` tracks the stream every Launch of this sender copies on; it outlives the
  // sender. `profile` (may be null) times copy submission. A batch covers at most `batch_bytes`.
  // `peer_scales`: the generation pool's per-block scales, mapped (null: none).
  PeerSender(std::vector<PeerMapping*> peer_pool, bool checksum, PeerCompletions& completions,
             ProgressProfile* profile = nullptr, int64_t batch_bytes = kPeerBatchBytes,
             const PeerMapping* peer_scales = nullptr)
      : peer_pool_(std::move(peer_pool)),
        peer_scales_(peer_scales),
        checksum_(checksum),
        batch_bytes_(batch_bytes),
        completions_(completions),
        profile_(profile != nullptr && profile->on() ? profile : nullptr) {}

  // The chunk digest of a chunk's source bytes (Engine::ChunkDigest), for checksummed pairs.
  using Digester = std::function<StatusOr<uint64_t>(const Chunk&)>;

  // Copies the ready chunks of `plan` from `next` (advanced past them) in batches, keeping at most
  // `max_inflight` batches copying on `stream`, each ending on an event of `events`; `scratch`
  // holds the descriptors; `digest` sums each chunk of a checksummed pair before it is copied.
  // With `merged`, batches join it (until it is full) instead of being copied here: the caller
  // flushes it. True when it launched a batch; an error names the chunk or the failed copy.
  // `owner` names the request in `merged`. With `conversion` (planner.h PlanConversion) each
  // batch converts (Stream::ConvertBatch) and goes out on its own, never merged.
  StatusOr<bool> Launch(const PairPlan& plan, size_t& next, int32_t ready_end,
                        const BlockPool& pool, Stream& stream, int64_t max_inflight,
                        std::vector<CopyDesc>& scratch, EventPool& events, const Digester& digest,
                        PeerLaunch* merged = nullptr, uint64_t owner = 0,
                        std::optional<Conversion> conversion = std::nullopt);
  // Appends the batches that completed (as of the last PeerCompletions::Poll) since the last
  // call, in order, to `out` (cleared first). Batches without a checksum join the coalesced
  // report.
  void Reap(std::vector<Landed>& out);
  // The range to report by one CHUNK now: something landed unreported and nothing is copying.
  std::optional<LandedChunks> TakeReport();
  size_t copying() const { return copying_.size(); }
  // Forgets the batches still copying (a request abandoned after its grace period); their events
  // go back through PeerCompletions once the stream passed them.
  void Abandon();

 private:
  struct Batch {
    Landed what;
    uint64_t ticket = 0;  // PeerCompletions'
  };
  const std::vector<PeerMapping*> peer_pool_;
  const PeerMapping* const peer_scales_;
  const bool checksum_;
  const int64_t batch_bytes_;
  PeerCompletions& completions_;
  ProgressProfile* const profile_;  // null unless profiling
  std::deque<Batch> copying_;
  LandedChunks unreported_;
};

}  // namespace kvferry

// The tiered KV cache, part 1: the TransferManager moves KV blocks between the primary pool
// (device memory), a secondary pool (pinned host memory) and a file tier (a SlabStore of slots).
//
// Why it exists: eviction should move a reusable block down a tier instead of dropping it, and a
// prefix hit should bring it back, without stalling the compute stream and without per-block
// copies. Each Move() is one batch: neighbouring blocks (consecutive ids on both sides) coalesce
// into one descriptor, and the whole batch is one Stream::CopyBatch.
//
// Streams and ordering. The manager owns an offload stream (moves to a lower tier) and an onboard
// stream (moves to a higher tier, and primary-to-primary partial copies). For every block of the
// primary and host pools it keeps the batch that last wrote it and, per stream, the batch that
// last read it (preallocated arrays; nothing is allocated per block). A new copy waits for the
// last write of its source and for the last write and reads of its destination; so an onboard of a
// block waits for a pending offload of that block, and a block is never overwritten under a read.
// File slots are ordered by the file worker, which runs file batches one at a time, in order.
// The compute stream is not tracked: call WaitForCompute(compute) before moving blocks compute has
// just written, and SyncWithCompute(compute) before compute uses blocks a move has written.
//
// File tier. Offload: pool -> pinned staging on the offload stream, then one SlabStore::Write
// batch on the worker thread. Onboard: one SlabStore::Read batch on the worker, then staging ->
// pool on the onboard stream. Staging is bounded (TransferOptions::file_staging_blocks). A failed
// write leaves the source block where it was, untouched, and the batch reports the item's error;
// a corrupt slot fails its item with kDataLoss and the reason, and its destination is not written.
//
// Submission: Move() checks the batch and hands it to the manager's submit thread, which orders it
// after earlier batches, plans it and queues its copies (or its file I/O) in Move order; the
// caller never plans, submits a copy or waits for a disk. SyncWithCompute and Drain wait for that
// queue first; code that orders its own work against offload_stream() / onboard_stream() must do
// the same (WaitSubmitted, or SyncWithCompute).
//
// Completion: Move() returns once the batch is queued. TransferBatch::Query()/Wait() say when
// every copy of the batch has finished (for the file tier: including the file I/O); from then the
// sources may be reused and the destinations read. Item errors are per item.
//
// Thread-safety: Move, SyncWithCompute, WaitForCompute and Drain may be called from one thread at
// a time. TransferBatch handles may be queried and waited on from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/export.h"
#include "kvferry/metrics.h"
#include "kvferry/pool.h"
#include "kvferry/slab_store.h"
#include "kvferry/status.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

enum class Tier : uint8_t { kPrimary = 0, kHost = 1, kFile = 2 };
inline constexpr int kNumTiers = 3;
std::string_view TierName(Tier tier);

// The identity of a block's bytes (see BlockKeyChain in block_manager.h); names file slots.
struct BlockKey {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const BlockKey&) const = default;
};

// One block of a batch.
struct BlockMove {
  BlockMove() = default;
  BlockMove(int64_t s, int64_t d, int32_t t = 0, BlockKey k = {})
      : src(s), dst(d), tokens(t), key(k) {}
  int64_t src = 0;     // block id in the source tier (slot id in the file tier)
  int64_t dst = 0;     // block id in the destination tier (slot id in the file tier)
  int32_t tokens = 0;  // copy the first `tokens` tokens of each (layer, kv, head); 0 = all
  BlockKey key;        // identity of the bytes; written with and checked against file slots
};

namespace internal {
struct KVFERRY_HIDDEN BatchState;
}

// A handle to one queued batch. Cheap to copy; valid after the manager is gone only for items()
// of a finished batch.
class TransferBatch {
 public:
  TransferBatch() = default;
  explicit TransferBatch(std::shared_ptr<internal::BatchState> s) : s_(std::move(s)) {}

  // True when every copy and file I/O of the batch has finished (successfully or not).
  bool Query() const;
  // Waits until Query() is true or the deadline passes (kDeadlineExceeded; the batch keeps
  // going). Returns the first item error of a finished batch, or OK.
  Status Wait(Deadline deadline) const;
  // Per-item results, in the order of the moves; valid once Query() is true.
  const std::vector<Status>& items() const;
  size_t size() const;
  // Descriptors the batch was planned into (after coalescing).
  size_t descriptors() const;
  explicit operator bool() const { return s_ != nullptr; }

 private:
  std::shared_ptr<internal::BatchState> s_;
};

// Two-stage copies through device staging (primary <-> host). When the primary layout scatters a
// block into many small fragments (per-layer pools), a direct copy moves those fragments over the
// link, and offload and onboard at once then reach ~70% of the link on the H200 whatever carries
// them (docs/tiering.md). Staged, a device-local leg packs each block into device staging (or
// unpacks it, for onboards) at device-memory speed, and the link leg crosses PCIe from one packed
// block: one contiguous copy-engine copy per block when a host block is one range (a host tier in
// the primary's in-block order: kBlockMajorNhd for kPerLayer, kBlockMajor for kPerLayerHnd), else
// the host side's fragments from a contiguous device block. Batches of whole blocks only: one with
// partial (first-tokens) moves goes direct. Per copy stream: staging_blocks blocks of device
// memory in two halves, the device-local leg of one half overlapping the link leg of the other (a
// second stream); larger batches go through it half by half.
enum class DeviceStaging : uint8_t {
  kAuto,    // on GPUs (not the CPU device) when a primary block is fragmented, a host block is one
            // range, and the device-local leg moves runs of 4 KiB or more (the host tier keeps the
            // primary's in-block order; a transposing one stays direct): the default
  kAlways,  // whenever a primary block is fragmented, on any device and for any host layout
  kNever,
};

// A host tier packed in the primary's block order: each host block one contiguous range whose
// axes run in the order they run inside one block of `primary` (kBlockMajorNhd under an NHD
// primary: per-layer, per-layer-kv, flashinfer, block-major-nhd; kBlockMajor under an HND one). A
// TransferManager over such a pair stages per-layer blocks through device memory by default
// (DeviceStaging::kAuto) and moves each one over the link as one copy (docs/tiering.md, device
// staging). PackedHostLayout names that layout for `primary`'s layout (a wrapped kCustom pool
// too, from its strides); InvalidArgument when no named layout keeps its order.
StatusOr<LayoutKind> PackedHostLayout(const BlockPool& primary);
// A pinned-host pool of `blocks` blocks for that tier: `primary`'s shape, parallel config and
// rank, laid out by PackedHostLayout(primary). Errors: those of PackedHostLayout, blocks < 1, and
// BlockPool::Create's (allocation).
StatusOr<BlockPool> CreatePackedHostPool(Device& device, const BlockPool& primary, int64_t blocks);

struct TransferOptions {
  int64_t file_staging_blocks = 32;  // pinned staging of the file tier, in blocks
  DeviceStaging device_staging = DeviceStaging::kAuto;
  int64_t device_staging_blocks = 32;  // per copy stream
  // Defaults from the config knobs (tiering.file_staging_blocks, tiering.device_staging,
  // tiering.device_staging_blocks).
  static TransferOptions FromConfig();
};

struct TransferStats {
  int64_t batches = 0;
  int64_t blocks = 0;
  int64_t descriptors = 0;
  int64_t bytes = 0;  // bytes copied by streams (partial copies count what they copy)
  int64_t file_writes = 0, file_write_errors = 0;
  int64_t file_reads = 0, file_read_errors = 0;
  int64_t file_jobs_queued = 0;  // file batches not yet through the I/O thread (either queue)
  int64_t submits_queued = 0;    // batches Move returned that the submit thread has not queued
};

class TransferManager {
 public:
  // `primary` must be device memory; `host` (optional) a pinned-host or host pool whose blocks
  // have the same shape and element size; `file` (optional) a SlabStore whose slot payload holds
  // one whole block. All must outlive the manager.
  static StatusOr<std::unique_ptr<TransferManager>> Create(Device& device, BlockPool& primary,
                                                           BlockPool* host, SlabStore* file,
                                                           const TransferOptions& options = {});
  ~TransferManager();
  TransferManager(const TransferManager&) = delete;
  TransferManager& operator=(const TransferManager&) = delete;

  // Queues one batch copying blocks from tier `from` to tier `to`. Supported: primary <-> host,
  // primary <-> file, host <-> file, and primary -> primary (a partial copy into a new block).
  // Errors (nothing is queued): an id outside its tier, tokens outside [0, tokens_per_block], a
  // tier that is not attached, two moves writing one destination, a file batch larger than the
  // staging.
  StatusOr<TransferBatch> Move(Tier from, Tier to, std::span<const BlockMove> moves);
  StatusOr<TransferBatch> Offload(Tier to, std::span<const BlockMove> moves) {
    return Move(Tier::kPrimary, to, moves);
  }
  StatusOr<TransferBatch> Onboard(Tier from, std::span<const BlockMove> moves) {
    return Move(from, Tier::kPrimary, moves);
  }

  // Later work on `compute` waits for every copy queued so far (both streams). Pending file
  // onboards whose reads have not finished are waited for on the host first.
  Status SyncWithCompute(Stream& compute);
  // Later copies wait for the work queued on `compute` so far.
  Status WaitForCompute(Stream& compute);
  // Waits for every queued batch.
  Status Drain(Deadline deadline);
  // Waits until the submit thread has queued every batch Move returned (copies on their streams,
  // file jobs on the I/O thread); copies and file I/O may still run. For code that synchronizes
  // the copy streams itself.
  Status WaitSubmitted(Deadline deadline);

  // Submission plug. While plugged, Move queues its batch and the submit thread takes none
  // (copies do not start) until the last Unplug, which wakes it once; calls that wait for
  // submissions (SyncWithCompute, Drain, WaitSubmitted, and a Move that must wait for file
  // staging) run the queue meanwhile. A caller that makes several batches in one step
  // (BlockManager::AddSequence: an onboard, an eviction's offload, a partial copy) then pays one
  // wake-up, and never waits for the mutex while the submit thread orders its previous batch.
  // Plugs nest (a count) and are manager-wide: other threads' batches made meanwhile wait for the
  // unplug too. Do not Wait on a batch made under your own plug before unplugging (it would wait
  // for its deadline). Thread-safe. SubmitPlug is the scoped form.
  void Plug();
  void Unplug();
  class SubmitPlug {
   public:
    explicit SubmitPlug(TransferManager& tm) : tm_(tm) { tm_.Plug(); }
    ~SubmitPlug() { tm_.Unplug(); }
    SubmitPlug(const SubmitPlug&) = delete;
    SubmitPlug& operator=(const SubmitPlug&) = delete;

   private:
    TransferManager& tm_;
  };

  // The copy streams, for callers that order their own work against the copies (and tests).
  Stream& offload_stream() const;
  Stream& onboard_stream() const;

  BlockPool& primary() const;
  BlockPool* host() const;
  SlabStore* file() const;
  bool has_tier(Tier tier) const;
  int64_t tier_blocks(Tier tier) const;  // capacity in blocks (slots for the file tier)
  int64_t file_staging_blocks() const;   // the largest file batch
  bool device_staged() const;            // primary <-> host copies go through device staging
  // File staging blocks free now: a file batch of at most this many blocks is queued without
  // waiting (Move waits for staging otherwise). Staging only frees up between calls.
  int64_t file_staging_free() const;
  TransferStats stats() const;
  // Bytes, batches and copy latency per direction, file I/O and its queue (kvferry/metrics.h).
  TieringMetrics metrics() const;

  struct KVFERRY_HIDDEN Impl;

 private:
  explicit TransferManager(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry
#pragma GCC visibility pop

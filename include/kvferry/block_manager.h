// The tiered KV cache, part 2: the BlockManager decides which KV blocks live where.
//
// Sequences allocate blocks from the primary pool. Each FULL block gets a key from a hash chain
// over its tokens, rooted in everything that makes the bytes differ (model id, KV shape and dtype,
// layer and head range of this rank, TP/PP split, a salt), so two different caches never alias.
// Keys are XXH3-128 (libxxhash, inlined): root = XXH3-128 of the identity's fields encoded as
// little-endian bytes; key(i) = XXH3-128 of (key(i-1), the block's token ids).
//
// A file tier that survived a restart (SlabStore::Recovered) is indexed at Create: its verified
// slots are prefix hits again. Cached blocks nobody references sit in one LRU per tier, ordered by
// retention priority (0..100, lower evicted first) and by age within a priority. When the primary
// pool has no free block, its victim is OFFLOADED to the host tier (if its priority reaches
// offload_min_priority), a full host tier demotes its own victim to the file tier, and a full file
// tier drops its victim. A prefix lookup walks the chain: primary hits are shared (refcount + 1),
// host and file hits are onboarded into new primary blocks; with partial reuse, the first tokens of
// a cached block that match the prompt's next (non-matching) block are copied into a new block.
//
// Leases: a block referenced by a sequence, or being copied by the manager, is never in an LRU, so
// it can't be evicted. Data ordering is the TransferManager's: before compute reads blocks a call
// returned, call SyncWithCompute(compute); before blocks compute wrote are offloaded (every call
// that allocates may evict), call WaitForCompute(compute) first.
//
// Nothing waits on the caller's thread (background tiering). Poll, RemoveSequence and PollReady
// first retire the copies and file I/O that finished; the calls that allocate (AddSequence,
// AppendTokens, Prefetch) retire nothing, leaving the completion queries and the per-block
// bookkeeping to them. Poll and RemoveSequence (not the calls that allocate, whose stall the
// engine sees) then keep free blocks between watermarks: when the free
// primary blocks fall below free_low_pct of the pool, LRU victims are offloaded to the host tier
// (on the offload stream) until free_high_pct are free, and likewise host victims are demoted to
// the file tier (copies on the offload stream, the writes on the TransferManager's I/O thread), so
// an allocation normally finds a free block and never waits for a copy or a disk. Call Poll while
// the engine waits for a forward pass. An allocation that finds none evicts at once (offload
// queued, never waited for) or drops the victim when the host tier has no free block. Onboards
// start as soon as a prefix hit is known (AddSequence, or earlier with Prefetch): host hits on the
// onboard stream, file hits read on the I/O thread; the engine asks PollReady/WaitReady only when
// it needs the blocks. A corrupt or failed slot shortens the reuse (Readiness::reused_tokens) and
// is reported in Readiness::misses and a kRemoved event.
//
// I/O leases: a file slot is held by a move-only SlotLease (tiering/slot_lease.h) owned either by
// the index (the slot holds a key) or by the in-flight operation that reads or writes it; it goes
// back to the store only when that operation has finished. An operation past io_timeout is
// abandoned (counted; a demotion's key stays in the host tier) but its slot and blocks stay leased
// until the I/O ends: a slot whose write may still be running is never reused.
//
// Thread-safety: not thread-safe; one scheduler thread drives a BlockManager.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvferry/export.h"
#include "kvferry/kv_model.h"
#include "kvferry/tiering.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

// Everything that makes the bytes of a block differ besides its tokens.
struct CacheIdentity {
  std::string model_id;     // e.g. "meta-llama/Llama-3.1-8B@revision"
  KvShape shape;            // layers, heads, head dim, dtype, kv factor, tokens per block
  ParallelConfig parallel;  // TP / PP split
  RankSlice slice;          // this rank's layers and heads
  uint64_t salt = 0;        // reuse isolation (per tenant, per LoRA adapter, ...)
};

// The hash chain of block keys. Pure and thread-safe.
BlockKey RootKey(const CacheIdentity& identity);
BlockKey NextKey(const BlockKey& parent, std::span<const int32_t> tokens);

inline constexpr int32_t kMinPriority = 0;
inline constexpr int32_t kMaxPriority = 100;
inline constexpr int32_t kDefaultPriority = 35;

struct BlockManagerOptions {
  CacheIdentity identity;
  int32_t offload_min_priority = 0;  // victims below it are dropped, not offloaded
  bool partial_reuse = true;
  // File I/O older than this is abandoned (its slot stays leased until the I/O really ends).
  std::chrono::milliseconds io_timeout{30000};
  // Background tiering: below free_low_pct percent free blocks (primary; host), victims are moved
  // down until free_high_pct percent are free. 0 and 0: only on demand (at allocation).
  int32_t free_low_pct = 5;
  int32_t free_high_pct = 10;
  // The engine's compute stream (not owned), if known: before offloading evicted blocks, the copy
  // streams then wait for the work queued on it so far, so a block compute has just written is
  // never copied half-written. Without it, call WaitForCompute before calls that may evict.
  Stream* compute = nullptr;
  // Router events kept for DrainEvents, at most: past it the oldest event is dropped and counted
  // (BlockManagerStats::events_dropped), so a manager nobody drains stays bounded.
  int64_t max_events = 65536;
  // Defaults from the config knobs (tiering.offload_min_priority, tiering.partial_reuse,
  // tiering.io_timeout_ms, tiering.free_low_pct, tiering.free_high_pct, tiering.max_events); the
  // identity is left empty.
  static BlockManagerOptions FromConfig();
};

enum class KvEventKind { kStored, kMoved, kRemoved };
std::string_view KvEventKindName(KvEventKind kind);

// For routers: what the cache holds, and where.
struct KvEvent {
  KvEventKind kind;
  BlockKey key;
  Tier from = Tier::kPrimary;  // kMoved: old tier; kRemoved: the tier it was dropped from
  Tier to = Tier::kPrimary;    // kStored, kMoved: the tier it is in now
  std::string reason;          // kRemoved: why
};

// What AddSequence found and did.
struct Admission {
  std::vector<int64_t> blocks;  // the sequence's primary blocks, in token order
  int64_t reused_tokens = 0;    // prompt tokens whose KV the blocks will hold once the onboards
                                // finish, if none fails (PollReady gives the final count)
  bool ready = true;            // no onboard pending: reused_tokens is final
  int64_t hits[kNumTiers] = {0, 0, 0};  // prefix blocks found per tier
  int64_t partial_tokens = 0;           // of reused_tokens, copied from a partially matching block
  std::vector<std::string> misses;      // cached blocks that could not be used, with the reason
};

// Whether a sequence's reused blocks hold their bytes (PollReady, WaitReady).
struct Readiness {
  bool ready = false;               // every onboard of the sequence finished
  int64_t reused_tokens = 0;        // final once ready: failed onboards shorten the reuse
  std::vector<std::string> misses;  // onboards that failed, with the reason
};

struct BlockManagerStats {
  int64_t cached[kNumTiers] = {0, 0, 0};  // keyed blocks held per tier
  int64_t free_primary = 0, free_host = 0;
  int64_t hits[kNumTiers] = {0, 0, 0};
  int64_t lookups = 0;  // full prompt blocks looked up
  int64_t offloaded = 0, demoted = 0, onboarded = 0, partial_copies = 0;
  int64_t dropped[kNumTiers] = {0, 0, 0};
  int64_t write_failures = 0, corrupt_reads = 0;
  // Background tiering and I/O.
  int64_t prefetched = 0;            // blocks onboarded by Prefetch
  int64_t background_evictions = 0;  // primary victims moved by the watermark, not by allocation
  int64_t inline_evictions = 0;      // primary victims moved by an allocating call (on its thread)
  int64_t ops_in_flight = 0;         // copy and file batches not finished yet
  int64_t file_ops_in_flight = 0;    // of those, file reads and writes
  int64_t deferred_reads = 0;        // file reads waiting for staging (queued in the manager)
  int64_t inflight_bytes = 0;        // bytes of the batches in flight
  int64_t abandoned = 0;             // operations past io_timeout (leases kept until they end)
  int64_t leased_slots = 0;          // file slots held by in-flight operations
  int64_t recovered = 0;             // file slots found intact at open, offered as prefix hits
  // Events dropped, oldest first, because max_events were waiting for DrainEvents: a router that
  // sees this grow has missed changes and should rebuild its view.
  int64_t events_dropped = 0;
  // Time the calls spent handing batches to the TransferManager (planning and the driver's enqueue
  // on CUDA): the part of the caller's time that is copy submission, not bookkeeping.
  int64_t submit_ns = 0;
};

class BlockManager {
 public:
  static StatusOr<std::unique_ptr<BlockManager>> Create(TransferManager& transfers,
                                                        const BlockManagerOptions& options);
  ~BlockManager();

  // Starts a sequence: reuses the longest cached prefix of `prompt` and allocates blocks for the
  // rest. The prompt's full blocks are then stored under their keys (reusable by later
  // sequences). Errors: a duplicate id, a priority outside [0, 100], kResourceExhausted when
  // every primary block is referenced (nothing changes then).
  StatusOr<Admission> AddSequence(uint64_t id, std::span<const int32_t> prompt,
                                  int32_t priority = kDefaultPriority);
  // Appends tokens (generated, or more prompt), allocating blocks as needed; blocks that become
  // full are stored.
  Status AppendTokens(uint64_t id, std::span<const int32_t> tokens);
  // Ends a sequence. Its stored blocks stay cached at the sequence's priority; others are freed
  // (blocks an onboard is still writing: once it has finished).
  Status RemoveSequence(uint64_t id);
  // Starts onboarding the cached host and file blocks of `prompt`'s prefix into free primary
  // blocks (evicting only LRU victims), so that a later AddSequence finds them in the primary
  // tier. Never waits. Returns the number of blocks whose onboard started.
  StatusOr<int64_t> Prefetch(std::span<const int32_t> prompt, int32_t priority = kDefaultPriority);
  // Whether the sequence's onboards have finished (non-blocking), and the final reuse.
  StatusOr<Readiness> PollReady(uint64_t id);
  // Waits up to `deadline` for the sequence's onboards (ready = false when it passes).
  StatusOr<Readiness> WaitReady(uint64_t id, Deadline deadline);
  // Retires finished copies and I/O and runs the watermarks (RemoveSequence does too; the calls
  // that allocate do neither). Call it when idle, e.g. while a forward pass runs. Never waits.
  void Poll();
  // The sequence's primary blocks, or kNotFound.
  StatusOr<std::vector<int64_t>> Blocks(uint64_t id) const;

  // Events since the last drain, in order: the newest max_events of them (events_dropped counts
  // the rest).
  std::vector<KvEvent> DrainEvents();
  BlockManagerStats stats() const;
  // Where a key's block is now (kNotFound if not cached): tier and block/slot id.
  StatusOr<std::pair<Tier, int64_t>> Find(const BlockKey& key) const;

  Status SyncWithCompute(Stream& compute) { return transfers_.SyncWithCompute(compute); }
  Status WaitForCompute(Stream& compute) { return transfers_.WaitForCompute(compute); }
  TransferManager& transfers() { return transfers_; }

  struct KVFERRY_HIDDEN Impl;

 private:
  BlockManager(TransferManager& transfers, std::unique_ptr<Impl> impl);
  TransferManager& transfers_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry
#pragma GCC visibility pop

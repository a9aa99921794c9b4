// The tiered KV cache, part 2: the BlockManager decides which KV blocks live where.
//
// Sequences allocate blocks from the primary pool. Each FULL block gets a key from a hash chain
// over its tokens, rooted in everything that makes the bytes differ (model id, KV shape and dtype,
// layer and head range of this rank, TP/PP split, a salt), so two different caches never alias.
// Keys are XXH3-128 (libxxhash, inlined): root = XXH3-128 of the identity's fields encoded as
// little-endian bytes; key(i) = XXH3-128 of (key(i-1), the block's token ids).
//
// Cached blocks nobody references sit in one LRU per tier, ordered by retention priority
// (0..100, lower evicted first) and by age within a priority. When the primary pool has no free
// block, its victim is OFFLOADED to the host tier (if its priority reaches offload_min_priority),
// a full host tier demotes its own victim to the file tier, and a full file tier drops its victim.
// A prefix lookup walks the chain: primary hits are shared (refcount + 1), host and file hits are
// onboarded into new primary blocks; with partial reuse, the first tokens of a cached block that
// match the prompt's next (non-matching) block are copied into a new block.
//
// Leases: a block referenced by a sequence, or being copied by the manager, is never in an LRU, so
// it can't be evicted. Data ordering is the TransferManager's: before compute reads blocks a call
// returned, call SyncWithCompute(compute); before blocks compute wrote are offloaded (every call
// that allocates may evict), call WaitForCompute(compute) first.
//
// File I/O on the eviction path is waited for (a failed demotion keeps the host block and drops
// the primary victim instead); file onboards are waited for too, so a corrupt slot is a miss with
// its reason, reported in the admission and as a kRemoved event.
//
// Thread-safety: not thread-safe; one scheduler thread drives a BlockManager.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvferry/kv_model.h"
#include "kvferry/tiering.h"

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
  std::chrono::milliseconds io_timeout{30000};  // waits for file I/O on the eviction path
  // The engine's compute stream (not owned), if known: before offloading evicted blocks, the copy
  // streams then wait for the work queued on it so far, so a block compute has just written is
  // never copied half-written. Without it, call WaitForCompute before calls that may evict.
  Stream* compute = nullptr;
  // Defaults from the config knobs (tiering.offload_min_priority, tiering.partial_reuse,
  // tiering.io_timeout_ms); the identity is left empty.
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
  int64_t reused_tokens = 0;    // prompt tokens whose KV the blocks already hold (or will, once
                                // the returned copies finish)
  int64_t hits[kNumTiers] = {0, 0, 0};  // prefix blocks found per tier
  int64_t partial_tokens = 0;           // of reused_tokens, copied from a partially matching block
  std::vector<std::string> misses;      // cached blocks that could not be used, with the reason
};

struct BlockManagerStats {
  int64_t cached[kNumTiers] = {0, 0, 0};  // keyed blocks held per tier
  int64_t free_primary = 0, free_host = 0;
  int64_t hits[kNumTiers] = {0, 0, 0};
  int64_t lookups = 0;  // full prompt blocks looked up
  int64_t offloaded = 0, demoted = 0, onboarded = 0, partial_copies = 0;
  int64_t dropped[kNumTiers] = {0, 0, 0};
  int64_t write_failures = 0, corrupt_reads = 0;
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
  // Ends a sequence. Its stored blocks stay cached at the sequence's priority; others are freed.
  Status RemoveSequence(uint64_t id);
  // The sequence's primary blocks, or kNotFound.
  StatusOr<std::vector<int64_t>> Blocks(uint64_t id) const;

  // Events since the last drain, in order.
  std::vector<KvEvent> DrainEvents();
  BlockManagerStats stats() const;
  // Where a key's block is now (kNotFound if not cached): tier and block/slot id.
  StatusOr<std::pair<Tier, int64_t>> Find(const BlockKey& key) const;

  Status SyncWithCompute(Stream& compute) { return transfers_.SyncWithCompute(compute); }
  Status WaitForCompute(Stream& compute) { return transfers_.WaitForCompute(compute); }
  TransferManager& transfers() { return transfers_; }

  struct Impl;

 private:
  BlockManager(TransferManager& transfers, std::unique_ptr<Impl> impl);
  TransferManager& transfers_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvferry

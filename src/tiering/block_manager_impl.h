// BlockManager's state, shared by block_manager.cc (sequences, prefix lookup, the public calls)
// and block_manager_io.cc (eviction, offload, demotion, onboards, retiring finished operations).
// Private to src/tiering. Not thread-safe (the manager's scheduler thread only).
#pragma once

#include <array>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvferry/block_manager.h"
#include "kvferry/slab_store.h"
#include "tiering/key_index.h"
#include "tiering/priority_lru.h"
#include "tiering/slot_lease.h"

namespace kvferry {
namespace tiering {

// One block of the primary or host tier, or one slot of the file tier.
struct Slot {
  bool has_key = false;
  BlockKey key;
  int32_t refs = 0;       // primary: sequences referencing the block
  bool arriving = false;  // primary: a file read is bringing its bytes (not in any LRU)
  bool failed = false;    // primary: that read failed (reason in `why`)
  bool busy = false;      // host: a demotion reads it; file: a read of it is in flight
  std::string why;
};

struct Sequence {
  std::vector<int32_t> tokens;
  std::vector<int64_t> blocks;
  std::vector<BlockKey> keys;  // of the full blocks
  int32_t priority;
  int64_t prompt_tokens = 0;
  size_t matched = 0;          // prefix blocks found: reused if their onboards succeed
  int64_t partial_tokens = 0;  // copied into blocks[matched], if that copy succeeds
  std::vector<std::string> misses;
};

enum class OpKind : uint8_t {
  kOffload,  // primary -> host (eviction)
  kDemote,   // host -> file
  kSpill,    // primary -> file (eviction while the host tier has no free block)
  kOnboard,  // host or file -> primary
  kPartial,  // the first tokens of a file slot -> a primary block
};

struct OpItem {
  BlockKey key;
  int64_t src = -1;
  int64_t dst = -1;
  int32_t tokens = 0;
  SlotLease slot;  // the file slot read or written, held until the operation is retired
};

// One batch in flight and what it holds. Retired (items processed, leases released or handed to
// the index) only once its TransferBatch has finished; never earlier, whatever the deadline.
struct Op {
  OpKind kind;
  Tier from = Tier::kPrimary;
  TransferBatch batch;
  Deadline deadline;
  int64_t bytes = 0;
  bool abandoned = false;
  bool prefetch = false;
  std::vector<OpItem> items;
};

// Where an op completes: 0 the offload stream, 1 the onboard stream, 2 the FIFO I/O thread (file
// reads and writes). Within a lane, ops finish in submission order.
inline constexpr int kLanes = 3;
inline bool IsFileIo(const Op& op) {
  return op.kind == OpKind::kDemote || op.kind == OpKind::kSpill || op.from == Tier::kFile;
}
inline int LaneOf(const Op& op) {
  if (IsFileIo(op)) return 2;
  return op.kind == OpKind::kOffload ? 0 : 1;
}

// A router event as the ring keeps it. A removal's reason is a constant (`why`, static storage)
// or, on error paths, its own text (`detail`): a call that drops a prompt's worth of blocks (an
// eviction with no lower tier, a host victim dropped before its demotion) formats no string and
// allocates nothing on the engine's thread; DrainEvents spells the reason out.
struct PendingEvent {
  KvEventKind kind;
  BlockKey key;
  Tier from = Tier::kPrimary;
  Tier to = Tier::kPrimary;
  const char* why = nullptr;  // kRemoved: the reason, if a constant
  std::string detail{};       // kRemoved: the reason otherwise
};

// The router events waiting for DrainEvents: a ring of at most `cap`, its storage reserved at the
// first event (address space only: pages are touched as it fills) and never moved after; when
// full, the oldest is overwritten and counted in `*dropped`. (It used to grow by doubling: a call
// that crossed a power of two moved every event so far, up to 64k of them, on the engine's
// thread.) A drain that empties it starts the next events at the ring's front again: a router
// that drains often keeps them in the few cache lines it just read, instead of the ring walking
// all of its storage (up to 64k events, ~4 MiB: a cache miss per event on the engine's thread).
class EventRing {
 public:
  EventRing(int64_t cap, int64_t* dropped) : cap_(static_cast<size_t>(cap)), dropped_(dropped) {}
  void Push(PendingEvent e) {
    if (ring_.capacity() < cap_) ring_.reserve(cap_);
    const size_t at = (head_ + count_) % cap_;
    if (at < ring_.size()) {
      ring_[at] = std::move(e);
    } else {
      ring_.push_back(std::move(e));  // at == ring_.size(): the ring has not reached `at` yet
    }
    if (count_ < cap_) {
      ++count_;
    } else {
      head_ = (head_ + 1) % cap_;
      ++*dropped_;
    }
  }
  std::vector<KvEvent> Drain() {
    std::vector<KvEvent> out;
    out.reserve(count_);
    for (size_t i = 0; i < count_; ++i) {
      PendingEvent& e = ring_[(head_ + i) % cap_];
      out.push_back(KvEvent{e.kind, e.key, e.from, e.to,
                            e.why != nullptr ? std::string(e.why) : std::move(e.detail)});
    }
    head_ = 0;  // empty: the next event goes to the front (see the class comment)
    count_ = 0;
    return out;
  }
  size_t size() const { return count_; }
  size_t slots_used() const { return ring_.size(); }  // storage touched so far

 private:
  const size_t cap_;
  int64_t* const dropped_;
  std::vector<PendingEvent> ring_;
  size_t head_ = 0, count_ = 0;
};

}  // namespace tiering

// Thread-safety: touched only by the one scheduler thread that drives the BlockManager (no mutex,
// nothing to annotate); what it shares with the TransferManager's file worker stays behind the
// TransferManager's mutex (transfer_manager_impl.h), and finished work is learned from
// TransferBatch handles, which are thread-safe.
struct BlockManager::Impl {
  Impl(TransferManager& t, const BlockManagerOptions& o);

  TransferManager* const tm;
  const BlockManagerOptions opt;
  const int64_t tpb;
  const BlockKey root;
  SlabStore* const file;
  const int64_t block_bytes;
  tiering::KeyIndex index;  // every cached key: where it is, its chain links
  std::vector<tiering::Slot> slots[kNumTiers];
  tiering::PriorityLru lru[kNumTiers];
  std::vector<tiering::SlotLease> file_leases;  // by slot id: leases the index holds
  std::vector<int64_t> free_primary, free_host;
  using SeqMap = std::unordered_map<uint64_t, tiering::Sequence>;
  SeqMap seqs;
  // Allocation-free calls: the nodes of removed sequences (their vectors keep their capacity),
  // finished ops' item vectors, and the per-call lists, all reused (the engine's thread pays no
  // malloc or free per block once they have grown to a prompt's size).
  std::vector<SeqMap::node_type> spare_seqs;
  std::vector<std::vector<tiering::OpItem>> spare_items;
  static constexpr size_t kMaxSpares = 256;
  SeqMap::node_type NewSequence(uint64_t id);  // a recycled node (fields reset) or a new one
  void RecycleSequence(SeqMap::iterator it);
  tiering::Op NewOp(tiering::OpKind kind, Tier from);  // with a recycled item vector
  void RecycleOp(tiering::Op& op);
  struct Scratch {
    std::vector<BlockMove> from_host, from_file;  // PlaceAndOnboard
    std::vector<BlockMove> evict_moves;           // EvictPrimary
    std::vector<BlockMove> read_moves;            // StartFileRead
    std::vector<tiering::SlotLease> leases;
    std::vector<int64_t> fresh;    // AddSequence, AppendTokens
    std::vector<int64_t> victims;  // AllocatePrimary
  } scratch;
  // In flight, by lane (tiering::LaneOf): each lane finishes in submission order, so retiring
  // looks at the front of each and stops at its first unfinished op.
  std::deque<tiering::Op> ops[tiering::kLanes];
  std::deque<tiering::Op> deferred;  // file reads waiting for staging (batch not made yet)
  int64_t demoting = 0;              // host blocks in demotions in flight
  BlockManagerStats st;
  tiering::EventRing events{opt.max_events, &st.events_dropped};

  tiering::Slot& SlotOf(Tier t, int64_t id) { return slots[static_cast<int>(t)][id]; }
  const tiering::Slot& SlotOf(Tier t, int64_t id) const { return slots[static_cast<int>(t)][id]; }
  tiering::PriorityLru& Lru(Tier t) { return lru[static_cast<int>(t)]; }

  // Index bookkeeping (block_manager.cc).
  void Register(const BlockKey& key, const BlockKey& parent, std::span<const int32_t> tokens,
                Tier tier, int64_t id, int32_t priority, bool recovered = false);
  void Relocate(const BlockKey& key, Tier to, int64_t id);
  // Drops `key` from the cache; `reason` is a constant (static storage: nothing is formatted or
  // allocated) or, on error paths, its own text.
  void Drop(const BlockKey& key, const char* reason) { Drop(key, reason, {}); }
  void Drop(const BlockKey& key, std::string reason) { Drop(key, nullptr, std::move(reason)); }
  void Drop(const BlockKey& key, const char* why, std::string detail);
  bool IndexedAt(const BlockKey& key, Tier tier, int64_t id) const;
  void Lease(const tiering::Cached& c);
  void Unlease(Tier tier, int64_t id, int32_t priority);
  void Unref(int64_t b, int32_t priority);

  // AddSequence's steps (block_manager.cc), in order.
  struct Hit {
    Tier tier;
    int64_t id;
  };
  struct Candidate {  // a partially matching cached block
    BlockKey key;
    Tier tier = Tier::kPrimary;
    int64_t id = -1;
    int64_t tokens = 0;  // leading tokens it shares with the prompt's next block
    bool found() const { return id >= 0; }
  };
  std::vector<Hit> hits_scratch;
  // The walks over a prompt's keys (prefix lookup, storing the new blocks) prefetch the index
  // buckets this many keys ahead: each key's bucket is a random cache line, and a 100-block
  // prompt's misses then overlap instead of following one another.
  static constexpr size_t kPrefetchAhead = 8;
  // Fills `hits` (cleared first).
  void LeasePrefixHits(const tiering::Sequence& seq, std::vector<Hit>& hits);
  Candidate LeasePartialCandidate(const tiering::Sequence& seq, size_t matched, size_t nblocks);
  void UnleaseAll(const tiering::Sequence& seq, std::span<const Hit> hits, const Candidate& cand);
  void PlaceAndOnboard(tiering::Sequence& seq, std::span<const Hit> hits,
                       std::span<const int64_t> fresh, size_t nblocks, Admission& adm);
  void StartPartialCopy(tiering::Sequence& seq, const Candidate& cand);
  void StoreFullBlocks(const tiering::Sequence& seq, size_t first);

  // Movement (block_manager_io.cc). None of these waits.
  // Retires what finished and submits deferred reads: what Poll, RemoveSequence and PollReady do
  // first. The calls that allocate (AddSequence, AppendTokens, Prefetch) only submit deferred
  // reads and retire nothing: retiring is bookkeeping per item (relocation, slot lease handed to
  // the index, LRU) and a completion query per lane (a driver call on CUDA), measured as part of
  // the tiered mode's extra stall on the engine's thread. A finished op only holds its leases and
  // its batch state a little longer (until the next Poll).
  void RetireAndSubmit();
  // That, then the watermarks (Poll, RemoveSequence): moving victims down ahead of need stays off
  // the allocation path, whose stall the engine sees.
  void Maintain();
  void RetireFinished();
  // Whether `s`'s reused blocks hold their bytes, from what has been retired (no retiring).
  Readiness ReadinessOf(const tiering::Sequence& s) const;
  void Retire(tiering::Op& op);
  void SubmitDeferred();
  void RunWatermarks();
  int64_t Mark(int64_t blocks, int32_t pct) const { return (blocks * pct + 99) / 100; }
  // The largest allocation (blocks) since the last watermark run, and those of the last 32 runs:
  // the primary watermark keeps at least their maximum free (at most half the pool), so the next
  // allocation of that size, e.g. a prompt with many host hits, evicts nothing on its thread.
  int64_t need_now = 0;
  std::array<int64_t, 32> recent_need{};
  size_t recent_at = 0;
  Status AllocatePrimary(int64_t n, std::vector<int64_t>& out);
  void EvictPrimary(std::span<const int64_t> victims);
  int64_t FreeHostBlock();  // a free host block, dropping the host LRU victim if needed; -1
  // Evicted primary blocks straight to the file tier; returns the victims it could not take.
  std::vector<int64_t> Spill(std::span<const int64_t> victims);
  void Demote(int64_t count);
  tiering::SlotLease AcquireSlot();
  // Onboards `moves` (from host: stream; from file: read on the I/O thread, deferred while
  // staging is full). File moves need their slot leases in `leases` (same order).
  void Onboard(Tier from, std::span<const BlockMove> moves, std::span<tiering::SlotLease> leases,
               bool prefetch);
  void SubmitFileRead(tiering::Op op);  // now, or deferred behind earlier reads
  void StartFileRead(tiering::Op op);   // now (staging is free)
  void AddOp(tiering::Op op);
  // The TransferManager's submission plug, taken by the first batch a public call makes (Submit)
  // and released when the call returns (CallPlug, in every public call that can make batches):
  // one wake of the submit thread per call that made batches, and a call that makes none (most
  // AppendTokens) neither takes the manager's mutex, which the submit and I/O threads hold while
  // they order and plan batches, nor wakes anything. Outside a CallPlug, Submit does not plug.
  int call_depth = 0;
  bool plugged = false;
  class CallPlug {
   public:
    explicit CallPlug(Impl& m) : m_(m) { ++m_.call_depth; }
    ~CallPlug() {
      if (--m_.call_depth == 0 && m_.plugged) {
        m_.plugged = false;
        m_.tm->Unplug();
      }
    }
    CallPlug(const CallPlug&) = delete;
    CallPlug& operator=(const CallPlug&) = delete;

   private:
    Impl& m_;
  };
  // Runs `submit` (a TransferManager call that makes a batch, under the call's plug) and adds its
  // time to st.submit_ns.
  template <typename F>
  auto Submit(F&& submit) {
    if (call_depth > 0 && !plugged) {
      tm->Plug();
      plugged = true;
    }
    const Clock::time_point t0 = Clock::now();
    auto batch = submit();
    st.submit_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    return batch;
  }
};

}  // namespace kvferry

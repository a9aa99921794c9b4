// KeyIndex: the BlockManager's map from block key to where the block is cached (tier, id), with
// the chain's parent -> children links that partial reuse walks.
//
// Why not std::unordered_map + unordered_multimap (what it replaced): every AddSequence looks up,
// registers and drops keys for every block of the prompt (a 1,600-token prompt is 100 blocks), and
// those node-based maps cost a heap allocation per insert, a pointer chase per lookup and, past
// their load factor, a rehash of the whole table inside the call: the allocation stall's p99. Here
// keys sit in one open-addressing table (linear probing, backward-shift deletion, no tombstones)
// sized once for every block and slot of every tier (a key always occupies one of them); entries
// live in a vector reused through a free list (an entry's token vector keeps its capacity), and
// siblings are an intrusive doubly linked list headed in a second table keyed by the parent key,
// so a parent's children are found again after the parent itself was dropped and re-registered.
// Every entry is built at construction, its token vector reserved for a block's tokens, so that
// nothing is allocated or first touched per call: before, the entries were made as the cache first
// filled, a heap allocation per new key and a page fault every few dozen, on the engine's thread,
// for as long as it took the tiers to fill once (all of bench tiering's run in the tiered modes,
// whose working set stays below the index's capacity).
//
// Thread-compatible (the BlockManager's scheduler thread only).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "kvferry/tiering.h"

namespace kvferry::tiering {

// Where one cached key lives, and its place in the chain.
struct Cached {
  BlockKey key;
  Tier tier = Tier::kPrimary;
  int64_t id = -1;
  BlockKey parent;
  std::vector<int32_t> tokens;  // the block's tokens (empty when recovered)
  int32_t priority = 0;
  bool recovered = false;  // found in the file tier at open: parent and tokens unknown
  int32_t prev_sibling = -1, next_sibling = -1;  // entries with the same parent (not recovered)
};

// Open-addressing map BlockKey -> int32 (>= 0). Fixed capacity chosen at construction; grows
// (rehash) only if a caller exceeds it, which the BlockManager's invariant rules out.
class FlatKeyMap {
 public:
  explicit FlatKeyMap(int64_t capacity) { Rehash(capacity); }
  int64_t size() const { return size_; }
  // The value of `key`, or -1.
  int32_t Get(const BlockKey& key) const {
    for (size_t i = Home(key);; i = (i + 1) & mask_) {
      const Bucket& b = buckets_[i];
      if (b.value < 0) return -1;
      if (b.key == key) return b.value;
    }
  }
  // Starts loading the bucket where a lookup of `key` begins (a hint; no effect on contents).
  void Prefetch(const BlockKey& key) const { __builtin_prefetch(&buckets_[Home(key)]); }
  // Sets key -> value (inserting or overwriting).
  void Put(const BlockKey& key, int32_t value) {
    if ((size_ + 1) * 2 > static_cast<int64_t>(buckets_.size())) Rehash(size_ + 1);
    for (size_t i = Home(key);; i = (i + 1) & mask_) {
      Bucket& b = buckets_[i];
      if (b.value < 0) {
        b = Bucket{key, value};
        ++size_;
        return;
      }
      if (b.key == key) {
        b.value = value;
        return;
      }
    }
  }
  // Removes `key` if present (backward shift: no tombstones, lookups stay short).
  void Erase(const BlockKey& key) {
    size_t i = Home(key);
    for (;; i = (i + 1) & mask_) {
      if (buckets_[i].value < 0) return;
      if (buckets_[i].key == key) break;
    }
    for (size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      if (buckets_[j].value < 0) break;
      const size_t home = Home(buckets_[j].key);
      // Move j back into the hole at i unless its home lies cyclically in (i, j].
      const bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
      if (stays) continue;
      buckets_[i] = buckets_[j];
      i = j;
    }
    buckets_[i].value = -1;
    --size_;
  }

 private:
  struct Bucket {
    BlockKey key;
    int32_t value = -1;
  };
  size_t Home(const BlockKey& k) const {
    const uint64_t h = (k.lo ^ (k.hi * 0x9e3779b97f4a7c15ULL)) * 0x9e3779b97f4a7c15ULL;
    return static_cast<size_t>(h >> shift_);
  }
  void Rehash(int64_t capacity) {
    size_t n = 16;
    int bits = 4;
    while (n < static_cast<size_t>(capacity) * 2) {
      n *= 2;
      ++bits;
    }
    std::vector<Bucket> old;
    old.swap(buckets_);
    buckets_.assign(n, Bucket{});
    mask_ = n - 1;
    shift_ = 64 - bits;
    size_ = 0;
    for (const Bucket& b : old) {
      if (b.value >= 0) Put(b.key, b.value);
    }
  }

  std::vector<Bucket> buckets_;
  size_t mask_ = 0;
  int shift_ = 60;
  int64_t size_ = 0;
};

class KeyIndex {
 public:
  // `capacity`: the most keys held at once (blocks + slots of every tier); `tokens_per_entry`: the
  // tokens an entry's vector is reserved for (a block's).
  explicit KeyIndex(int64_t capacity, int64_t tokens_per_entry = 0)
      : keys_(capacity), heads_(capacity), entries_(static_cast<size_t>(capacity)) {
    free_.reserve(entries_.size());
    for (size_t e = entries_.size(); e-- > 0;) {  // entry 0 first
      entries_[e].tokens.reserve(static_cast<size_t>(tokens_per_entry));
      free_.push_back(static_cast<int32_t>(e));
    }
  }
  int64_t size() const { return keys_.size(); }
  Cached* Find(const BlockKey& key) {
    const int32_t e = keys_.Get(key);
    return e < 0 ? nullptr : &entries_[e];
  }
  const Cached* Find(const BlockKey& key) const {
    const int32_t e = keys_.Get(key);
    return e < 0 ? nullptr : &entries_[e];
  }
  bool Contains(const BlockKey& key) const { return keys_.Get(key) >= 0; }
  // Starts loading what a lookup of `key` and an insert under `parent` first touch: a walk over a
  // prompt's keys calls it a few keys ahead, so that the cache misses of those keys (random
  // buckets) overlap instead of following one another.
  void Prefetch(const BlockKey& key) const { keys_.Prefetch(key); }
  void PrefetchChildren(const BlockKey& parent) const { heads_.Prefetch(parent); }
  // The entry of a key the caller knows is cached (a broken invariant aborts).
  Cached& At(const BlockKey& key) {
    Cached* c = Find(key);
    if (c == nullptr) std::abort();
    return *c;
  }
  // Adds `key` (not cached yet); recovered entries join no sibling list.
  Cached& Insert(const BlockKey& key, const BlockKey& parent, std::span<const int32_t> tokens,
                 Tier tier, int64_t id, int32_t priority, bool recovered) {
    int32_t e;
    if (!free_.empty()) {
      e = free_.back();
      free_.pop_back();
    } else {
      e = static_cast<int32_t>(entries_.size());
      entries_.emplace_back();
    }
    Cached& c = entries_[e];
    c.key = key;
    c.tier = tier;
    c.id = id;
    c.parent = parent;
    c.tokens.assign(tokens.begin(), tokens.end());  // reuses the entry's capacity
    c.priority = priority;
    c.recovered = recovered;
    c.prev_sibling = c.next_sibling = -1;
    keys_.Put(key, e);
    if (!recovered) {
      const int32_t head = heads_.Get(parent);
      c.next_sibling = head;
      if (head >= 0) entries_[head].prev_sibling = e;
      heads_.Put(parent, e);
    }
    return c;
  }
  // Removes `key` if cached.
  void Erase(const BlockKey& key) {
    const int32_t e = keys_.Get(key);
    if (e < 0) return;
    Cached& c = entries_[e];
    if (!c.recovered) {
      if (c.next_sibling >= 0) entries_[c.next_sibling].prev_sibling = c.prev_sibling;
      if (c.prev_sibling >= 0) {
        entries_[c.prev_sibling].next_sibling = c.next_sibling;
      } else if (c.next_sibling >= 0) {
        heads_.Put(c.parent, c.next_sibling);
      } else {
        heads_.Erase(c.parent);
      }
    }
    keys_.Erase(key);
    free_.push_back(e);
  }
  // Calls fn(const Cached&) for every cached child of `parent` (not recovered ones).
  template <typename Fn>
  void ForEachChild(const BlockKey& parent, Fn&& fn) const {
    for (int32_t e = heads_.Get(parent); e >= 0; e = entries_[e].next_sibling) fn(entries_[e]);
  }

 private:
  FlatKeyMap keys_;   // key -> entry
  FlatKeyMap heads_;  // parent key -> first child entry
  std::vector<Cached> entries_;
  std::vector<int32_t> free_;
};

}  // namespace kvferry::tiering

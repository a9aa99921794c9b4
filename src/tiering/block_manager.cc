// BlockManager: see include/kvferry/block_manager.h for the contract.
#include "kvferry/block_manager.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "base/log.h"
#include "files/slab_store.h"
#include "kvferry/config.h"
#include "tiering/priority_lru.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvferry {

std::string_view KvEventKindName(KvEventKind kind) {
  switch (kind) {
    case KvEventKind::kStored:
      return "stored";
    case KvEventKind::kMoved:
      return "moved";
    case KvEventKind::kRemoved:
      return "removed";
  }
  return "?";
}

BlockManagerOptions BlockManagerOptions::FromConfig() {
  BlockManagerOptions o;
  const Config& c = Config::Global();
  o.offload_min_priority = static_cast<int32_t>(c.Int("tiering.offload_min_priority"));
  o.partial_reuse = c.Bool("tiering.partial_reuse");
  o.io_timeout = std::chrono::milliseconds(c.Int("tiering.io_timeout_ms"));
  return o;
}

namespace {

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutI64(std::string& out, int64_t v) { PutU64(out, static_cast<uint64_t>(v)); }

BlockKey FromXxh(XXH128_hash_t h) { return BlockKey{h.high64, h.low64}; }

constexpr uint64_t kKeySeed = 0x6b7666657272794bULL;  // "Kyrrefvk": format version 1 of keys

}  // namespace

BlockKey RootKey(const CacheIdentity& id) {
  // Every field explicitly, little-endian, length-prefixed where variable.
  std::string b = "kvferry-block-key-v1";
  PutU64(b, id.model_id.size());
  b += id.model_id;
  const KvShape& s = id.shape;
  for (int64_t v :
       {int64_t{s.layers}, int64_t{s.kv_heads}, int64_t{s.head_dim},
        int64_t{static_cast<int>(s.dtype)}, int64_t{s.kv_factor}, int64_t{s.tokens_per_block}}) {
    PutI64(b, v);
  }
  const ParallelConfig& p = id.parallel;
  for (int64_t v : {int64_t{p.tp}, int64_t{p.pp}, int64_t{p.dp_size}}) PutI64(b, v);
  PutU64(b, p.stage_layers.size());
  for (int32_t l : p.stage_layers) PutI64(b, l);
  const RankSlice& r = id.slice;
  for (int64_t v :
       {int64_t{r.tp_rank}, int64_t{r.pp_rank}, int64_t{r.dp_group}, int64_t{r.layer_begin},
        int64_t{r.layer_count}, int64_t{r.head_begin}, int64_t{r.head_count}}) {
    PutI64(b, v);
  }
  PutU64(b, id.salt);
  return FromXxh(XXH3_128bits_withSeed(b.data(), b.size(), kKeySeed));
}

BlockKey NextKey(const BlockKey& parent, std::span<const int32_t> tokens) {
  XXH3_state_t st;
  std::memset(&st, 0, sizeof(st));  // quiets -Wmaybe-uninitialized; reset sets every field
  XXH3_128bits_reset_withSeed(&st, kKeySeed);
  uint8_t pb[16];
  for (int i = 0; i < 8; ++i) {
    pb[i] = static_cast<uint8_t>(parent.hi >> (8 * i));
    pb[8 + i] = static_cast<uint8_t>(parent.lo >> (8 * i));
  }
  XXH3_128bits_update(&st, pb, sizeof(pb));
  for (int32_t t : tokens) {
    uint8_t tb[4];
    for (int i = 0; i < 4; ++i) tb[i] = static_cast<uint8_t>(static_cast<uint32_t>(t) >> (8 * i));
    XXH3_128bits_update(&st, tb, 4);
  }
  return FromXxh(XXH3_128bits_digest(&st));
}

namespace {

struct KeyHash {
  size_t operator()(const BlockKey& k) const {
    return static_cast<size_t>(k.lo ^ (k.hi * 0x9e3779b97f4a7c15ULL));
  }
};

struct Cached {
  Tier tier;
  int64_t id;
  BlockKey parent;
  std::vector<int32_t> tokens;
  int32_t priority;
};

struct Slot {
  bool has_key = false;
  BlockKey key;
  int32_t refs = 0;  // primary only: sequences referencing the block
};

struct Sequence {
  std::vector<int32_t> tokens;
  std::vector<int64_t> blocks;
  std::vector<BlockKey> keys;  // of the full blocks
  int32_t priority;
};

}  // namespace

struct BlockManager::Impl {
  TransferManager* tm;
  BlockManagerOptions opt;
  int64_t tpb;
  BlockKey root;
  SlabStore* file;
  std::unordered_map<BlockKey, Cached, KeyHash> index;
  std::unordered_multimap<BlockKey, BlockKey, KeyHash> children;
  std::vector<Slot> slots[kNumTiers];
  tiering::PriorityLru lru[kNumTiers];
  std::vector<int64_t> free_primary, free_host;
  std::unordered_map<uint64_t, Sequence> seqs;
  std::vector<KvEvent> events;
  BlockManagerStats st;

  Impl(TransferManager& t, const BlockManagerOptions& o)
      : tm(&t),
        opt(o),
        tpb(t.primary().shape().tokens_per_block),
        root(RootKey(o.identity)),
        file(t.file()),
        lru{tiering::PriorityLru(t.tier_blocks(Tier::kPrimary)),
            tiering::PriorityLru(t.tier_blocks(Tier::kHost)),
            tiering::PriorityLru(t.tier_blocks(Tier::kFile))} {
    for (int i = 0; i < kNumTiers; ++i) slots[i].resize(t.tier_blocks(static_cast<Tier>(i)));
    for (int64_t b = t.tier_blocks(Tier::kPrimary) - 1; b >= 0; --b) free_primary.push_back(b);
    for (int64_t b = t.tier_blocks(Tier::kHost) - 1; b >= 0; --b) free_host.push_back(b);
  }

  Deadline IoDeadline() const { return Clock::now() + opt.io_timeout; }
  Slot& SlotOf(Tier t, int64_t id) { return slots[static_cast<int>(t)][id]; }
  tiering::PriorityLru& Lru(Tier t) { return lru[static_cast<int>(t)]; }

  void Register(const BlockKey& key, const BlockKey& parent, std::span<const int32_t> tokens,
                Tier tier, int64_t id, int32_t priority) {
    index.emplace(key, Cached{tier, id, parent, {tokens.begin(), tokens.end()}, priority});
    children.emplace(parent, key);
    Slot& s = SlotOf(tier, id);
    s.has_key = true;
    s.key = key;
    ++st.cached[static_cast<int>(tier)];
    events.push_back(KvEvent{KvEventKind::kStored, key, tier, tier, ""});
  }

  // The key's bytes now live at (to, id); the old place no longer holds the key.
  void Relocate(const BlockKey& key, Tier to, int64_t id) {
    Cached& c = index.at(key);
    SlotOf(c.tier, c.id).has_key = false;
    --st.cached[static_cast<int>(c.tier)];
    events.push_back(KvEvent{KvEventKind::kMoved, key, c.tier, to, ""});
    c.tier = to;
    c.id = id;
    Slot& s = SlotOf(to, id);
    s.has_key = true;
    s.key = key;
    ++st.cached[static_cast<int>(to)];
  }

  // Forgets a cached key. The caller owns what happens to its storage.
  void Drop(const BlockKey& key, std::string reason) {
    auto it = index.find(key);
    if (it == index.end()) return;
    const Tier tier = it->second.tier;
    SlotOf(tier, it->second.id).has_key = false;
    auto [b, e] = children.equal_range(it->second.parent);
    for (auto c = b; c != e; ++c) {
      if (c->second == key) {
        children.erase(c);
        break;
      }
    }
    index.erase(it);
    --st.cached[static_cast<int>(tier)];
    ++st.dropped[static_cast<int>(tier)];
    events.push_back(KvEvent{KvEventKind::kRemoved, key, tier, tier, std::move(reason)});
  }

  // A file slot for a demotion: a free one, or the file tier's victim (dropped). -1 if none.
  int64_t AcquireSlot() {
    auto s = file->Allocate();
    if (s.ok()) return *s;
    int64_t v = Lru(Tier::kFile).PopVictim();
    if (v < 0) return -1;
    Drop(SlotOf(Tier::kFile, v).key, "evicted from the file tier, the last tier");
    return v;
  }

  // Frees `count` host blocks by demoting host victims to the file tier (or dropping them when
  // there is no file tier). Waits for the file writes: a failed write keeps the block in the host
  // tier. Appends the freed host blocks to free_host.
  void DemoteHost(int64_t count) {
    std::vector<BlockMove> moves;
    std::vector<int64_t> victims;
    for (int64_t i = 0; i < count; ++i) {
      int64_t h = Lru(Tier::kHost).PopVictim();
      if (h < 0) break;
      const BlockKey key = SlotOf(Tier::kHost, h).key;
      int64_t slot = file ? AcquireSlot() : -1;
      if (slot < 0) {
        Drop(key, file ? "evicted from the host tier; the file tier is full of leased slots"
                       : "evicted from the host tier, the last tier");
        free_host.push_back(h);
        continue;
      }
      moves.emplace_back(h, slot, 0, key);
    }
    const size_t chunk = static_cast<size_t>(std::max<int64_t>(tm->file_staging_blocks(), 1));
    for (size_t at = 0; at < moves.size(); at += chunk) {
      std::span<const BlockMove> part(moves.data() + at, std::min(chunk, moves.size() - at));
      auto batch = tm->Move(Tier::kHost, Tier::kFile, part);
      Status all = batch.ok() ? batch->Wait(IoDeadline()) : batch.status();
      for (size_t i = 0; i < part.size(); ++i) {
        const BlockMove& m = part[i];
        Status item = !batch.ok()                                   ? all
                      : all.code() == StatusCode::kDeadlineExceeded ? all
                                                                    : batch->items()[i];
        const int32_t prio = index.at(m.key).priority;
        if (item.ok()) {
          Relocate(m.key, Tier::kFile, m.dst);
          Lru(Tier::kFile).Push(m.dst, prio);
          free_host.push_back(m.src);
          ++st.demoted;
        } else {
          Log(LogLevel::kWarn, "tiering: demotion of host block {} failed, it stays: {}", m.src,
              item.ToString());
          file->Release(m.dst);
          Lru(Tier::kHost).Push(m.src, prio);
          ++st.write_failures;
        }
      }
    }
  }

  // Offloads (or drops) evicted primary blocks; their keys leave the primary tier.
  void EvictPrimary(std::span<const int64_t> victims) {
    std::vector<int64_t> offload;
    for (int64_t v : victims) {
      const BlockKey key = SlotOf(Tier::kPrimary, v).key;
      if (!tm->has_tier(Tier::kHost)) {
        Drop(key, "evicted from the primary tier, the last tier");
      } else if (index.at(key).priority < opt.offload_min_priority) {
        Drop(key, fmt::format("evicted from the primary tier; priority {} is below "
                              "offload_min_priority {}",
                              index.at(key).priority, opt.offload_min_priority));
      } else {
        offload.push_back(v);
      }
    }
    if (offload.empty()) return;
    const int64_t short_by =
        static_cast<int64_t>(offload.size()) - static_cast<int64_t>(free_host.size());
    if (short_by > 0) DemoteHost(short_by);
    std::vector<BlockMove> moves;
    for (int64_t v : offload) {
      const BlockKey key = SlotOf(Tier::kPrimary, v).key;
      if (free_host.empty()) {
        Drop(key, "evicted from the primary tier; no host block could be freed");
        continue;
      }
      int64_t h = free_host.back();
      free_host.pop_back();
      moves.emplace_back(v, h, 0, key);
    }
    if (moves.empty()) return;
    if (opt.compute != nullptr) {
      Status st = tm->WaitForCompute(*opt.compute);
      if (!st.ok()) Log(LogLevel::kError, "tiering: WaitForCompute failed: {}", st.ToString());
    }
    auto batch = tm->Offload(Tier::kHost, moves);
    for (const BlockMove& m : moves) {
      if (!batch.ok()) {  // a programming error: keep the books straight anyway
        Drop(m.key, batch.status().ToString());
        free_host.push_back(m.dst);
        continue;
      }
      Relocate(m.key, Tier::kHost, m.dst);
      Lru(Tier::kHost).Push(m.dst, index.at(m.key).priority);
      ++st.offloaded;
    }
  }

  // `n` primary blocks with refs = 1, evicting as needed. Nothing changes on error.
  Status AllocatePrimary(int64_t n, std::vector<int64_t>& out) {
    const int64_t avail = static_cast<int64_t>(free_primary.size()) + Lru(Tier::kPrimary).size();
    if (n > avail) {
      return Status::ResourceExhausted(fmt::format(
          "block manager: need {} primary blocks, {} are free or evictable (the other {} are "
          "referenced)",
          n, avail, tm->tier_blocks(Tier::kPrimary) - avail));
    }
    std::vector<int64_t> victims;
    for (int64_t i = 0; i < n; ++i) {
      int64_t b;
      if (!free_primary.empty()) {
        b = free_primary.back();
        free_primary.pop_back();
      } else {
        b = Lru(Tier::kPrimary).PopVictim();
        victims.push_back(b);
      }
      out.push_back(b);
    }
    EvictPrimary(victims);
    for (int64_t b : out) {
      SlotOf(Tier::kPrimary, b).has_key = false;
      SlotOf(Tier::kPrimary, b).refs = 1;
    }
    return Status::Ok();
  }

  void Unref(int64_t b, int32_t priority) {
    Slot& s = SlotOf(Tier::kPrimary, b);
    if (--s.refs > 0) return;
    if (s.has_key) {
      Cached& c = index.at(s.key);
      c.priority = std::max(c.priority, priority);
      Lru(Tier::kPrimary).Push(b, c.priority);
    } else {
      free_primary.push_back(b);
    }
  }

  // Stores full blocks [from, keys.size()) of a sequence that are not cached yet.
  void StoreFull(Sequence& s, size_t from) {
    for (size_t i = from; i < s.keys.size(); ++i) {
      if (index.count(s.keys[i])) continue;
      const BlockKey parent = i == 0 ? root : s.keys[i - 1];
      std::span<const int32_t> toks(s.tokens.data() + i * tpb, static_cast<size_t>(tpb));
      Register(s.keys[i], parent, toks, Tier::kPrimary, s.blocks[i], s.priority);
    }
  }

  void ExtendKeys(Sequence& s) {
    const size_t full = s.tokens.size() / static_cast<size_t>(tpb);
    while (s.keys.size() < full) {
      const size_t i = s.keys.size();
      std::span<const int32_t> toks(s.tokens.data() + i * tpb, static_cast<size_t>(tpb));
      s.keys.push_back(NextKey(i == 0 ? root : s.keys[i - 1], toks));
    }
  }

  // Leases a cached block (takes it out of its LRU); primary blocks get a reference.
  void Lease(const Cached& c) {
    if (c.tier == Tier::kPrimary) {
      Slot& s = SlotOf(Tier::kPrimary, c.id);
      if (s.refs++ == 0) Lru(Tier::kPrimary).Remove(c.id);
    } else {
      Lru(c.tier).Remove(c.id);
    }
  }
  void Unlease(Tier tier, int64_t id, int32_t priority) {
    if (tier == Tier::kPrimary) {
      Unref(id, priority);
    } else {
      Lru(tier).Push(id, priority);
    }
  }
};

BlockManager::BlockManager(TransferManager& transfers, std::unique_ptr<Impl> impl)
    : transfers_(transfers), impl_(std::move(impl)) {}
BlockManager::~BlockManager() = default;

StatusOr<std::unique_ptr<BlockManager>> BlockManager::Create(TransferManager& transfers,
                                                             const BlockManagerOptions& options) {
  const KvShape& pool = transfers.primary().shape();
  if (!(options.identity.shape == pool)) {
    return Status::InvalidArgument(
        fmt::format("block manager: the identity's KV shape {} differs from the primary pool's {}",
                    options.identity.shape.ToString(), pool.ToString()));
  }
  if (options.offload_min_priority < kMinPriority ||
      options.offload_min_priority > kMaxPriority + 1) {
    return Status::InvalidArgument(fmt::format(
        "block manager: offload_min_priority={} outside [0, 101]", options.offload_min_priority));
  }
  return std::unique_ptr<BlockManager>(
      new BlockManager(transfers, std::make_unique<Impl>(transfers, options)));
}

StatusOr<Admission> BlockManager::AddSequence(uint64_t id, std::span<const int32_t> prompt,
                                              int32_t priority) {
  Impl& m = *impl_;
  if (m.seqs.count(id)) {
    return Status::InvalidArgument(fmt::format("sequence {} already exists", id));
  }
  if (priority < kMinPriority || priority > kMaxPriority) {
    return Status::InvalidArgument(fmt::format("priority {} outside [0, 100]", priority));
  }
  const int64_t tpb = m.tpb;
  Sequence seq;
  seq.tokens.assign(prompt.begin(), prompt.end());
  seq.priority = priority;
  m.ExtendKeys(seq);
  const size_t full = seq.keys.size();
  const size_t nblocks = (prompt.size() + tpb - 1) / tpb;

  // 1. Walk the chain, leasing every hit.
  struct Hit {
    Tier tier;
    int64_t id;
  };
  std::vector<Hit> hits;
  for (size_t i = 0; i < full; ++i) {
    auto it = m.index.find(seq.keys[i]);
    ++m.st.lookups;
    if (it == m.index.end()) break;
    m.Lease(it->second);
    hits.push_back({it->second.tier, it->second.id});
  }
  size_t matched = hits.size();
  // 2. Partial reuse: the cached child of the last match sharing the most leading tokens.
  const Cached* cand = nullptr;
  BlockKey cand_key;
  int64_t cand_tokens = 0;
  if (m.opt.partial_reuse && matched < nblocks) {
    const BlockKey parent = matched == 0 ? m.root : seq.keys[matched - 1];
    const size_t base = matched * tpb;
    const size_t want = std::min<size_t>(tpb, prompt.size() - base);
    auto [b, e] = m.children.equal_range(parent);
    for (auto c = b; c != e; ++c) {
      const Cached& cc = m.index.at(c->second);
      size_t n = 0;
      while (n < want && cc.tokens[n] == prompt[base + n]) ++n;
      if (static_cast<int64_t>(n) > cand_tokens) {
        cand_tokens = static_cast<int64_t>(n);
        cand = &cc;
        cand_key = c->second;
      }
    }
    if (cand != nullptr) m.Lease(*cand);
  }
  Tier cand_tier = cand ? cand->tier : Tier::kPrimary;
  int64_t cand_id = cand ? cand->id : -1;
  auto unlease_all = [&] {
    for (size_t i = 0; i < hits.size(); ++i) {
      m.Unlease(hits[i].tier, hits[i].id, m.index.at(seq.keys[i]).priority);
    }
    if (cand) m.Unlease(cand_tier, cand_id, m.index.at(cand_key).priority);
  };
  // 3. Allocate everything that is not a primary hit.
  int64_t primary_hits = 0;
  for (const Hit& h : hits) primary_hits += h.tier == Tier::kPrimary;
  std::vector<int64_t> fresh;
  Status alloc = m.AllocatePrimary(static_cast<int64_t>(nblocks) - primary_hits, fresh);
  if (!alloc.ok()) {
    unlease_all();
    return alloc;
  }
  Admission adm;
  size_t next_fresh = 0;
  std::vector<BlockMove> from_host, from_file;
  std::vector<size_t> file_pos;
  for (size_t i = 0; i < nblocks; ++i) {
    if (i < matched && hits[i].tier == Tier::kPrimary) {
      seq.blocks.push_back(hits[i].id);
      ++adm.hits[0];
      continue;
    }
    const int64_t b = fresh[next_fresh++];
    seq.blocks.push_back(b);
    if (i < matched) {
      BlockMove mv(hits[i].id, b, 0, seq.keys[i]);
      if (hits[i].tier == Tier::kHost) {
        from_host.push_back(mv);
      } else {
        from_file.push_back(mv);
        file_pos.push_back(i);
      }
    }
  }
  // 4. Onboard: host hits in one batch (asynchronous), file hits waited for (a corrupt slot is
  // a miss).
  size_t usable = matched;
  if (!from_host.empty()) {
    auto batch = m.tm->Onboard(Tier::kHost, from_host);
    for (const BlockMove& mv : from_host) {
      if (!batch.ok()) {  // programming error; count as a miss
        adm.misses.push_back(batch.status().ToString());
        m.Lru(Tier::kHost).Push(mv.src, m.index.at(mv.key).priority);
        continue;
      }
      m.Relocate(mv.key, Tier::kPrimary, mv.dst);
      m.free_host.push_back(mv.src);
      ++adm.hits[1];
      ++m.st.onboarded;
    }
    if (!batch.ok()) usable = 0;
  }
  const size_t chunk = static_cast<size_t>(std::max<int64_t>(m.tm->file_staging_blocks(), 1));
  for (size_t at = 0; at < from_file.size(); at += chunk) {
    std::span<const BlockMove> part(from_file.data() + at, std::min(chunk, from_file.size() - at));
    auto batch = m.tm->Onboard(Tier::kFile, part);
    Status all = batch.ok() ? batch->Wait(m.IoDeadline()) : batch.status();
    for (size_t i = 0; i < part.size(); ++i) {
      const BlockMove& mv = part[i];
      Status item =
          !batch.ok() || all.code() == StatusCode::kDeadlineExceeded ? all : batch->items()[i];
      if (item.ok()) {
        m.Relocate(mv.key, Tier::kPrimary, mv.dst);
        m.file->Release(mv.src);
        ++adm.hits[2];
        ++m.st.onboarded;
      } else {
        adm.misses.push_back(item.ToString());
        m.Drop(mv.key, fmt::format("onboard from the file tier failed: {}", item.ToString()));
        m.file->Release(mv.src);
        ++m.st.corrupt_reads;
        usable = std::min(usable, file_pos[at + i]);
      }
    }
  }
  for (int t = 0; t < kNumTiers; ++t) m.st.hits[t] += adm.hits[t];
  adm.reused_tokens = static_cast<int64_t>(usable) * tpb;
  // 5. Partial copy of the candidate into the next block.
  if (cand) {
    if (usable == matched && cand_tokens > 0) {
      BlockMove mv(cand_id, seq.blocks[matched], static_cast<int32_t>(cand_tokens), cand_key);
      auto batch = m.tm->Move(cand_tier, Tier::kPrimary, std::span<const BlockMove>(&mv, 1));
      Status ok = batch.status();
      if (ok.ok() && cand_tier == Tier::kFile) ok = batch->Wait(m.IoDeadline());
      if (ok.ok()) {
        adm.partial_tokens = cand_tokens;
        adm.reused_tokens += cand_tokens;
        ++m.st.partial_copies;
      } else {
        adm.misses.push_back(ok.ToString());
      }
    }
    m.Unlease(cand_tier, cand_id, m.index.at(cand_key).priority);
  }
  adm.reused_tokens = std::min<int64_t>(adm.reused_tokens, static_cast<int64_t>(prompt.size()));
  // 6. Store the prompt's full blocks not cached yet.
  m.StoreFull(seq, 0);
  adm.blocks = seq.blocks;
  m.seqs.emplace(id, std::move(seq));
  return adm;
}

Status BlockManager::AppendTokens(uint64_t id, std::span<const int32_t> tokens) {
  Impl& m = *impl_;
  auto it = m.seqs.find(id);
  if (it == m.seqs.end()) return Status::NotFound(fmt::format("sequence {} does not exist", id));
  Sequence& s = it->second;
  const size_t need = (s.tokens.size() + tokens.size() + m.tpb - 1) / m.tpb;
  std::vector<int64_t> fresh;
  if (need > s.blocks.size()) {
    KVF_RETURN_IF_ERROR(m.AllocatePrimary(static_cast<int64_t>(need - s.blocks.size()), fresh));
  }
  s.blocks.insert(s.blocks.end(), fresh.begin(), fresh.end());
  s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
  const size_t before = s.keys.size();
  m.ExtendKeys(s);
  m.StoreFull(s, before);
  return Status::Ok();
}

Status BlockManager::RemoveSequence(uint64_t id) {
  Impl& m = *impl_;
  auto it = m.seqs.find(id);
  if (it == m.seqs.end()) return Status::NotFound(fmt::format("sequence {} does not exist", id));
  for (int64_t b : it->second.blocks) m.Unref(b, it->second.priority);
  m.seqs.erase(it);
  return Status::Ok();
}

StatusOr<std::vector<int64_t>> BlockManager::Blocks(uint64_t id) const {
  auto it = impl_->seqs.find(id);
  if (it == impl_->seqs.end()) {
    return Status::NotFound(fmt::format("sequence {} does not exist", id));
  }
  return it->second.blocks;
}

std::vector<KvEvent> BlockManager::DrainEvents() {
  std::vector<KvEvent> out;
  out.swap(impl_->events);
  return out;
}

BlockManagerStats BlockManager::stats() const {
  BlockManagerStats s = impl_->st;
  s.free_primary = static_cast<int64_t>(impl_->free_primary.size());
  s.free_host = static_cast<int64_t>(impl_->free_host.size());
  return s;
}

StatusOr<std::pair<Tier, int64_t>> BlockManager::Find(const BlockKey& key) const {
  auto it = impl_->index.find(key);
  if (it == impl_->index.end()) {
    return Status::NotFound(fmt::format("key {:016x}{:016x} is not cached", key.hi, key.lo));
  }
  return std::make_pair(it->second.tier, it->second.id);
}

}  // namespace kvferry

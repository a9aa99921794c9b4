// BlockManager: see include/kvferry/block_manager.h for the contract. This file: the index,
// sequences and prefix lookup, and the public calls; block_manager_io.cc moves the blocks.
#include "kvferry/block_manager.h"

#include <fmt/format.h>

#include <algorithm>
#include <thread>

#include "base/log.h"
#include "kvferry/config.h"
#include "tiering/block_manager_impl.h"

namespace kvferry {
using tiering::Cached;
using tiering::OpKind;
using tiering::Sequence;
using tiering::SlotLease;

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
  o.free_low_pct = static_cast<int32_t>(c.Int("tiering.free_low_pct"));
  o.free_high_pct = static_cast<int32_t>(c.Int("tiering.free_high_pct"));
  o.max_events = c.Int("tiering.max_events");
  return o;
}

BlockManager::Impl::Impl(TransferManager& t, const BlockManagerOptions& o)
    : tm(&t),
      opt(o),
      tpb(t.primary().shape().tokens_per_block),
      root(RootKey(o.identity)),
      file(t.file()),
      block_bytes(t.primary().layout().block_bytes()),
      index(t.tier_blocks(Tier::kPrimary) + t.tier_blocks(Tier::kHost) + t.tier_blocks(Tier::kFile),
            t.primary().shape().tokens_per_block),
      lru{tiering::PriorityLru(t.tier_blocks(Tier::kPrimary)),
          tiering::PriorityLru(t.tier_blocks(Tier::kHost)),
          tiering::PriorityLru(t.tier_blocks(Tier::kFile))} {
  for (int i = 0; i < kNumTiers; ++i) slots[i].resize(t.tier_blocks(static_cast<Tier>(i)));
  file_leases.resize(static_cast<size_t>(t.tier_blocks(Tier::kFile)));
  for (int64_t b = t.tier_blocks(Tier::kPrimary) - 1; b >= 0; --b) free_primary.push_back(b);
  for (int64_t b = t.tier_blocks(Tier::kHost) - 1; b >= 0; --b) free_host.push_back(b);
  if (file == nullptr) return;
  // A file tier that survived a restart: its verified slots are cached blocks again, found by key
  // (no parent or tokens: no partial reuse from them). Slots of another block size are reclaimed.
  for (const RecoveredSlot& r : file->Recovered()) {
    const BlockKey key{r.key.hi, r.key.lo};
    if (r.bytes != block_bytes || r.slot < 0 || r.slot >= t.tier_blocks(Tier::kFile) ||
        index.Contains(key)) {
      file->Release(r.slot);
      continue;
    }
    Register(key, BlockKey{}, {}, Tier::kFile, r.slot, kDefaultPriority, /*recovered=*/true);
    file_leases[r.slot] = SlotLease(file, r.slot);
    Lru(Tier::kFile).Push(r.slot, kDefaultPriority);
    ++st.recovered;
  }
}

void BlockManager::Impl::Register(const BlockKey& key, const BlockKey& parent,
                                  std::span<const int32_t> tokens, Tier tier, int64_t id,
                                  int32_t priority, bool recovered) {
  index.Insert(key, parent, tokens, tier, id, priority, recovered);
  tiering::Slot& s = SlotOf(tier, id);
  s.has_key = true;
  s.key = key;
  ++st.cached[static_cast<int>(tier)];
  events.Push({KvEventKind::kStored, key, tier, tier});
}

void BlockManager::Impl::Relocate(const BlockKey& key, Tier to, int64_t id) {
  Cached& c = index.At(key);
  SlotOf(c.tier, c.id).has_key = false;
  --st.cached[static_cast<int>(c.tier)];
  events.Push({KvEventKind::kMoved, key, c.tier, to});
  c.tier = to;
  c.id = id;
  tiering::Slot& s = SlotOf(to, id);
  s.has_key = true;
  s.key = key;
  ++st.cached[static_cast<int>(to)];
}

void BlockManager::Impl::Drop(const BlockKey& key, const char* why, std::string detail) {
  const Cached* c = index.Find(key);
  if (c == nullptr) return;
  const Tier tier = c->tier;
  const int64_t id = c->id;
  SlotOf(tier, id).has_key = false;
  if (tier == Tier::kFile) file_leases[id].Reset();  // no-op while an operation holds the slot
  index.Erase(key);
  --st.cached[static_cast<int>(tier)];
  ++st.dropped[static_cast<int>(tier)];
  events.Push({KvEventKind::kRemoved, key, tier, tier, why, std::move(detail)});
}

bool BlockManager::Impl::IndexedAt(const BlockKey& key, Tier tier, int64_t id) const {
  const Cached* c = index.Find(key);
  return c != nullptr && c->tier == tier && c->id == id;
}

void BlockManager::Impl::Lease(const Cached& c) {
  if (c.tier == Tier::kPrimary) {
    tiering::Slot& s = SlotOf(Tier::kPrimary, c.id);
    if (s.refs++ == 0) Lru(Tier::kPrimary).Remove(c.id);
  } else {
    Lru(c.tier).Remove(c.id);
  }
}

void BlockManager::Impl::Unlease(Tier tier, int64_t id, int32_t priority) {
  if (tier == Tier::kPrimary) {
    Unref(id, priority);
  } else if (!SlotOf(tier, id).busy) {
    Lru(tier).Push(id, priority);
  }
}

void BlockManager::Impl::Unref(int64_t b, int32_t priority) {
  tiering::Slot& s = SlotOf(Tier::kPrimary, b);
  if (--s.refs > 0) return;
  if (s.arriving) return;  // the read's retirement queues or frees it
  if (s.has_key) {
    Cached& c = index.At(s.key);
    c.priority = std::max(c.priority, priority);
    Lru(Tier::kPrimary).Push(b, c.priority);
  } else {
    s.failed = false;
    free_primary.push_back(b);
  }
}

BlockManager::Impl::SeqMap::node_type BlockManager::Impl::NewSequence(uint64_t id) {
  if (spare_seqs.empty()) {
    SeqMap one;
    one.emplace(id, Sequence{});
    return one.extract(one.begin());
  }
  SeqMap::node_type node = std::move(spare_seqs.back());
  spare_seqs.pop_back();
  node.key() = id;
  Sequence& s = node.mapped();  // as new, the vectors keeping their capacity
  s.tokens.clear();
  s.blocks.clear();
  s.keys.clear();
  s.misses.clear();
  s.priority = kDefaultPriority;
  s.matched = 0;
  s.partial_tokens = 0;
  s.prompt_tokens = 0;
  return node;
}

void BlockManager::Impl::RecycleSequence(SeqMap::iterator it) {
  SeqMap::node_type node = seqs.extract(it);
  if (spare_seqs.size() < kMaxSpares) spare_seqs.push_back(std::move(node));  // else freed
}

tiering::Op BlockManager::Impl::NewOp(OpKind kind, Tier from) {
  tiering::Op op;
  op.kind = kind;
  op.from = from;
  if (!spare_items.empty()) {
    op.items = std::move(spare_items.back());
    spare_items.pop_back();
  }
  return op;
}

void BlockManager::Impl::RecycleOp(tiering::Op& op) {
  if (spare_items.size() >= kMaxSpares || op.items.capacity() == 0) return;
  op.items.clear();  // releases the leases the retirement did not hand on
  spare_items.push_back(std::move(op.items));
}

namespace {

void ExtendKeys(Sequence& s, const BlockKey& root, int64_t tpb) {
  const size_t full = s.tokens.size() / static_cast<size_t>(tpb);
  while (s.keys.size() < full) {
    const size_t i = s.keys.size();
    std::span<const int32_t> toks(s.tokens.data() + i * tpb, static_cast<size_t>(tpb));
    s.keys.push_back(NextKey(i == 0 ? root : s.keys[i - 1], toks));
  }
}

}  // namespace

BlockManager::BlockManager(TransferManager& transfers, std::unique_ptr<Impl> impl)
    : transfers_(transfers), impl_(std::move(impl)) {}

BlockManager::~BlockManager() {
  // Leases go back only after their I/O: wait for every batch before the ops are destroyed.
  Status st = transfers_.Drain(Clock::now() + std::chrono::hours(1));
  if (!st.ok()) Log(LogLevel::kError, "block manager: draining at exit: {}", st.ToString());
  impl_->deferred.clear();
  impl_->RetireFinished();
}

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
  if (options.free_low_pct < 0 || options.free_high_pct < options.free_low_pct ||
      options.free_high_pct > 100) {
    return Status::InvalidArgument(
        fmt::format("block manager: watermarks free_low_pct={} free_high_pct={}: need 0 <= low <= "
                    "high <= 100",
                    options.free_low_pct, options.free_high_pct));
  }
  if (options.max_events < 1) {
    return Status::InvalidArgument(
        fmt::format("block manager: max_events={} must be at least 1", options.max_events));
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
  Impl::CallPlug plug(m);  // one wake of the submit thread per call that makes batches
  m.SubmitDeferred();      // retiring and the watermarks: Poll, RemoveSequence, PollReady
  const size_t nblocks = (prompt.size() + m.tpb - 1) / m.tpb;
  Impl::SeqMap::node_type node = m.NewSequence(id);
  Sequence& seq = node.mapped();
  seq.tokens.assign(prompt.begin(), prompt.end());
  seq.priority = priority;
  seq.prompt_tokens = static_cast<int64_t>(prompt.size());
  seq.keys.reserve(nblocks);
  seq.blocks.reserve(nblocks);
  ExtendKeys(seq, m.root, m.tpb);
  std::vector<Impl::Hit>& hits = m.hits_scratch;
  m.LeasePrefixHits(seq, hits);
  const Impl::Candidate cand = m.LeasePartialCandidate(seq, hits.size(), nblocks);
  int64_t primary_hits = 0;
  for (const Impl::Hit& h : hits) primary_hits += h.tier == Tier::kPrimary;
  std::vector<int64_t>& fresh = m.scratch.fresh;
  fresh.clear();
  Status alloc = m.AllocatePrimary(static_cast<int64_t>(nblocks) - primary_hits, fresh);
  if (!alloc.ok()) {
    m.UnleaseAll(seq, hits, cand);
    if (m.spare_seqs.size() < Impl::kMaxSpares) m.spare_seqs.push_back(std::move(node));
    return alloc;
  }
  Admission adm;
  m.PlaceAndOnboard(seq, hits, fresh, nblocks, adm);
  m.StartPartialCopy(seq, cand);
  m.StoreFullBlocks(seq, seq.matched);
  adm.blocks = seq.blocks;
  adm.partial_tokens = seq.partial_tokens;
  adm.reused_tokens =
      std::min<int64_t>(static_cast<int64_t>(seq.matched) * m.tpb + seq.partial_tokens,
                        static_cast<int64_t>(prompt.size()));
  adm.misses = seq.misses;
  const Sequence& placed = m.seqs.insert(std::move(node)).position->second;
  const Readiness r = m.ReadinessOf(placed);  // from what has been retired (PollReady: all)
  adm.ready = r.ready;
  if (adm.ready) {
    adm.reused_tokens = r.reused_tokens;
    adm.misses = r.misses;
  }
  return adm;
}

// Walks the prompt's key chain while it is cached (not in a file slot being read), leasing
// every hit so nothing evicts it meanwhile.
void BlockManager::Impl::LeasePrefixHits(const Sequence& seq, std::vector<Hit>& hits) {
  hits.clear();
  const std::vector<BlockKey>& keys = seq.keys;
  for (size_t i = 0; i < std::min(kPrefetchAhead, keys.size()); ++i) index.Prefetch(keys[i]);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i + kPrefetchAhead < keys.size()) index.Prefetch(keys[i + kPrefetchAhead]);
    const BlockKey& key = keys[i];
    const Cached* c = index.Find(key);
    ++st.lookups;
    if (c == nullptr) break;
    if (c->tier == Tier::kFile && SlotOf(Tier::kFile, c->id).busy) break;
    Lease(*c);
    hits.push_back({c->tier, c->id});
  }
}

// Partial reuse: the cached child of the last match sharing the most leading tokens with the
// prompt's next block (not one whose own bytes are still arriving, nor a file slot being read),
// leased; none when partial reuse is off or nothing shares a token.
BlockManager::Impl::Candidate BlockManager::Impl::LeasePartialCandidate(const Sequence& seq,
                                                                        size_t matched,
                                                                        size_t nblocks) {
  Candidate best;
  if (!opt.partial_reuse || matched >= nblocks) return best;
  const BlockKey parent = matched == 0 ? root : seq.keys[matched - 1];
  const size_t base = matched * tpb;
  const size_t want = std::min<size_t>(tpb, seq.tokens.size() - base);
  index.ForEachChild(parent, [&](const Cached& cc) {
    if (cc.tier != Tier::kHost && SlotOf(cc.tier, cc.id).busy) return;
    if (cc.tier == Tier::kPrimary && SlotOf(cc.tier, cc.id).arriving) return;
    size_t n = 0;
    while (n < want && cc.tokens[n] == seq.tokens[base + n]) ++n;
    if (static_cast<int64_t>(n) > best.tokens)
      best = Candidate{cc.key, cc.tier, cc.id, static_cast<int64_t>(n)};
  });
  if (best.found()) Lease(index.At(best.key));
  return best;
}

// Gives back what LeasePrefixHits and LeasePartialCandidate leased (the allocation failed).
void BlockManager::Impl::UnleaseAll(const Sequence& seq, std::span<const Hit> hits,
                                    const Candidate& cand) {
  for (size_t i = 0; i < hits.size(); ++i) {
    Unlease(hits[i].tier, hits[i].id, index.At(seq.keys[i]).priority);
  }
  if (cand.found()) Unlease(cand.tier, cand.id, index.At(cand.key).priority);
}

// The sequence's blocks in token order: primary hits shared, every other block from `fresh`;
// host and file hits start onboarding into theirs now (nothing waits for them).
void BlockManager::Impl::PlaceAndOnboard(Sequence& seq, std::span<const Hit> hits,
                                         std::span<const int64_t> fresh, size_t nblocks,
                                         Admission& adm) {
  size_t next_fresh = 0;
  std::vector<BlockMove>& from_host = scratch.from_host;
  std::vector<BlockMove>& from_file = scratch.from_file;
  std::vector<SlotLease>& leases = scratch.leases;
  from_host.clear();
  from_file.clear();
  leases.clear();
  for (size_t i = 0; i < nblocks; ++i) {
    if (i < hits.size() && hits[i].tier == Tier::kPrimary) {
      seq.blocks.push_back(hits[i].id);
      ++adm.hits[0];
      continue;
    }
    const int64_t b = fresh[next_fresh++];
    seq.blocks.push_back(b);
    if (i >= hits.size()) continue;
    BlockMove mv(hits[i].id, b, 0, seq.keys[i]);
    if (hits[i].tier == Tier::kHost) {
      from_host.push_back(mv);
      ++adm.hits[1];
    } else {
      from_file.push_back(mv);
      leases.push_back(std::move(file_leases[mv.src]));
      ++adm.hits[2];
    }
  }
  st.onboarded += static_cast<int64_t>(from_host.size() + from_file.size());
  Onboard(Tier::kHost, from_host, {}, false);
  Onboard(Tier::kFile, from_file, leases, false);
  leases.clear();  // moved from: empty leases
  for (int t = 0; t < kNumTiers; ++t) st.hits[t] += adm.hits[t];
  seq.matched = hits.size();
}

// Copies the candidate's first matching tokens into the block after the matched prefix (a file
// candidate is read on the I/O thread); the candidate's lease goes back once it is not needed.
void BlockManager::Impl::StartPartialCopy(Sequence& seq, const Candidate& cand) {
  if (!cand.found()) return;
  const int32_t prio = index.At(cand.key).priority;
  if (cand.tokens > 0) {
    BlockMove mv(cand.id, seq.blocks[seq.matched], static_cast<int32_t>(cand.tokens), cand.key);
    if (cand.tier == Tier::kFile) {
      tiering::Op op = NewOp(OpKind::kPartial, Tier::kFile);
      SlotOf(Tier::kFile, cand.id).busy = true;
      SlotOf(Tier::kPrimary, mv.dst).arriving = true;
      op.items.push_back(
          tiering::OpItem{cand.key, cand.id, mv.dst, mv.tokens, std::move(file_leases[cand.id])});
      SubmitFileRead(std::move(op));
      seq.partial_tokens = cand.tokens;
      ++st.partial_copies;
    } else {
      auto batch = Submit(
          [&] { return tm->Move(cand.tier, Tier::kPrimary, std::span<const BlockMove>(&mv, 1)); });
      if (batch.ok()) {
        seq.partial_tokens = cand.tokens;
        ++st.partial_copies;
      } else {
        seq.misses.push_back(batch.status().ToString());
      }
    }
  }
  if (cand.tier != Tier::kFile || cand.tokens == 0) Unlease(cand.tier, cand.id, prio);
}

// Stores the sequence's full blocks from `first` on that are not cached yet under their keys.
void BlockManager::Impl::StoreFullBlocks(const Sequence& seq, size_t first) {
  const size_t n = seq.keys.size();
  for (size_t i = first; i < std::min(first + kPrefetchAhead, n); ++i) {
    index.Prefetch(seq.keys[i]);
    index.PrefetchChildren(i == 0 ? root : seq.keys[i - 1]);
  }
  for (size_t i = first; i < n; ++i) {
    if (const size_t a = i + kPrefetchAhead; a < n) {
      index.Prefetch(seq.keys[a]);
      index.PrefetchChildren(seq.keys[a - 1]);
    }
    if (index.Contains(seq.keys[i])) continue;
    const BlockKey parent = i == 0 ? root : seq.keys[i - 1];
    std::span<const int32_t> toks(seq.tokens.data() + i * tpb, static_cast<size_t>(tpb));
    Register(seq.keys[i], parent, toks, Tier::kPrimary, seq.blocks[i], seq.priority);
  }
}

StatusOr<Readiness> BlockManager::PollReady(uint64_t id) {
  Impl& m = *impl_;
  Impl::CallPlug plug(m);  // deferred file reads may start
  m.RetireFinished();
  m.SubmitDeferred();
  auto it = m.seqs.find(id);
  if (it == m.seqs.end()) return Status::NotFound(fmt::format("sequence {} does not exist", id));
  return m.ReadinessOf(it->second);
}

Readiness BlockManager::Impl::ReadinessOf(const Sequence& s) const {
  const Impl& m = *this;
  Readiness r;
  r.misses = s.misses;
  const bool partial = s.partial_tokens > 0 && s.matched < s.blocks.size();
  const size_t n = s.matched + (partial ? 1 : 0);
  size_t usable = s.matched;
  bool partial_ok = partial;
  for (size_t i = 0; i < n; ++i) {
    const tiering::Slot& b = m.SlotOf(Tier::kPrimary, s.blocks[i]);
    if (b.arriving) return r;  // not ready
    if (b.failed) {
      r.misses.push_back(b.why);
      if (i < s.matched) {
        usable = std::min(usable, i);
      } else {
        partial_ok = false;
      }
    }
  }
  r.ready = true;
  int64_t tokens = static_cast<int64_t>(usable) * m.tpb;
  if (usable == s.matched && partial_ok) tokens += s.partial_tokens;
  r.reused_tokens = std::min(tokens, s.prompt_tokens);
  return r;
}

StatusOr<Readiness> BlockManager::WaitReady(uint64_t id, Deadline deadline) {
  std::chrono::microseconds nap(20);
  while (true) {
    KVF_ASSIGN_OR_RETURN(Readiness r, PollReady(id));
    if (r.ready || Clock::now() >= deadline) return r;
    std::this_thread::sleep_for(nap);
    nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::microseconds(1000));
  }
}

StatusOr<int64_t> BlockManager::Prefetch(std::span<const int32_t> prompt, int32_t priority) {
  Impl& m = *impl_;
  if (priority < kMinPriority || priority > kMaxPriority) {
    return Status::InvalidArgument(fmt::format("priority {} outside [0, 100]", priority));
  }
  Impl::CallPlug plug(m);
  m.SubmitDeferred();  // retiring and the watermarks: Poll, RemoveSequence, PollReady
  Sequence probe;
  probe.tokens.assign(prompt.begin(), prompt.end());
  ExtendKeys(probe, m.root, m.tpb);
  std::vector<const Cached*> lower;  // host and file hits, in chain order
  for (const BlockKey& k : probe.keys) {
    const Cached* c = m.index.Find(k);
    if (c == nullptr) break;
    if (c->tier == Tier::kPrimary) continue;
    if (m.SlotOf(c->tier, c->id).busy) break;
    lower.push_back(c);
  }
  // Only blocks that are free or evictable now; the prefix stops where they run out.
  const int64_t avail = static_cast<int64_t>(m.free_primary.size()) + m.Lru(Tier::kPrimary).size();
  lower.resize(std::min<size_t>(lower.size(), static_cast<size_t>(std::max<int64_t>(avail, 0))));
  if (lower.empty()) return int64_t{0};
  for (const Cached* c : lower) m.Lease(*c);
  std::vector<int64_t> blocks;
  KVF_RETURN_IF_ERROR(m.AllocatePrimary(static_cast<int64_t>(lower.size()), blocks));
  std::vector<BlockMove> from_host, from_file;
  std::vector<SlotLease> leases;
  std::vector<int64_t> host_dst;
  for (size_t i = 0; i < lower.size(); ++i) {
    const Cached& c = *lower[i];
    m.SlotOf(Tier::kPrimary, blocks[i]).refs = 0;
    const BlockKey key = m.SlotOf(c.tier, c.id).key;
    m.index.At(key).priority = std::max(m.index.At(key).priority, priority);
    if (c.tier == Tier::kHost) {
      from_host.emplace_back(c.id, blocks[i], 0, key);
      host_dst.push_back(blocks[i]);
    } else {
      from_file.emplace_back(c.id, blocks[i], 0, key);
      leases.push_back(std::move(m.file_leases[c.id]));
    }
  }
  const int64_t started = static_cast<int64_t>(lower.size());
  m.Onboard(Tier::kHost, from_host, {}, true);
  m.Onboard(Tier::kFile, from_file, leases, true);
  for (int64_t b : host_dst) {  // stream-ordered: cached in the primary tier from now on
    const tiering::Slot& s = m.SlotOf(Tier::kPrimary, b);
    if (s.has_key) {
      m.Lru(Tier::kPrimary).Push(b, m.index.At(s.key).priority);
    } else {
      m.free_primary.push_back(b);
    }
  }
  m.st.prefetched += started;
  m.st.onboarded += started;
  return started;
}

void BlockManager::Poll() {
  Impl::CallPlug plug(*impl_);
  impl_->Maintain();
}

Status BlockManager::AppendTokens(uint64_t id, std::span<const int32_t> tokens) {
  Impl& m = *impl_;
  auto it = m.seqs.find(id);
  if (it == m.seqs.end()) return Status::NotFound(fmt::format("sequence {} does not exist", id));
  Impl::CallPlug plug(m);
  m.SubmitDeferred();  // retiring and the watermarks: Poll, RemoveSequence, PollReady
  Sequence& s = it->second;
  const size_t need = (s.tokens.size() + tokens.size() + m.tpb - 1) / m.tpb;
  std::vector<int64_t>& fresh = m.scratch.fresh;
  fresh.clear();
  if (need > s.blocks.size()) {
    KVF_RETURN_IF_ERROR(m.AllocatePrimary(static_cast<int64_t>(need - s.blocks.size()), fresh));
  }
  s.blocks.insert(s.blocks.end(), fresh.begin(), fresh.end());
  s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
  const size_t before = s.keys.size();
  ExtendKeys(s, m.root, m.tpb);
  m.StoreFullBlocks(s, before);
  return Status::Ok();
}

Status BlockManager::RemoveSequence(uint64_t id) {
  Impl& m = *impl_;
  auto it = m.seqs.find(id);
  if (it == m.seqs.end()) return Status::NotFound(fmt::format("sequence {} does not exist", id));
  Impl::CallPlug plug(m);
  for (int64_t b : it->second.blocks) m.Unref(b, it->second.priority);
  m.RecycleSequence(it);
  m.Maintain();
  return Status::Ok();
}

StatusOr<std::vector<int64_t>> BlockManager::Blocks(uint64_t id) const {
  auto it = impl_->seqs.find(id);
  if (it == impl_->seqs.end()) {
    return Status::NotFound(fmt::format("sequence {} does not exist", id));
  }
  return it->second.blocks;
}

std::vector<KvEvent> BlockManager::DrainEvents() { return impl_->events.Drain(); }

BlockManagerStats BlockManager::stats() const {
  const Impl& m = *impl_;
  BlockManagerStats s = m.st;
  s.free_primary = static_cast<int64_t>(m.free_primary.size());
  s.free_host = static_cast<int64_t>(m.free_host.size());
  for (const auto& lane : m.ops) {
    for (const tiering::Op& op : lane) {
      ++s.ops_in_flight;
      s.inflight_bytes += op.bytes;
      s.file_ops_in_flight += tiering::IsFileIo(op);
      for (const tiering::OpItem& it : op.items) s.leased_slots += it.slot ? 1 : 0;
    }
  }
  for (const tiering::Op& op : m.deferred) {
    s.deferred_reads += static_cast<int64_t>(op.items.size());
    for (const tiering::OpItem& it : op.items) s.leased_slots += it.slot ? 1 : 0;
  }
  return s;
}

StatusOr<std::pair<Tier, int64_t>> BlockManager::Find(const BlockKey& key) const {
  const Cached* c = impl_->index.Find(key);
  if (c == nullptr) {
    return Status::NotFound(fmt::format("key {:016x}{:016x} is not cached", key.hi, key.lo));
  }
  return std::make_pair(c->tier, c->id);
}

}  // namespace kvferry

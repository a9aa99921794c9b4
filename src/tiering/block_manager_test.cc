#include "kvferry/block_manager.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <future>
#include <mutex>
#include <numeric>
#include <thread>

#include "testing/block_manager_test_env.h"
#include "testing/file_test_util.h"
#include "testing/memory_slab_store.h"
#include "testing/tiering_test_util.h"
#include "tiering/block_manager_impl.h"

namespace kvferry::tiering {
namespace {

using namespace std::chrono_literals;
using testing::ExpectBlockHolds;
using testing::GatedSlabStore;
using testing::MakePool;

TEST(BlockKeys, ChainSeparatesEverythingThatChangesTheBytes) {
  CacheIdentity a;
  a.model_id = "m";
  a.shape = testing::SmallShape();
  const auto toks = Conv(1, 4);
  const BlockKey ra = RootKey(a);
  EXPECT_EQ(ra, RootKey(a));
  EXPECT_EQ(NextKey(ra, toks), NextKey(RootKey(a), toks));
  auto differs = [&](CacheIdentity b) {
    EXPECT_NE(RootKey(b), ra);
    EXPECT_NE(NextKey(RootKey(b), toks), NextKey(ra, toks));
  };
  CacheIdentity b = a;
  b.salt = 1;
  differs(b);
  b = a;
  b.model_id = "m2";
  differs(b);
  b = a;
  b.shape.dtype = DType::kFp8E4M3;
  differs(b);
  b = a;
  b.slice.tp_rank = 1;
  differs(b);
  b = a;
  b.slice.layer_begin = 16;
  differs(b);
  b = a;
  b.parallel.tp = 2;
  differs(b);
  // Same tokens at another place of the chain, or another order: another key.
  EXPECT_NE(NextKey(NextKey(ra, toks), toks), NextKey(ra, toks));
  auto rev = toks;
  std::reverse(rev.begin(), rev.end());
  EXPECT_NE(NextKey(ra, rev), NextKey(ra, toks));
}

// Keys are written into file slots and recovered after a restart: the chain's bytes and hash must
// never change. Golden values of key format v1 (docs/tiering.md "Keys"), for short and long blocks.
TEST(BlockKeys, ChainIsStableAcrossVersions) {
  const BlockKey parent{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  std::vector<int32_t> toks(16);
  std::iota(toks.begin(), toks.end(), -3);
  const BlockKey k16 = NextKey(parent, toks);
  std::vector<int32_t> long_toks(300);
  std::iota(long_toks.begin(), long_toks.end(), 1 << 20);
  const BlockKey k300 = NextKey(k16, long_toks);
  EXPECT_EQ(k16, (BlockKey{0x399da3132c007272ULL, 0x53293bdf818b1bbcULL}));
  EXPECT_EQ(k300, (BlockKey{0xdfb806204184c5e7ULL, 0x7f4c462e1c51b996ULL}));
}

TEST(BlockManager, ReusesPrimaryPrefixBlocks) {
  Env e(8, 0, 0);
  Admission a = e.Run(1, 1, 10);  // 2 full blocks + 2 tokens
  EXPECT_EQ(a.reused_tokens, 0);
  auto b = e.bm->AddSequence(2, Conv(1, 9));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->hits[0], 2);
  EXPECT_EQ(b->blocks[0], a.blocks[0]);
  EXPECT_EQ(b->blocks[1], a.blocks[1]);
  EXPECT_EQ(b->reused_tokens, 8);  // A's third block was never full, so never stored
  e.ExpectHolds(b->blocks, 1, 8);
  // Shared while both reference it.
  auto c = e.bm->AddSequence(3, Conv(1, 8));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->blocks[0], a.blocks[0]);
}

// The batches a call makes start when it returns, with nothing else to kick the submit thread:
// the call's plug (taken by its first batch) is released on return. Poll here makes no batch, so
// it neither plugs nor wakes: a plug left behind would keep the onboard and the offload queued.
TEST(BlockManager, BatchesOfACallStartWhenItReturns) {
  Env e(8, 32, 0);
  const int32_t tokens = 6 * 4;
  e.Run(1, 1, tokens);
  e.Run(2, 2, tokens);  // evicts conversation 1 to the host tier
  e.Settle();
  auto a = e.bm->AddSequence(3, Conv(1, tokens));  // host hits: an onboard, and an offload
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_GT(a->hits[1], 0);
  EXPECT_GT(e.bm->stats().ops_in_flight, 0);
  const Deadline deadline = DeadlineIn(10s);
  while (e.bm->stats().ops_in_flight > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
    e.bm->Poll();
  }
  EXPECT_EQ(e.bm->stats().ops_in_flight, 0);
}

// The calls that allocate retire nothing: finished ops of the copy streams (here an offload) and
// of the file lane (a spill: per-item relocation, slot lease, LRU) wait for Poll, RemoveSequence
// or PollReady, off the engine's stall, and so do their completion queries (a driver call each on
// CUDA). Before, AppendTokens retired the finished offload itself (and, a round earlier, the
// spill too).
TEST(BlockManager, AllocatingCallsLeaveFinishedOpsToPoll) {
  Env e(2, 1, 4);
  e.Run(1, 1, 8);                             // two cached blocks, evictable
  auto a = e.bm->AddSequence(2, Conv(2, 7));  // evicts both: one to the host block, one spilled
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(e.bm->stats().ops_in_flight, 2);
  EXPECT_EQ(e.bm->stats().file_ops_in_flight, 1);
  ASSERT_TRUE(e.tm->Drain(DeadlineIn(10s)).ok());          // the offload and the write have ended
  ASSERT_TRUE(e.bm->AppendTokens(2, Conv(2, 1, 7)).ok());  // fills block 1: allocates nothing new
  EXPECT_EQ(e.bm->stats().ops_in_flight, 2);               // both finished, left for Poll
  EXPECT_EQ(e.bm->stats().file_ops_in_flight, 1);
  e.bm->Poll();
  EXPECT_EQ(e.bm->stats().ops_in_flight, 0);
  EXPECT_EQ(e.bm->stats().file_ops_in_flight, 0);
  auto where = e.bm->Find(e.KeyOf(1, 1));
  ASSERT_TRUE(where.ok()) << where.status().ToString();
  EXPECT_EQ(where->first, Tier::kFile);
  auto ready = e.bm->PollReady(2);
  ASSERT_TRUE(ready.ok());
  EXPECT_TRUE(ready->ready);
}

// After a drain empties the ring, the next events start at its front: storage stays at the
// most events held between two drains (before, the ring walked all of its storage, a cache miss
// per event on the engine's thread), and order and overwriting are unchanged.
TEST(BlockManager, EventRingReusesItsFrontAfterADrain) {
  int64_t dropped = 0;
  EventRing ring(1000, &dropped);
  auto ev = [](uint64_t n) {
    return PendingEvent{KvEventKind::kStored, BlockKey{0, n}, Tier::kPrimary, Tier::kPrimary};
  };
  for (uint64_t round = 0; round < 100; ++round) {
    for (uint64_t i = 0; i < 3; ++i) ring.Push(ev(round * 3 + i));
    std::vector<KvEvent> out = ring.Drain();
    ASSERT_EQ(out.size(), 3u);
    for (uint64_t i = 0; i < 3; ++i) EXPECT_EQ(out[i].key.lo, round * 3 + i);
  }
  EXPECT_EQ(ring.slots_used(), 3u);
  EventRing small(5, &dropped);
  for (uint64_t i = 0; i < 3; ++i) small.Push(ev(i));
  EXPECT_EQ(small.Drain().size(), 3u);
  for (uint64_t i = 10; i < 17; ++i) small.Push(ev(i));  // 7 into 5: the 2 oldest overwritten
  std::vector<KvEvent> out = small.Drain();
  ASSERT_EQ(out.size(), 5u);
  for (uint64_t i = 0; i < 5; ++i) EXPECT_EQ(out[i].key.lo, 12 + i);
  EXPECT_EQ(dropped, 2);
}

// Nobody drains: the events stay bounded by max_events, the oldest go first and are counted.
TEST(BlockManager, EventsAreBoundedWhenNobodyDrains) {
  BlockManagerOptions o = OnDemand();
  o.max_events = 5;
  Env e(8, 0, 0, o);
  for (int32_t c = 1; c <= 4; ++c) e.Run(c, c, 8);  // 2 blocks stored each: 8 events, 8 blocks
  EXPECT_EQ(e.bm->stats().events_dropped, 3);
  auto ev = e.bm->DrainEvents();
  ASSERT_EQ(ev.size(), 5u);
  EXPECT_EQ(ev.back().kind, KvEventKind::kStored);  // the newest: conv 4's second block
  EXPECT_EQ(ev.back().key, e.KeyOf(4, 1));
  EXPECT_TRUE(e.bm->DrainEvents().empty());
  e.Run(5, 5, 4);  // after a drain the ring starts again, in order: an eviction, a store
  ev = e.bm->DrainEvents();
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].kind, KvEventKind::kRemoved);
  EXPECT_EQ(ev[1].key, e.KeyOf(5, 0));
  EXPECT_EQ(e.bm->stats().events_dropped, 3);
  o.max_events = 0;
  EXPECT_FALSE(BlockManager::Create(*e.tm, o).ok());
}

TEST(BlockManager, EvictsLowestPriorityThenLeastRecentlyUsed) {
  Env e(3, 0, 0);
  auto k = [&](int32_t conv) {
    return NextKey(RootKey(CacheIdentity{"test-model", e.primary.shape(), {}, {}, 0}),
                   Conv(conv, 4));
  };
  e.Run(1, 1, 4, 50);
  e.Run(2, 2, 4, 10);
  e.Run(3, 3, 4, 50);
  e.bm->DrainEvents();
  e.Run(4, 4, 4);  // evicts conv 2 (priority 10)
  auto ev = e.bm->DrainEvents();
  ASSERT_GE(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, KvEventKind::kRemoved);
  EXPECT_EQ(ev[0].key, k(2));
  EXPECT_TRUE(e.bm->Find(k(1)).ok());
  e.Run(5, 5, 4, 50);  // then conv 4 (default 35) ...
  EXPECT_FALSE(e.bm->Find(k(4)).ok());
  e.Run(6, 6, 4, 50);  // ... then the oldest of priority 50: conv 1
  EXPECT_FALSE(e.bm->Find(k(1)).ok());
  EXPECT_TRUE(e.bm->Find(k(3)).ok());
  EXPECT_EQ(e.bm->stats().dropped[0], 3);
}

TEST(BlockManager, EvictionOffloadsToHostAndPrefixHitOnboards) {
  Env e(4, 4, 0);
  e.Run(1, 1, 16);                // conv 1 fills the primary
  Admission b = e.Run(2, 2, 16);  // evicts conv 1 to the host tier
  EXPECT_EQ(b.reused_tokens, 0);
  EXPECT_EQ(e.bm->stats().offloaded, 4);
  EXPECT_EQ(e.bm->stats().cached[1], 4);
  auto c = e.bm->AddSequence(3, Conv(1, 16));  // conv 1 again: 4 host hits, onboarded
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->hits[1], 4);
  EXPECT_EQ(c->reused_tokens, 16);
  e.ExpectHolds(c->blocks, 1, 16);
  auto st = e.bm->stats();
  EXPECT_EQ(st.onboarded, 4);
  EXPECT_EQ(st.cached[0], 4);
  // Conv 2's blocks could not go to the host tier (its blocks were leased by the onboard): dropped.
  EXPECT_EQ(st.dropped[0], 4);
  auto ev = e.bm->DrainEvents();
  int moved_up = 0;
  for (const KvEvent& x : ev) {
    moved_up += x.kind == KvEventKind::kMoved && x.to == Tier::kPrimary;
  }
  EXPECT_EQ(moved_up, 4);
}

TEST(BlockManager, CascadesToFileAndDropsFromTheLastTier) {
  Env e(2, 2, 2);
  e.Run(1, 1, 8);
  e.Run(2, 2, 8);  // conv 1 -> host
  e.Run(3, 3, 8);  // the host tier is full: conv 2 goes straight to the file tier
  e.Settle();
  auto st = e.bm->stats();
  EXPECT_EQ(st.demoted, 2);
  EXPECT_EQ(st.cached[1], 2);
  EXPECT_EQ(st.cached[2], 2);
  EXPECT_EQ(e.bm->Find(e.KeyOf(2, 0)).value().first, Tier::kFile);
  e.Run(4, 4, 8);  // conv 3 -> file, conv 2 dropped from the file tier (the last)
  e.Settle();
  st = e.bm->stats();
  EXPECT_EQ(st.dropped[2], 2);
  EXPECT_EQ(st.cached[0], 2);
  EXPECT_EQ(st.cached[1], 2);
  EXPECT_EQ(st.cached[2], 2);
  auto a = e.bm->AddSequence(9, Conv(3, 8));  // conv 3 from the file tier, read in the background
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->hits[2], 2);
  auto r = e.bm->WaitReady(9, DeadlineIn(10s));
  ASSERT_TRUE(r.ok() && r->ready);
  EXPECT_EQ(r->reused_tokens, 8);
  EXPECT_TRUE(r->misses.empty());
  e.ExpectHolds(a->blocks, 3, 8);
  auto miss = e.bm->AddSequence(10, Conv(1, 8));
  ASSERT_FALSE(miss.ok());  // all primary blocks referenced by seq 9 and 10 would need 4
  EXPECT_EQ(miss.status().code(), StatusCode::kResourceExhausted);
}

TEST(BlockManager, FailedFileWriteDropsOnlyThatBlock) {
  Env e(2, 2, 4);
  e.Run(1, 1, 8);
  e.Run(2, 2, 8);  // conv 1 -> host
  e.faults.FailAllWrites(true);
  e.Run(3, 3, 8);  // conv 2's write to the file tier fails: conv 2 is dropped, conv 1 stays
  e.Settle();
  auto st = e.bm->stats();
  EXPECT_EQ(st.write_failures, 2);
  EXPECT_EQ(st.cached[1], 2);
  EXPECT_EQ(st.cached[2], 0);
  EXPECT_EQ(st.leased_slots, 0);
  EXPECT_EQ(e.faults.free_slots(), 4);  // the failed slots went back
  e.faults.FailAllWrites(false);
  auto a = e.bm->AddSequence(4, Conv(1, 8));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->hits[1], 2);
  e.ExpectHolds(a->blocks, 1, 8);  // intact
}

TEST(BlockManager, CorruptSlotIsAMissWithAReason) {
  Env e(2, 2, 4);
  e.Run(1, 1, 8);
  e.Run(2, 2, 8);
  e.Run(3, 3, 8);  // conv 2 -> file
  e.Settle();
  auto where = e.bm->Find(e.KeyOf(2, 0));
  ASSERT_TRUE(where.ok());
  ASSERT_EQ(where->first, Tier::kFile);
  ASSERT_TRUE(e.mem.CorruptForTest(where->second, 3));
  e.bm->DrainEvents();
  auto a = e.bm->AddSequence(4, Conv(2, 8));
  ASSERT_TRUE(a.ok());
  // Optimistic while the read is in flight; final (0: the read failed) when the file worker
  // finished it before AddSequence's own poll, as a loaded machine's scheduling allows.
  EXPECT_EQ(a->reused_tokens, a->ready ? 0 : 8) << (a->ready ? "ready" : "in flight");
  auto r = e.bm->WaitReady(4, DeadlineIn(10s));
  ASSERT_TRUE(r.ok() && r->ready);
  EXPECT_EQ(r->reused_tokens, 0);
  ASSERT_EQ(r->misses.size(), 1u);
  EXPECT_NE(r->misses[0].find("checksum"), std::string::npos) << r->misses[0];
  bool removed = false;
  for (const KvEvent& x : e.bm->DrainEvents()) {
    removed |= x.kind == KvEventKind::kRemoved && x.reason.find("checksum") != std::string::npos;
  }
  EXPECT_TRUE(removed);
  EXPECT_EQ(e.bm->stats().corrupt_reads, 1);
}

TEST(BlockManager, PartialReuseCopiesTheMatchingTokens) {
  for (int tier = 0; tier < 2; ++tier) {
    Env e(4, 4, 0);
    e.Run(1, 1, 8);
    if (tier == 1) e.Run(2, 2, 16);       // push conv 1 to the host tier
    std::vector<int32_t> p = Conv(1, 6);  // block 0 matches, block 1 matches 2 tokens
    p.push_back(77);
    auto a = e.bm->AddSequence(3, p);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->reused_tokens, 6);
    EXPECT_EQ(a->partial_tokens, 2);
    e.ExpectHolds(a->blocks, 1, 6);
    EXPECT_EQ(e.bm->stats().partial_copies, 1);
  }
}

TEST(BlockManager, RejectsBadInput) {
  Env e(2, 0, 0);
  ASSERT_TRUE(e.bm->AddSequence(1, Conv(1, 4)).ok());
  EXPECT_EQ(e.bm->AddSequence(1, Conv(1, 4)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e.bm->AddSequence(2, Conv(1, 4), 101).status().code(), StatusCode::kInvalidArgument);
  auto full = e.bm->AddSequence(3, Conv(3, 8));
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("referenced"), std::string_view::npos);
  EXPECT_EQ(e.bm->stats().free_primary, 1);  // nothing changed
  EXPECT_EQ(e.bm->RemoveSequence(42).code(), StatusCode::kNotFound);
  BlockManagerOptions o;
  o.identity.shape = testing::SmallShape(DType::kFp32);
  EXPECT_NE(BlockManager::Create(*e.tm, o).status().message().find("differs"),
            std::string_view::npos);
}

TEST(BlockManager, AppendTokensStoresBlocksAsTheyFill) {
  Env e(4, 0, 0);
  auto a = e.bm->AddSequence(1, Conv(1, 3));
  ASSERT_TRUE(a.ok());
  e.bm->DrainEvents();
  ASSERT_TRUE(e.bm->AppendTokens(1, Conv(1, 6, 3)).ok());  // to 9 tokens: 2 full blocks
  auto ev = e.bm->DrainEvents();
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].kind, KvEventKind::kStored);
  EXPECT_EQ(e.bm->Blocks(1).value().size(), 3u);
  ASSERT_TRUE(e.bm->RemoveSequence(1).ok());
  auto b = e.bm->AddSequence(2, Conv(1, 8));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->hits[0], 2);
}

TEST(BlockManager, EvictionWaitsForTheComputeStream) {
  auto dev = OpenCpuDevice();
  auto compute = std::move(dev->CreateStream()).value();
  BlockManagerOptions o = OnDemand();
  o.compute = compute.get();
  Env e(2, 2, 0, o);
  e.Run(1, 1, 8);
  // The engine queues a write of conv 1's KV on compute (held back by a gate), then a request
  // evicts those blocks: the offload must copy what compute writes, not what is there now.
  std::promise<void> open;
  auto f = open.get_future().share();
  ASSERT_TRUE(compute->HostCallback([f] { f.wait(); }).ok());
  ASSERT_TRUE(compute
                  ->HostCallback([&e] {
                    for (int64_t b = 0; b < 2; ++b) {
                      (void)FillBlock(e.primary, 1, BlockTokens{b, b * 4, 4});
                    }
                  })
                  .ok());
  for (int64_t b = 0; b < 2; ++b) ASSERT_TRUE(FillBlock(e.primary, 666, BlockTokens{b, 0, 4}).ok());
  auto a = e.bm->AddSequence(2, Conv(2, 8));  // evicts conv 1 to the host tier
  ASSERT_TRUE(a.ok());
  std::this_thread::sleep_for(30ms);
  open.set_value();
  ASSERT_TRUE(compute->Synchronize(DeadlineIn(10s)).ok());
  ASSERT_TRUE(e.bm->RemoveSequence(2).ok());
  auto c = e.bm->AddSequence(3, Conv(1, 8));  // back from the host tier
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->hits[1], 2);
  e.ExpectHolds(c->blocks, 1, 8);
}

// A file tier whose reads and writes wait at a gate until the test opens it (a slow disk).
BlockManagerOptions Watermarks(int32_t low, int32_t high) {
  BlockManagerOptions o;
  o.free_low_pct = low;
  o.free_high_pct = high;
  return o;
}

// Every conversation of a run is found again (in some tier) with its bytes; with `all` false,
// what is found holds the right bytes (some may have been dropped).
void ExpectAllBack(Env& e, int32_t first, int32_t last, int32_t tokens, uint64_t id,
                   bool all = true) {
  for (int32_t c = first; c <= last; ++c, ++id) {
    auto a = e.bm->AddSequence(id, Conv(c, tokens));
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    auto r = e.bm->WaitReady(id, DeadlineIn(10s));
    ASSERT_TRUE(r.ok() && r->ready);
    if (all) {
      EXPECT_EQ(r->reused_tokens, tokens) << "conversation " << c;
    }
    e.ExpectHolds(a->blocks, static_cast<uint64_t>(c), r->reused_tokens);
    ASSERT_TRUE(e.bm->RemoveSequence(id).ok());
  }
}

TEST(BlockManager, WatermarksKeepFreeBlocksAheadOfAllocation) {
  Env e(8, 4, 32, Watermarks(25, 50));
  for (int32_t c = 1; c <= 6; ++c) {
    e.Run(c, c, 8);
    e.Settle();
  }
  auto st = e.bm->stats();
  EXPECT_GE(st.free_primary, 2);  // 25% of 8
  EXPECT_GE(st.free_host, 1);     // 25% of 4
  EXPECT_GT(st.background_evictions, 0);
  EXPECT_GT(st.demoted, 0);
  EXPECT_EQ(st.dropped[0] + st.dropped[1] + st.dropped[2], 0);
  ExpectAllBack(e, 1, 6, 8, 100);
}

// Allocations larger than the high watermark (a prompt with many host hits): the watermark keeps
// as many blocks free as the largest recent allocation needed, so the next one evicts nothing on
// the caller's thread (before, 4 free of 16 were above the 10% low mark and the third evicted 2).
TEST(BlockManager, WatermarksKeepTheLargestRecentAllocationFree) {
  Env e(16, 8, 32, Watermarks(10, 20));
  const int32_t tpb = static_cast<int32_t>(e.tpb());
  for (int32_t c = 1; c <= 6; ++c) {
    e.Run(static_cast<uint64_t>(c), c, 6 * tpb);
    e.Settle();
    EXPECT_GE(e.bm->stats().free_primary, 6) << "conversation " << c;
  }
  auto st = e.bm->stats();
  EXPECT_EQ(st.inline_evictions, 0);
  EXPECT_GT(st.background_evictions, 0);
  EXPECT_EQ(st.dropped[0] + st.dropped[1] + st.dropped[2], 0);
  ExpectAllBack(e, 1, 6, 6 * tpb, 100);
}

// The calls that allocate (their wall time is the engine's stall) leave the watermarks to Poll and
// RemoveSequence: before, every AddSequence first moved victims down to the high watermark.
TEST(BlockManager, WatermarksRunInPollNotInTheCallsThatAllocate) {
  Env e(8, 4, 32, Watermarks(25, 50));
  const int32_t tpb = static_cast<int32_t>(e.tpb());
  e.Run(1, 1, 6 * tpb);  // 6 cached blocks; RemoveSequence evicts 2 so that 4 are free (50%)
  e.Settle();
  ASSERT_EQ(e.bm->stats().free_primary, 4);
  const int64_t before = e.bm->stats().background_evictions;
  for (int32_t c = 2; c <= 5; ++c) {  // below the low watermark, then none free
    ASSERT_TRUE(e.bm->AddSequence(static_cast<uint64_t>(c), Conv(c, tpb)).ok());
  }
  auto st = e.bm->stats();
  EXPECT_EQ(st.background_evictions, before);
  EXPECT_EQ(st.inline_evictions, 0);
  EXPECT_EQ(st.free_primary, 0);
  e.bm->Poll();
  st = e.bm->stats();
  EXPECT_EQ(st.background_evictions, before + 4);  // up to 50% of 8 free
  EXPECT_EQ(st.free_primary, 4);
  for (uint64_t id = 2; id <= 5; ++id) ASSERT_TRUE(e.bm->RemoveSequence(id).ok());
  e.Settle();
}

TEST(BlockManager, AllocationNeverWaitsForTheDisk) {
  auto dev = OpenCpuDevice();
  BlockPool probe = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, 1);
  MemorySlabStore mem(probe.layout().block_bytes(), 32);
  GatedSlabStore gated(&mem);
  Env e(4, 2, 0, Watermarks(25, 50), &gated);
  gated.Close();  // every file write and read now hangs until Open()
  for (int32_t c = 1; c <= 6; ++c) {
    const auto t0 = Clock::now();
    e.Run(c, c, 8, kDefaultPriority, /*drain=*/false);
    EXPECT_LT(Clock::now() - t0, 2s) << "conversation " << c;  // would hang if it waited
  }
  auto st = e.bm->stats();
  EXPECT_GT(st.file_ops_in_flight, 0);
  EXPECT_GT(st.inflight_bytes, 0);
  EXPECT_GT(st.leased_slots, 0);
  EXPECT_GT(e.tm->stats().file_jobs_queued, 0);
  gated.Open();
  e.Settle();
  st = e.bm->stats();
  EXPECT_EQ(st.file_ops_in_flight, 0);
  EXPECT_EQ(st.leased_slots, 0);
  EXPECT_GT(st.demoted, 0);
  ExpectAllBack(e, 1, 6, 8, 100, /*all=*/false);  // a stuck disk may have cost some blocks
}

// The fix of a bug: after an I/O deadline the manager released a file slot whose write was still
// running (a later Allocate could hand it out again). Now the slot stays leased until the write
// ends, however late; the operation is counted as abandoned.
TEST(BlockManager, SlotStaysLeasedPastTheIoDeadline) {
  auto dev = OpenCpuDevice();
  BlockPool probe = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, 1);
  MemorySlabStore mem(probe.layout().block_bytes(), 4);
  GatedSlabStore gated(&mem);
  BlockManagerOptions o = OnDemand();
  o.io_timeout = 20ms;
  Env e(2, 2, 0, o, &gated);
  e.Run(1, 1, 8);
  e.Run(2, 2, 8);  // conv 1 -> host
  gated.Close();
  e.Run(3, 3, 8, kDefaultPriority, /*drain=*/false);  // conv 2 -> file: the write hangs
  std::this_thread::sleep_for(60ms);
  e.bm->Poll();
  auto st = e.bm->stats();
  EXPECT_GE(st.abandoned, 1);
  EXPECT_EQ(st.leased_slots, 2);
  EXPECT_EQ(mem.free_slots(), 2);             // not released while the write may still run
  auto a = e.bm->AddSequence(9, Conv(2, 8));  // not readable yet: a miss, not a wait
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->hits[2], 0);
  ASSERT_TRUE(e.bm->RemoveSequence(9).ok());
  gated.Open();
  e.Settle();
  st = e.bm->stats();
  EXPECT_EQ(st.leased_slots, 0);
  // The write succeeded in the end: conv 2 is in the file tier.
  EXPECT_EQ(e.bm->Find(e.KeyOf(2, 1)).value().first, Tier::kFile);
}

TEST(BlockManager, PrefetchOnboardsBeforeAdmission) {
  auto dev = OpenCpuDevice();
  BlockPool probe = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, 1);
  MemorySlabStore mem(probe.layout().block_bytes(), 8);
  GatedSlabStore gated(&mem);
  Env e(4, 2, 0, OnDemand(), &gated);
  e.Run(1, 1, 8);
  e.Run(2, 2, 8);
  e.Run(3, 3, 16);  // conv 1 -> host (2 blocks), conv 2 -> file (host full)
  e.Settle();
  ASSERT_EQ(e.bm->Find(e.KeyOf(2, 0)).value().first, Tier::kFile);
  ASSERT_EQ(e.bm->Find(e.KeyOf(1, 0)).value().first, Tier::kHost);
  // Conv 2 (file): prefetched while the disk is slow; the admission is not ready until it lands.
  gated.Close();
  auto n = e.bm->Prefetch(Conv(2, 8));
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 2);
  auto a = e.bm->AddSequence(10, Conv(2, 8));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->hits[0], 2);  // found in the primary tier (arriving)
  EXPECT_FALSE(a->ready);
  EXPECT_FALSE(e.bm->PollReady(10).value().ready);
  gated.Open();
  auto r = e.bm->WaitReady(10, DeadlineIn(10s));
  ASSERT_TRUE(r.ok() && r->ready);
  EXPECT_EQ(r->reused_tokens, 8);
  e.ExpectHolds(a->blocks, 2, 8);
  // Ending a sequence while its read is in flight: the block is not freed under the read.
  ASSERT_TRUE(e.bm->RemoveSequence(10).ok());
  EXPECT_GE(e.bm->stats().prefetched, 2);
}

TEST(BlockManager, RemovedWhileArrivingIsFreedOnlyAfterTheRead) {
  auto dev = OpenCpuDevice();
  BlockPool probe = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, 1);
  MemorySlabStore mem(probe.layout().block_bytes(), 8);
  GatedSlabStore gated(&mem);
  Env e(2, 2, 0, OnDemand(), &gated);
  e.Run(1, 1, 8);
  e.Run(2, 2, 8);
  e.Run(3, 3, 8);  // conv 2 -> file
  e.Settle();
  gated.Close();
  auto a = e.bm->AddSequence(4, Conv(2, 8));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->hits[2], 2);
  ASSERT_TRUE(e.bm->RemoveSequence(4).ok());
  EXPECT_EQ(e.bm->stats().free_primary, 0);  // still being written by the read
  auto busy = e.bm->AddSequence(5, Conv(9, 8));
  EXPECT_EQ(busy.status().code(), StatusCode::kResourceExhausted);
  gated.Open();
  e.Settle();
  EXPECT_EQ(e.bm->stats().cached[0], 2);  // landed: cached in the primary tier, evictable
  auto b = e.bm->AddSequence(6, Conv(2, 8));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->hits[0], 2);
  e.ExpectHolds(b->blocks, 2, 8);
}

// The file tier survives a restart: a new store on the same directory finds the verified slots,
// the new manager offers them as prefix hits, and their bytes come back intact.
TEST(BlockManager, FileTierSurvivesARestart) {
  testing_files::ScratchDir dir;
  auto dev = OpenCpuDevice();
  BlockPool probe = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, 1);
  auto open_store = [&] {
    SlabStoreOptions so;
    so.dir = dir.path();
    so.slot_payload_bytes = probe.layout().block_bytes();
    so.max_slots = 8;
    so.slots_per_file = 4;
    auto s = SlabStore::Open(so);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return std::move(s).value();
  };
  {
    auto store = open_store();
    Env e(2, 2, 0, OnDemand(), store.get());
    for (int32_t c = 1; c <= 4; ++c) e.Run(c, c, 8);  // convs 2 and 3 end up in the file tier
    e.Settle();
    EXPECT_EQ(e.bm->stats().cached[2], 4);
  }
  auto store = open_store();
  EXPECT_EQ(store->Recovered().size(), 4u);
  Env e(2, 2, 0, OnDemand(), store.get());
  EXPECT_EQ(e.bm->stats().recovered, 4);
  EXPECT_EQ(e.bm->stats().cached[2], 4);
  for (int32_t c : {2, 3}) {
    auto a = e.bm->AddSequence(static_cast<uint64_t>(10 + c), Conv(c, 8));
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->hits[2], 2) << "conversation " << c;
    auto r = e.bm->WaitReady(static_cast<uint64_t>(10 + c), DeadlineIn(10s));
    ASSERT_TRUE(r.ok() && r->ready);
    EXPECT_EQ(r->reused_tokens, 8);
    e.ExpectHolds(a->blocks, static_cast<uint64_t>(c), 8);
    ASSERT_TRUE(e.bm->RemoveSequence(static_cast<uint64_t>(10 + c)).ok());
  }
}

}  // namespace
}  // namespace kvferry::tiering

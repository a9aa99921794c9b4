#include "kvferry/block_manager.h"

#include <gtest/gtest.h>

#include <future>
#include <numeric>
#include <thread>

#include "tiering/memory_slab_store.h"
#include "tiering/tiering_test_util.h"

namespace kvferry::tiering {
namespace {

using namespace std::chrono_literals;
using testing::ExpectBlockHolds;
using testing::MakePool;

// Token ids of "conversation" c: c * 1000 + position.
std::vector<int32_t> Conv(int32_t c, int32_t n, int32_t from = 0) {
  std::vector<int32_t> t(n);
  for (int32_t i = 0; i < n; ++i) t[i] = c * 1000 + from + i;
  return t;
}

struct Env {
  Env(int64_t primary_blocks, int64_t host_blocks, int64_t file_slots, BlockManagerOptions opt = {})
      : dev(OpenCpuDevice()),
        primary(MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, primary_blocks)),
        mem(primary.layout().block_bytes(), std::max<int64_t>(file_slots, 1)),
        faults(&mem) {
    if (host_blocks > 0) {
      host.emplace(MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kPinnedHost, host_blocks));
    }
    TransferOptions to;
    to.file_staging_blocks = 4;
    tm = std::move(TransferManager::Create(*dev, primary, host ? &*host : nullptr,
                                           file_slots > 0 ? &faults : nullptr, to))
             .value();
    opt.identity.shape = primary.shape();
    opt.identity.model_id = "test-model";
    auto b = BlockManager::Create(*tm, opt);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    bm = std::move(b).value();
  }
  int64_t tpb() const { return primary.shape().tokens_per_block; }
  // What an engine's prefill does: computes the KV of a sequence's blocks (request = conv).
  void Compute(const std::vector<int64_t>& blocks, uint64_t conv, int64_t tokens) {
    ASSERT_TRUE(tm->Drain(DeadlineIn(10s)).ok());
    for (size_t i = 0; i < blocks.size(); ++i) {
      int64_t valid = std::min<int64_t>(tpb(), tokens - static_cast<int64_t>(i) * tpb());
      ASSERT_TRUE(
          FillBlock(primary, conv, BlockTokens{blocks[i], static_cast<int64_t>(i) * tpb(), valid})
              .ok());
    }
  }
  void ExpectHolds(const std::vector<int64_t>& blocks, uint64_t conv, int64_t tokens) {
    ASSERT_TRUE(tm->Drain(DeadlineIn(10s)).ok());
    for (size_t i = 0; i < blocks.size(); ++i) {
      int64_t valid = std::min<int64_t>(tpb(), tokens - static_cast<int64_t>(i) * tpb());
      if (valid <= 0) break;
      auto r =
          CheckBlock(primary, conv, BlockTokens{blocks[i], static_cast<int64_t>(i) * tpb(), valid});
      ASSERT_TRUE(r.ok());
      EXPECT_FALSE(r->has_value()) << "block " << i << ": " << (*r)->ToString();
    }
  }
  // Runs a whole request: admit, compute what was not reused, release.
  Admission Run(uint64_t id, int32_t conv, int32_t tokens, int32_t prio = kDefaultPriority) {
    auto a = bm->AddSequence(id, Conv(conv, tokens), prio);
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    if (!a.ok()) return {};
    Compute(a->blocks, static_cast<uint64_t>(conv), tokens);
    EXPECT_TRUE(bm->RemoveSequence(id).ok());
    return *a;
  }

  std::unique_ptr<Device> dev;
  BlockPool primary;
  std::optional<BlockPool> host;
  MemorySlabStore mem;
  FaultInjectingSlabStore faults;
  std::unique_ptr<TransferManager> tm;
  std::unique_ptr<BlockManager> bm;
};

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

TEST(BlockManager, CascadesHostToFileAndDropsFromTheLastTier) {
  Env e(2, 2, 2);
  e.Run(1, 1, 8);
  e.Run(2, 2, 8);  // conv 1 -> host
  e.Run(3, 3, 8);  // conv 2 -> host, conv 1 -> file
  auto st = e.bm->stats();
  EXPECT_EQ(st.demoted, 2);
  EXPECT_EQ(st.cached[2], 2);
  e.Run(4, 4, 8);  // conv 3 -> host, conv 2 -> file, conv 1 dropped from the file tier
  st = e.bm->stats();
  EXPECT_EQ(st.dropped[2], 2);
  EXPECT_EQ(st.cached[0], 2);
  EXPECT_EQ(st.cached[1], 2);
  EXPECT_EQ(st.cached[2], 2);
  auto a = e.bm->AddSequence(9, Conv(2, 8));  // conv 2 from the file tier
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->hits[2], 2);
  EXPECT_EQ(a->reused_tokens, 8);
  EXPECT_TRUE(a->misses.empty());
  e.ExpectHolds(a->blocks, 2, 8);
  auto miss = e.bm->AddSequence(10, Conv(1, 8));
  ASSERT_FALSE(miss.ok());  // all primary blocks referenced by seq 9 and 10 would need 4
  EXPECT_EQ(miss.status().code(), StatusCode::kResourceExhausted);
}

TEST(BlockManager, FailedDemotionKeepsTheHostBlock) {
  Env e(2, 2, 4);
  e.Run(1, 1, 8);
  e.Run(2, 2, 8);  // conv 1 -> host
  e.faults.FailAllWrites(true);
  e.Run(3, 3, 8);  // demotion of conv 1 fails: conv 1 stays in host; conv 2 dropped instead
  auto st = e.bm->stats();
  EXPECT_EQ(st.write_failures, 2);
  EXPECT_EQ(st.cached[1], 2);
  EXPECT_EQ(st.cached[2], 0);
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
  e.Run(3, 3, 8);  // conv 1 -> file
  auto where = e.bm->Find(
      NextKey(RootKey(CacheIdentity{"test-model", e.primary.shape(), {}, {}, 0}), Conv(1, 4)));
  ASSERT_TRUE(where.ok());
  ASSERT_EQ(where->first, Tier::kFile);
  ASSERT_TRUE(e.mem.CorruptForTest(where->second, 3));
  e.bm->DrainEvents();
  auto a = e.bm->AddSequence(4, Conv(1, 8));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->reused_tokens, 0);
  ASSERT_EQ(a->misses.size(), 1u);
  EXPECT_NE(a->misses[0].find("checksum"), std::string::npos) << a->misses[0];
  bool removed = false;
  for (const KvEvent& x : e.bm->DrainEvents()) {
    removed |= x.kind == KvEventKind::kRemoved && x.from == Tier::kFile &&
               x.reason.find("checksum") != std::string::npos;
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
  BlockManagerOptions o;
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

}  // namespace
}  // namespace kvferry::tiering

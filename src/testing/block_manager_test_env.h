// The BlockManager tests' environment, shared by block_manager_test.cc and
// block_manager_alloc_test.cc: token ids of a "conversation", on-demand options, and Env.
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <vector>

#include "kvferry/block_manager.h"
#include "testing/memory_slab_store.h"
#include "testing/tiering_test_util.h"

namespace kvferry::tiering {

// Token ids of "conversation" c: c * 1000 + position.
inline std::vector<int32_t> Conv(int32_t c, int32_t n, int32_t from = 0) {
  std::vector<int32_t> t(n);
  for (int32_t i = 0; i < n; ++i) t[i] = c * 1000 + from + i;
  return t;
}

// On-demand tiering only (no watermarks): exact, call-by-call placement for the tests below.
inline BlockManagerOptions OnDemand() {
  BlockManagerOptions o;
  o.free_low_pct = 0;
  o.free_high_pct = 0;
  return o;
}

// A primary pool (per-layer, CPU device), optional host and file tiers (in memory, behind fault
// injection), their TransferManager and a BlockManager; `store` replaces the file tier.
struct Env {
  Env(int64_t primary_blocks, int64_t host_blocks, int64_t file_slots,
      BlockManagerOptions opt = OnDemand(), SlabStore* store = nullptr)
      : dev(OpenCpuDevice()),
        primary(
            testing::MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, primary_blocks)),
        mem(primary.layout().block_bytes(), std::max<int64_t>(file_slots, 1)),
        faults(&mem) {
    if (host_blocks > 0) {
      host.emplace(
          testing::MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kPinnedHost, host_blocks));
    }
    TransferOptions to;
    to.file_staging_blocks = 4;
    SlabStore* file = store != nullptr ? store : file_slots > 0 ? &faults : nullptr;
    tm = std::move(TransferManager::Create(*dev, primary, host ? &*host : nullptr, file, to))
             .value();
    opt.identity.shape = primary.shape();
    opt.identity.model_id = "test-model";
    auto b = BlockManager::Create(*tm, opt);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    bm = std::move(b).value();
  }
  int64_t tpb() const { return primary.shape().tokens_per_block; }
  // Lets every queued copy and I/O finish and the manager retire it.
  void Settle() {
    ASSERT_TRUE(tm->Drain(DeadlineIn(std::chrono::seconds(10))).ok());
    bm->Poll();
  }
  BlockKey KeyOf(int32_t conv, int32_t block) const {
    BlockKey k = RootKey(CacheIdentity{"test-model", primary.shape(), {}, {}, 0});
    for (int32_t b = 0; b <= block; ++b) {
      k = NextKey(k, Conv(conv, static_cast<int32_t>(tpb()), b * static_cast<int32_t>(tpb())));
    }
    return k;
  }
  // What an engine's prefill does: computes the KV of a sequence's blocks (request = conv).
  // With `drain` false only the copy streams are waited for, not file I/O (a stuck disk).
  void Compute(const std::vector<int64_t>& blocks, uint64_t conv, int64_t tokens,
               bool drain = true) {
    if (drain) {
      ASSERT_TRUE(tm->Drain(DeadlineIn(std::chrono::seconds(10))).ok());
    } else {  // every batch on its stream (the submit thread's queue empty), then the streams
      ASSERT_TRUE(tm->WaitSubmitted(DeadlineIn(std::chrono::seconds(10))).ok());
      ASSERT_TRUE(tm->offload_stream().Synchronize(DeadlineIn(std::chrono::seconds(10))).ok());
      ASSERT_TRUE(tm->onboard_stream().Synchronize(DeadlineIn(std::chrono::seconds(10))).ok());
    }
    for (size_t i = 0; i < blocks.size(); ++i) {
      int64_t valid = std::min<int64_t>(tpb(), tokens - static_cast<int64_t>(i) * tpb());
      ASSERT_TRUE(
          FillBlock(primary, conv, BlockTokens{blocks[i], static_cast<int64_t>(i) * tpb(), valid})
              .ok());
    }
  }
  void ExpectHolds(const std::vector<int64_t>& blocks, uint64_t conv, int64_t tokens) {
    ASSERT_TRUE(tm->Drain(DeadlineIn(std::chrono::seconds(10))).ok());
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
  Admission Run(uint64_t id, int32_t conv, int32_t tokens, int32_t prio = kDefaultPriority,
                bool drain = true) {
    auto a = bm->AddSequence(id, Conv(conv, tokens), prio);
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    if (!a.ok()) return {};
    Compute(a->blocks, static_cast<uint64_t>(conv), tokens, drain);
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

}  // namespace kvferry::tiering

// The BlockManager calls that must not allocate on the engine's thread, counted through a
// replaced global operator new (one per test binary: it lives here only).
#include <gtest/gtest.h>

#include <cstdlib>
#include <new>

#include "kvferry/block_manager.h"
#include "testing/block_manager_test_env.h"
#include "tiering/block_manager_impl.h"

// Counts the heap allocations of the calling thread while g_count_allocs is set (the test of the
// allocation-free BlockManager calls below); every other allocation goes straight to malloc. Not
// under a sanitizer: its runtime owns the global operator new and delete (clang's TSan runtime
// defines them too: a second definition does not link), and the test skips.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVF_COUNTS_ALLOCS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define KVF_COUNTS_ALLOCS 0
#endif
#endif
#ifndef KVF_COUNTS_ALLOCS
#define KVF_COUNTS_ALLOCS 1
#endif
namespace {
thread_local bool g_count_allocs = false;
thread_local int64_t g_allocs = 0;

// The calling thread's heap allocations in fn() (when `on`; else 0).
template <typename Fn>
int64_t AllocsIn(Fn&& fn, bool on = true) {
  g_allocs = 0;
  g_count_allocs = on;
  fn();
  g_count_allocs = false;
  return on ? g_allocs : 0;
}
}  // namespace
#if KVF_COUNTS_ALLOCS
void* operator new(std::size_t n) {
  if (g_count_allocs) ++g_allocs;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
// The matching deletes (malloc'd above).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop
#endif

namespace kvferry::tiering {
namespace {

// Once its spare sequences, op item lists and scratch lists have grown, an AddSequence that
// onboards host hits and evicts inline allocates what it returns (Admission::blocks) and, now and
// then, a chunk of an op queue (std::deque); an AppendTokens next to nothing. Before, each call
// allocated the sequence's node and vectors (grown by doubling), the hit, fresh, onboard and
// offload lists and each op's item vector: 476 allocations in these 12 AddSequence calls and 62
// in the 12 AppendTokens.
TEST(BlockManager, SteadyCallsAllocateOnlyWhatTheyReturn) {
  if (!KVF_COUNTS_ALLOCS) GTEST_SKIP() << "a sanitizer's runtime owns operator new";
  Env e(8, 32, 0);
  const int32_t tokens = 6 * 4;  // 6 blocks: two conversations do not fit the primary tier
  uint64_t id = 1;
  for (int round = 0; round < 4; ++round) {
    for (int32_t c = 1; c <= 3; ++c) e.Run(id++, c, tokens);
  }
  e.Settle();
  int64_t adds = 0, add_allocs = 0, append_allocs = 0, host_hits = 0;
  const int64_t inline_before = e.bm->stats().inline_evictions;
  // The first 12 rounds warm up what the measured ones use: the transfer manager's batch states
  // (the block manager holds finished ones until Poll retires them) and the spare lists.
  for (int32_t k = 0; k < 24; ++k) {
    const int32_t c = 1 + k % 3;
    const bool counted = k >= 12;
    const std::vector<int32_t> prompt = Conv(c, tokens);
    const std::vector<int32_t> more = Conv(c, 2, tokens);
    StatusOr<Admission> a = Status::Internal("not called");
    add_allocs += AllocsIn([&] { a = e.bm->AddSequence(id, prompt, kDefaultPriority); }, counted);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    adds += counted;
    host_hits += a->hits[1];
    e.Compute(a->blocks, static_cast<uint64_t>(c), tokens);
    Status st;
    append_allocs += AllocsIn([&] { st = e.bm->AppendTokens(id, more); }, counted);
    ASSERT_TRUE(st.ok()) << st.ToString();
    ASSERT_TRUE(e.bm->RemoveSequence(id++).ok());
    e.Settle();
  }
  EXPECT_GT(host_hits, 0);                                   // onboards were made
  EXPECT_GT(e.bm->stats().inline_evictions, inline_before);  // and inline offloads
  EXPECT_LE(add_allocs, 2 * adds) << add_allocs << " allocations in " << adds << " calls";
  EXPECT_LE(append_allocs, adds / 2) << append_allocs << " allocations in " << adds << " calls";
}

// The index builds every entry up front, its tokens reserved for a block: the first fill of the
// cache (a new key per block, for as long as the tiers take to fill once) allocates nothing.
// Before, each first use of an entry allocated its token vector (and touched a new page every few
// dozen).
TEST(KeyIndex, FirstInsertsAllocateNothing) {
  if (!KVF_COUNTS_ALLOCS) GTEST_SKIP() << "a sanitizer's runtime owns operator new";
  KeyIndex index(64, 16);
  const std::vector<int32_t> toks = Conv(1, 16);
  const int64_t allocs = AllocsIn([&] {
    BlockKey parent{};
    for (uint64_t k = 1; k <= 64; ++k) {
      index.Insert(BlockKey{7, k}, parent, toks, Tier::kPrimary, static_cast<int64_t>(k), 50,
                   false);
      parent = BlockKey{7, k};
    }
    for (uint64_t k = 1; k <= 64; k += 2) index.Erase(BlockKey{7, k});
    for (uint64_t k = 1; k <= 64; k += 2) {
      index.Insert(BlockKey{8, k}, BlockKey{7, k + 1}, toks, Tier::kHost, 0, 50, false);
    }
  });
  EXPECT_EQ(allocs, 0);
  EXPECT_EQ(index.size(), 64);
  ASSERT_NE(index.Find(BlockKey{8, 63}), nullptr);
  EXPECT_EQ(index.Find(BlockKey{8, 63})->tokens, toks);
}

// An allocation that evicts with no lower tier drops its victims: their removal events keep a
// constant reason, spelled out by DrainEvents, so the call allocates what it returns and nothing
// per dropped block. Before, each drop formatted its reason into a new std::string (longer than
// the small-string buffer): 6 allocations more per call here, a prompt's worth in bench tiering's
// primary-only mode.
TEST(BlockManager, DroppingCallsAllocateNothingPerBlock) {
  if (!KVF_COUNTS_ALLOCS) GTEST_SKIP() << "a sanitizer's runtime owns operator new";
  Env e(8, 0, 0);
  const int32_t tokens = 6 * 4;  // 6 blocks: each conversation evicts the one before
  uint64_t id = 1;
  for (int32_t c = 1; c <= 3; ++c) e.Run(id++, c, tokens);  // warm-up: drops already
  (void)e.bm->DrainEvents();
  int64_t allocs = 0;
  const int64_t dropped_before = e.bm->stats().dropped[0];
  for (int32_t c = 4; c <= 9; ++c) {
    const std::vector<int32_t> prompt = Conv(c, tokens);
    StatusOr<Admission> a = Status::Internal("not called");
    allocs += AllocsIn([&] { a = e.bm->AddSequence(id, prompt, kDefaultPriority); });
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_TRUE(e.bm->RemoveSequence(id++).ok());
  }
  EXPECT_GE(e.bm->stats().dropped[0] - dropped_before, 6 * 4);
  EXPECT_LE(allocs, 6) << allocs << " allocations in 6 calls";  // Admission::blocks
  int64_t removed = 0;
  for (const KvEvent& ev : e.bm->DrainEvents()) {
    if (ev.kind != KvEventKind::kRemoved) continue;
    ++removed;
    EXPECT_EQ(ev.reason, "evicted from the primary tier, the last tier");
  }
  EXPECT_EQ(removed, e.bm->stats().dropped[0] - dropped_before);
}

}  // namespace
}  // namespace kvferry::tiering

#include "tiering/key_index.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

namespace kvferry::tiering {
namespace {

struct KeyLess {
  bool operator()(const BlockKey& a, const BlockKey& b) const {
    return a.hi != b.hi ? a.hi < b.hi : a.lo < b.lo;
  }
};

// Random inserts, overwrites and erases against std::map, in a table small enough that probe
// runs wrap around the end and backward-shift deletion moves entries across it.
TEST(FlatKeyMap, MatchesAReferenceMapThroughWrapAroundAndErase) {
  FlatKeyMap map(24);  // 64 buckets
  std::map<BlockKey, int32_t, KeyLess> ref;
  std::mt19937_64 rng(7);
  std::vector<BlockKey> universe;
  for (int i = 0; i < 40; ++i) universe.push_back(BlockKey{rng() & 0xff, rng()});
  for (int step = 0; step < 20000; ++step) {
    const BlockKey& k = universe[rng() % universe.size()];
    if (rng() % 3 == 0 || ref.size() >= 24) {
      map.Erase(k);
      ref.erase(k);
    } else {
      const int32_t v = static_cast<int32_t>(rng() % 1000);
      map.Put(k, v);
      ref[k] = v;
    }
    ASSERT_EQ(map.size(), static_cast<int64_t>(ref.size())) << "step " << step;
    if (step % 97 == 0) {
      for (const BlockKey& q : universe) {
        auto it = ref.find(q);
        ASSERT_EQ(map.Get(q), it == ref.end() ? -1 : it->second) << "step " << step;
      }
    }
  }
}

TEST(FlatKeyMap, GrowsPastItsCapacityKeepingEveryKey) {
  FlatKeyMap map(2);
  for (int32_t i = 0; i < 1000; ++i) map.Put(BlockKey{static_cast<uint64_t>(i), 1}, i);
  EXPECT_EQ(map.size(), 1000);
  for (int32_t i = 0; i < 1000; ++i) EXPECT_EQ(map.Get(BlockKey{static_cast<uint64_t>(i), 1}), i);
}

std::set<uint64_t> ChildrenOf(const KeyIndex& index, const BlockKey& parent) {
  std::set<uint64_t> out;
  index.ForEachChild(parent, [&](const Cached& c) { out.insert(c.key.lo); });
  return out;
}

TEST(KeyIndex, SiblingListsSurviveEraseInAnyOrderAndTheParentsDrop) {
  KeyIndex index(16);
  const BlockKey root{0, 0}, p{0, 100};
  const std::vector<int32_t> toks = {1, 2, 3};
  index.Insert(p, root, toks, Tier::kPrimary, 0, 35, false);
  for (uint64_t c = 1; c <= 4; ++c) {
    index.Insert(BlockKey{1, c}, p, toks, Tier::kHost, static_cast<int64_t>(c), 35, false);
  }
  index.Insert(BlockKey{2, 9}, p, {}, Tier::kFile, 9, 35, /*recovered=*/true);  // no sibling list
  EXPECT_EQ(ChildrenOf(index, p), (std::set<uint64_t>{1, 2, 3, 4}));
  index.Erase(BlockKey{1, 4});  // the head (inserted last)
  index.Erase(BlockKey{1, 2});  // a middle one
  EXPECT_EQ(ChildrenOf(index, p), (std::set<uint64_t>{1, 3}));
  index.Erase(p);  // the parent leaves; its children are still found under its key
  EXPECT_FALSE(index.Contains(p));
  EXPECT_EQ(ChildrenOf(index, p), (std::set<uint64_t>{1, 3}));
  index.Erase(BlockKey{1, 1});
  index.Erase(BlockKey{1, 3});
  EXPECT_TRUE(ChildrenOf(index, p).empty());
  // Entries are reused; a reused entry carries its new key, place and tokens only.
  const std::vector<int32_t> t2 = {7};
  Cached& c = index.Insert(BlockKey{3, 3}, p, t2, Tier::kPrimary, 5, 80, false);
  EXPECT_EQ(c.tokens, t2);
  EXPECT_EQ(index.At(BlockKey{3, 3}).id, 5);
  EXPECT_EQ(index.At(BlockKey{3, 3}).priority, 80);
  EXPECT_EQ(ChildrenOf(index, p), (std::set<uint64_t>{3}));
  EXPECT_EQ(index.size(), 2);  // the recovered entry and {3, 3}
}

}  // namespace
}  // namespace kvferry::tiering

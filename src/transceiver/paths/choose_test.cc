// The data path choice tables (paths/choose.h): each row of the context rank's table, and the
// generation rank's paths by offer and by answer, errors included.
#include "transceiver/paths/choose.h"

#include <gtest/gtest.h>

namespace kvferry {
namespace {

TEST(SendPathFor, EveryRowOfTheTableChoosesItsPath) {
  for (const SendPathRow& row : kSendPaths) {
    EXPECT_EQ(SendPathFor(row.offers_one_sided, row.one_sided_here, row.peer_pool_maps), row.path)
        << row.offers_one_sided << row.one_sided_here << row.peer_pool_maps;
  }
}

TEST(SendPathFor, AMappedPoolCountsOnlyOnTheOneSidedPath) {
  EXPECT_EQ(SendPathFor(false, true, true), DataPathKind::kTagged);
  EXPECT_EQ(SendPathFor(true, false, true), DataPathKind::kTagged);
  EXPECT_EQ(SendPathFor(true, true, true), DataPathKind::kPeerMemory);
}

constexpr PathOffer kTaggedOffer{false, false};
constexpr PathOffer kOneSidedOffer{true, false};
constexpr PathOffer kPeerOffer{true, true};

TEST(RecvPathForOffer, ReceivesByWhatTheFetchOffered) {
  const RecvSettings settings;
  PathPair fetched(PairSide::kGeneration);
  EXPECT_EQ(RecvPathForOffer(kTaggedOffer, settings)->kind(), DataPathKind::kTagged);
  auto one_sided = RecvPathForOffer(kOneSidedOffer, settings);
  EXPECT_EQ(one_sided->kind(), DataPathKind::kOneSided);
  EXPECT_FALSE(one_sided->awaits_messages(fetched));  // credits slots at once
  // Peer memory offered: one-sided, nothing credited until the context rank answers.
  auto peer = RecvPathForOffer(kPeerOffer, settings);
  EXPECT_EQ(peer->kind(), DataPathKind::kOneSided);
  EXPECT_TRUE(peer->awaits_messages(fetched));
}

// The kind after `answer` to a pair on the path of `offer` (kept: the same kind), or the error.
StatusOr<DataPathKind> After(const PathOffer& offer, const AcceptMsg& answer) {
  const RecvSettings settings;
  auto current = RecvPathForOffer(offer, settings);
  KVF_ASSIGN_OR_RETURN(auto next, RecvPathForAnswer(*current, answer, settings, 3));
  return next ? next->kind() : current->kind();
}

TEST(RecvPathForAnswer, FollowsTheTable) {
  const AcceptMsg tagged{1, 2, false, false};
  const AcceptMsg one_sided{1, 2, true, false};
  const AcceptMsg peer{1, 2, true, true};
  for (const PathOffer& offer : {kTaggedOffer, kOneSidedOffer, kPeerOffer})
    EXPECT_EQ(After(offer, tagged).value(), DataPathKind::kTagged);
  EXPECT_EQ(After(kOneSidedOffer, one_sided).value(), DataPathKind::kOneSided);
  EXPECT_EQ(After(kPeerOffer, one_sided).value(), DataPathKind::kOneSided);
  EXPECT_EQ(After(kPeerOffer, peer).value(), DataPathKind::kPeerMemory);

  auto no_target = After(kTaggedOffer, one_sided);
  ASSERT_FALSE(no_target.ok());
  EXPECT_NE(no_target.status().message().find("context rank 3 answered one-sided to a fetch "
                                              "that offered no target"),
            std::string::npos);
  for (const PathOffer& offer : {kTaggedOffer, kOneSidedOffer}) {
    auto none = After(offer, peer);
    ASSERT_FALSE(none.ok());
    EXPECT_NE(none.status().message().find("answered peer memory to a fetch that offered none"),
              std::string::npos);
  }
}

TEST(RecvPathForAnswer, APeerMemoryPathFoldsItsLastChunkOnlyWithoutChecksums) {
  const RecvSettings settings;
  auto current = RecvPathForOffer(kPeerOffer, settings);
  auto peer = RecvPathForAnswer(*current, AcceptMsg{1, 2, true, true}, settings, 0);
  ASSERT_TRUE(peer.ok() && *peer);
  PathPair p(PairSide::kGeneration);
  p.plan.chunks.resize(2);
  EXPECT_TRUE((*peer)->folds(p));
  p.checksum = true;
  EXPECT_FALSE((*peer)->folds(p));
  EXPECT_FALSE(current->folds(p));
}

}  // namespace
}  // namespace kvferry

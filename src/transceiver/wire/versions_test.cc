// Mixed wire versions (docs/wire_format.md, "Versions"): this build writes and reads version 10
// exactly as version 10 did (checked against the frozen copy in testing/wire_v10), a version-10
// rank drops what only version 11 sends, and versions outside 10..11 are refused by name.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "testing/wire_v10.h"
#include "transceiver/wire/messages.h"
#include "transceiver/wire/seeds.h"

namespace kvferry {
namespace {

std::vector<ControlMsg> EveryKind() {
  FetchMsg rma = SmallSeedFetch();
  rma.checksum = true;
  rma.rma = true;
  rma.rma_target.pool = {RemoteRegion{0x1000, 4096, {std::byte{1}, std::byte{2}}}};
  rma.rma_target.staging = RemoteRegion{0x9000, 2048, {std::byte{3}}};
  rma.rma_target.slot_bytes = 1024;
  rma.rma_target.slots = 2;
  rma.rma_target.row_min_bytes = 64;
  FetchMsg peer = rma;
  peer.checksum = false;
  peer.rma_target.peer_pool = {{std::byte{'k'}, std::byte{'v'}, std::byte{'p'}, std::byte{'m'}}};
  peer.parallel = ParallelConfig{2, 2, {3, 1}, 2, 1};
  peer.layout = LayoutKind::kVllmNhd;
  return {SmallSeedFetch(),
          rma,
          peer,
          AcceptMsg{7, 1, true, false},
          AcceptMsg{7, 1, true, true},
          RejectMsg{7, 1, 1, "no"},
          CreditMsg{7, 1, 4, {0, 1, kNoSlot}},
          DoneMsg{7, 1, 4096},
          AbortMsg{7, 1, 6, "cancelled"},
          CompleteMsg{7, 1},
          ChunkMsg{7, 1, 2, 1, true, 0x1234},
          ChunkMsg{7, 1, 0, 3, false, 0, true},
          SiblingMsg{7, {1, 2, 3}, 1, 4, "timed out"}};
}

TEST(WireVersions, Version10IsWrittenAndReadAsTheFrozenCopyDoes) {
  for (const ControlMsg& m : EveryKind()) {
    SCOPED_TRACE(m.index());
    const std::vector<std::byte> old = wire_v10::Encode(m);
    EXPECT_EQ(EncodeMessage(m, 10), old);
    EXPECT_EQ(MessageVersionOf(old), 10);
    auto ours = DecodeMessage(old);
    ASSERT_TRUE(ours.ok()) << ours.status().ToString();
    EXPECT_EQ(*ours, m);
    auto theirs = wire_v10::Decode(EncodeMessage(m, 10));
    ASSERT_TRUE(theirs.ok()) << theirs.status().ToString();
    EXPECT_EQ(*theirs, m);
    // Version 11 changed no body: only the version byte (and the seal over it) differs.
    std::vector<std::byte> now = EncodeMessage(m);
    ASSERT_EQ(now.size(), old.size());
    EXPECT_EQ(MessageVersionOf(now), kMessageVersion);
    EXPECT_TRUE(std::equal(now.begin() + 3, now.end() - 8, old.begin() + 3));
  }
}

TEST(WireVersions, AVersion10RankDropsVersion11MessagesAndVersionMessages) {
  for (const ControlMsg& m : EveryKind()) {
    auto st = wire_v10::Decode(EncodeMessage(m));
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.status().message().find("version 11 not supported"), std::string::npos)
        << st.status().ToString();
  }
  EXPECT_FALSE(wire_v10::Decode(EncodeVersionMsg({10, 11})).ok());
  // A VERSION written with the version byte 10 (none is: a rank that sends VERSION speaks 11 or
  // later) would be an unknown type there too.
  auto typed = wire_v10::Decode(EncodeVersionMsg({10, 10}));
  ASSERT_FALSE(typed.ok());
  EXPECT_NE(typed.status().message().find("unknown type 10"), std::string::npos);
}

TEST(WireVersions, VersionsOutsideTheServedRangeAreRefusedByName) {
  const ControlMsg m = CompleteMsg{7, 1};
  for (uint8_t v : {uint8_t{1}, uint8_t{9}, uint8_t{12}, uint8_t{200}}) {
    auto st = DecodeMessage(EncodeMessage(m, v));
    ASSERT_FALSE(st.ok()) << int(v);
    EXPECT_EQ(st.status().message(),
              fmt::format("control message: version {}; this rank speaks 10..11", v));
  }
  // A rank that speaks version 10 only (transfer.wire_version=10) refuses 11.
  auto st = DecodeMessage(EncodeMessage(m), VersionRange{10, 10});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("version 11; this rank speaks 10..10"), std::string::npos);
  EXPECT_TRUE(DecodeMessage(EncodeMessage(m, 10), VersionRange{10, 10}).ok());
}

TEST(WireVersions, VersionMessageReadsAtAnyVersionAndOnlyWhole) {
  for (VersionRange r : {VersionRange{10, 11}, VersionRange{12, 13}, VersionRange{1, 250}}) {
    const std::vector<std::byte> b = EncodeVersionMsg(r);
    EXPECT_EQ(b.size(), 13u);
    EXPECT_TRUE(IsVersionMsg(b));
    EXPECT_EQ(MessageVersionOf(b), r.newest);
    auto back = DecodeVersionMsg(b);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, r);
    // Not a control message of this build: its type is no ControlMsg.
    EXPECT_FALSE(DecodeMessage(b, VersionRange{1, 255}).ok());
  }
  std::vector<std::byte> b = EncodeVersionMsg({10, 11});
  for (size_t i = 0; i < b.size(); ++i) {
    std::vector<std::byte> flipped = b;
    flipped[i] ^= std::byte{0x10};
    auto st = DecodeVersionMsg(flipped);
    EXPECT_FALSE(st.ok()) << "byte " << i;
  }
  EXPECT_FALSE(DecodeVersionMsg(std::span(b).first(12)).ok());
  EXPECT_FALSE(DecodeVersionMsg(EncodeVersionMsg({12, 11})).ok());  // oldest above newest
  EXPECT_FALSE(DecodeVersionMsg(EncodeVersionMsg({0, 11})).ok());
  EXPECT_FALSE(IsVersionMsg(EncodeMessage(CompleteMsg{7, 1})));
}

}  // namespace
}  // namespace kvferry

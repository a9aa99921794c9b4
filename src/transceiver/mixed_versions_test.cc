// Mixed wire versions between instances (docs/design.md, "Mixed versions"): a rank of version 11
// meets a rank of version 10 (transfer.wire_version=10, which behaves as that build; its encoding
// is checked against the frozen copy in wire/versions_test.cc) in version 10, both ways round, and
// refuses by name a peer two versions apart, within the request's deadline.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <thread>

#include "kvferry/config.h"
#include "testing/transceiver_test_cluster.h"
#include "transceiver/engine/peer_versions.h"
#include "transceiver/wire/messages.h"

namespace kvferry {
namespace {

using namespace txtest;  // NOLINT: the shared harness
using std::chrono::milliseconds;

// Counts the control messages a side sends, by version and kind.
class VersionLog final : public TestTransport {
 public:
  struct Shared {
    Mutex mu;
    std::map<std::string, int> sent GUARDED_BY(mu);  // "11 CHUNK(complete)", "11 VERSION", ...
  };
  VersionLog(std::unique_ptr<kvferry::Transport> base, std::shared_ptr<Shared> log)
      : TestTransport(std::move(base)), log_(std::move(log)) {}
  Status SendControl(PeerId p, std::span<const std::byte> b) override {
    std::string name = "?";
    if (IsVersionMsg(b)) {
      name = "VERSION";
    } else if (auto m = DecodeMessage(b, VersionRange{1, 255}); m.ok()) {
      static const char* const kNames[] = {"FETCH", "ACCEPT",   "REJECT", "CREDIT", "DONE",
                                           "ABORT", "COMPLETE", "CHUNK",  "SIBLING"};
      name = kNames[m->index()];
      if (auto* k = std::get_if<ChunkMsg>(&*m); k && k->complete) name = "CHUNK(complete)";
    }
    {
      MutexLock lock(log_->mu);
      ++log_->sent[fmt::format("{} {}", MessageVersionOf(b), name)];
    }
    return base_->SendControl(p, b);
  }

 private:
  std::shared_ptr<Shared> log_;
};

std::map<std::string, int> Sent(VersionLog::Shared& log) {
  MutexLock lock(log.mu);
  return log.sent;
}
int Count(const std::map<std::string, int>& sent, int version) {
  int n = 0;
  for (const auto& [k, v] : sent) n += k.starts_with(fmt::format("{} ", version)) ? v : 0;
  return n;
}

class KnobScope {
 public:
  KnobScope(const char* name, const char* value) : name_(name) {
    EXPECT_TRUE(Config::Global().Set(name, value).ok());
  }
  ~KnobScope() { EXPECT_TRUE(Config::Global().Reset(name_).ok()); }

 private:
  const char* name_;
};

// TP2 -> TP1 by transport puts, every row packed into staging, context rank 1 ready only after
// rank 0's chunks landed: where a version-11 context rank sends its last CHUNK at once and
// COMPLETE later, which a version-10 generation rank would refuse (the request would fail). Each
// pair speaks the older version of its two ranks, and every element arrives.
TEST(MixedVersions, RollingUpgradeEitherWayVerifies) {
  KnobScope peer("transfer.peer_memory", "off");
  KnobScope rows("transfer.rma_row_min_bytes", "1048576");
  const struct { int ctx, gen; } kCases[] = {{10, 11}, {11, 10}, {11, 11}, {10, 10}};
  uint64_t id = 300;
  for (const auto& c : kCases) {
    SCOPED_TRACE(fmt::format("context version {}, generation version {}", c.ctx, c.gen));
    TransceiverOptions o = SmallChunks(true);
    o.checksum = false;
    auto ctx_log = std::make_shared<VersionLog::Shared>();
    auto gen_log = std::make_shared<VersionLog::Shared>();
    SideSpec ctx{Shape(), {2, 1, {}, 1, 0}};
    SideSpec gen{Shape(), {1, 1, {}, 1, 0}};
    ctx.wire_version = c.ctx;
    gen.wire_version = c.gen;
    Cluster cl(
        ctx, gen, o, [&](auto t) { return std::make_unique<VersionLog>(std::move(t), ctx_log); },
        [&](auto t) { return std::make_unique<VersionLog>(std::move(t), gen_log); });
    const int kRequests = 2;
    std::vector<std::vector<std::byte>> handles;
    for (int i = 0; i < kRequests; ++i) {
      handles.push_back(cl.Publish(id + i, {i, 5 + i}, 6, 0, false, /*only_rank=*/0));
      ASSERT_TRUE(cl.Fetch(handles.back(), {10 + i, 12 + i}).ok());
    }
    std::this_thread::sleep_for(milliseconds(200));  // rank 0's chunks land in staging slots
    for (int i = 0; i < kRequests; ++i) {
      EXPECT_EQ(cl.Publish(id + i, {i, 5 + i}, 6, 0, false, /*only_rank=*/1), handles[i]);
    }
    ExpectAllComplete(cl.Drain(0, 0, kRequests), 3 * kRequests);
    for (int i = 0; i < kRequests; ++i) cl.Verify(id + i, {10 + i, 12 + i}, 6);
    id += kRequests;

    const auto ctx_sent = Sent(*ctx_log), gen_sent = Sent(*gen_log);
    const int pair = std::min(c.ctx, c.gen);
    const int pairs = 2 * kRequests;
    // Every message between the instances in the pair's version; SIBLING (between the context
    // ranks) in the context instance's own. The generation rank's first FETCH to each context
    // rank goes in the oldest version it serves, after its VERSION.
    EXPECT_GT(Count(ctx_sent, pair), 0);
    for (const auto& [k, n] : ctx_sent) {
      // Between the context ranks: their own version (the first SIBLING after a VERSION in the
      // oldest served, as any first contact).
      if (k.ends_with("SIBLING") || k.ends_with("VERSION")) continue;
      EXPECT_TRUE(k.starts_with(fmt::format("{} ", pair))) << k << " x" << n;
    }
    // A generation rank of version 11 writes in version 10 until it hears from the context rank
    // (its FETCH and the CREDITs sent with it), then in the pair's version.
    for (const auto& [k, n] : gen_sent) {
      if (k.ends_with("VERSION")) continue;
      const bool before_answer = k.starts_with("10 ") && c.gen == 11;
      EXPECT_TRUE(k.starts_with(fmt::format("{} ", pair)) || before_answer) << k << " x" << n;
    }
    // Only a rank of version 11 advertises, once per peer (the generation rank to each of its
    // two context ranks; a context rank answers without one, having heard the generation rank).
    EXPECT_EQ(gen_sent.count("11 VERSION") ? gen_sent.at("11 VERSION") : 0, c.gen == 11 ? 2 : 0);
    if (c.ctx == 10) {
      EXPECT_EQ(Count(ctx_sent, 11), 0);
    }
    // Version 11's behaviour only between two version-11 ranks: the last CHUNKs, held while rank
    // 1 was not ready, went at once, and COMPLETE followed; version 10 holds them and folds.
    const auto at = [&](const char* what) {
      auto it = ctx_sent.find(fmt::format("{} {}", pair, what));
      return it == ctx_sent.end() ? 0 : it->second;
    };
    if (pair == 11) {
      EXPECT_GT(at("COMPLETE"), 0);
    } else {
      EXPECT_EQ(at("COMPLETE"), 0);
      EXPECT_EQ(at("CHUNK(complete)"), pairs);
    }
    EXPECT_EQ(cl.gen_[0]->stats().staging_slots_in_use, 0);
  }
}

// A peer two versions apart (a build that speaks 12..13, or one of version 9) is refused: the
// generation rank's request fails at once with a reason naming the context rank and both
// versions, long before its deadline, where the peer negotiates; a version-9 generation rank,
// which can't learn why, ends at its deadline. Either way no request is left behind.
TEST(MixedVersions, APeerTwoVersionsApartIsRefusedByName) {
  KnobScope peer("transfer.peer_memory", "off");
  const struct {
    int ctx, gen;
    const char* reason;  // in the generation request's failure; empty: it times out
  } kCases[] = {
      {13, 11, "context rank 0: peer "},
      {11, 13, "context rank 0: peer "},
      {11, 9, ""},
      {9, 11, ""},
  };
  uint64_t id = 400;
  for (const auto& c : kCases) {
    SCOPED_TRACE(fmt::format("context version {}, generation version {}", c.ctx, c.gen));
    TransceiverOptions o = SmallChunks(true);
    o.timeout = milliseconds(1500);
    SideSpec ctx{Shape(), {1, 1, {}, 1, 0}};
    SideSpec gen{Shape(), {1, 1, {}, 1, 0}};
    ctx.wire_version = c.ctx;
    gen.wire_version = c.gen;
    Cluster cl(ctx, gen, o);
    auto h = cl.Publish(++id, {1, 2}, 6);
    ASSERT_FALSE(h.empty());
    const auto start = Clock::now();
    const std::vector<int64_t> blocks{3, 4};
    ASSERT_TRUE(cl.gen_[0]->Fetch(h, blocks, 0).ok());
    auto st = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(5000)));
    const auto took = Clock::now() - start;
    ASSERT_EQ(st.size(), 1u);
    if (*c.reason) {
      EXPECT_EQ(st[0].state, TransferState::kError);
      const std::string why(st[0].reason.message());
      EXPECT_NE(why.find(c.reason), std::string::npos) << why;
      const VersionRange theirs = PeerVersions::RangeOf(static_cast<uint8_t>(c.ctx)),
                         ours = PeerVersions::RangeOf(static_cast<uint8_t>(c.gen));
      EXPECT_NE(why.find(fmt::format("speaks wire versions {}..{}; this rank speaks {}..{}",
                                     theirs.oldest, theirs.newest, ours.oldest, ours.newest)),
                std::string::npos)
          << why;
      EXPECT_LT(took, milliseconds(500)) << "refused only at the deadline";
    } else {
      EXPECT_EQ(st[0].state, TransferState::kTimedOut) << st[0].reason.ToString();
      EXPECT_LT(took, o.timeout + milliseconds(1000));
    }
    // The context rank's request ends at its own deadline (no generation rank it can serve
    // fetched it), releasing its blocks.
    auto ctx_st = cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(5000)));
    ASSERT_EQ(ctx_st.size(), 1u);
    EXPECT_NE(ctx_st[0].state, TransferState::kComplete);
    EXPECT_EQ(cl.gen_[0]->stats().staging_slots_in_use, 0);
  }
}

// The table itself: first contact, learning an older peer, refusing with a reply.
TEST(PeerVersions, NegotiatesAtFirstContact) {
  PeerVersions v(11);
  EXPECT_EQ(v.ours(), (VersionRange{10, 11}));
  EXPECT_EQ(v.SendVersion(1), 10);  // nothing heard: the oldest served, which 10 reads
  auto hello = v.HelloFor(1);
  ASSERT_TRUE(hello);
  EXPECT_EQ(*DecodeVersionMsg(*hello), (VersionRange{10, 11}));
  EXPECT_FALSE(v.HelloFor(1));  // once per peer

  // A version-11 peer says so: the pair speaks 11.
  auto in = v.OnReceive(1, EncodeVersionMsg({10, 11}), "inproc:1");
  EXPECT_EQ(in.kind, PeerVersions::Incoming::kConsumed);
  EXPECT_EQ(v.SendVersion(1), 11);
  // A version-10 peer sends no VERSION: its first message's header says what it speaks.
  in = v.OnReceive(2, EncodeMessage(CompleteMsg{1, 1}, 10), "inproc:2");
  EXPECT_EQ(in.kind, PeerVersions::Incoming::kDeliver);
  EXPECT_EQ(v.SendVersion(2), 10);
  EXPECT_FALSE(v.HelloFor(2));  // it would drop one
  // A later build that still serves 11 speaks 11 with us.
  in = v.OnReceive(3, EncodeVersionMsg({11, 12}), "inproc:3");
  EXPECT_EQ(in.kind, PeerVersions::Incoming::kConsumed);
  EXPECT_EQ(v.PairVersion(3), 11);

  // Two apart, by VERSION: refused with both ranges, our VERSION in reply, nothing after.
  in = v.OnReceive(4, EncodeVersionMsg({12, 13}), "inproc:4");
  EXPECT_EQ(in.kind, PeerVersions::Incoming::kRefused);
  EXPECT_EQ(in.why.message(),
            "peer inproc:4 speaks wire versions 12..13; this rank speaks 10..11: incompatible, "
            "refused");
  ASSERT_TRUE(in.reply);
  EXPECT_EQ(*DecodeVersionMsg(*in.reply), (VersionRange{10, 11}));
  EXPECT_TRUE(v.Refusal(4));
  EXPECT_EQ(v.OnReceive(4, EncodeMessage(CompleteMsg{1, 1}, 12), "inproc:4").kind,
            PeerVersions::Incoming::kConsumed);
  // Two apart, by a message of version 9 (such a build sends no VERSION).
  in = v.OnReceive(5, EncodeMessage(CompleteMsg{1, 1}, 9), "inproc:5");
  EXPECT_EQ(in.kind, PeerVersions::Incoming::kRefused);
  EXPECT_NE(in.why.message().find("peer inproc:5 sent a control message of wire version 9"),
            std::string::npos);

  // A rank speaking version 10 behaves as that build: no VERSION, 10 only.
  PeerVersions old(10);
  EXPECT_EQ(old.ours(), (VersionRange{10, 10}));
  EXPECT_FALSE(old.HelloFor(1));
  // It hands everything to its decoder, which drops what it can't read (a VERSION, version 11).
  EXPECT_EQ(old.OnReceive(1, EncodeVersionMsg({10, 11}), "x").kind,
            PeerVersions::Incoming::kDeliver);
  EXPECT_FALSE(old.Refusal(1));
}

}  // namespace
}  // namespace kvferry

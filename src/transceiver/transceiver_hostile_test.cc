// Hostile and corrupted input to the transceiver, end to end over the in-process transport: a
// FETCH altered in transit, handles with altered fields, sizes or chunk counts, a FETCH whose
// plan would outgrow the pools, partial fetches and forged messages from another peer. Nothing
// outside the destination is ever written, and every request ends.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <optional>

#include "kvferry/config.h"
#include "kvferry/inproc_transport.h"
#include "kvferry/transceiver.h"
#include "kvferry/transport_wrapper.h"
#include "testing/testdata.h"
#include "testing/transceiver_test_cluster.h"
#include "transceiver/engine/engine.h"
#include "transceiver/wire/handle.h"
#include "transceiver/wire/messages.h"

namespace kvferry {
namespace {

using namespace txtest;  // NOLINT: the shared harness

// A FETCH corrupted in transit (one field changed, nothing re-sealed): here the generation pool's
// block count, on a per-layer pool whose K and V halves are pool_blocks blocks apart. On the
// one-sided path the context rank derived the generation layout from it and put V rows into other
// blocks (other requests' data, already checked). Found by the soak (`cli.soak_ucx_short`: a
// completed request with wrong bytes, DATA_LOSS at verify, after a corrupted FETCH). The FETCH
// now carries a checksum: a corrupted one is dropped, and nothing outside the destination is
// written.
TEST(Transceiver, FetchCorruptedInTransitWritesNothingOutsideTheDestination) {
  ASSERT_TRUE(Config::Global().Set("transfer.rma_row_min_bytes", "1").ok());
  TransceiverOptions o = SmallChunks(true);
  o.timeout = milliseconds(500);
  class InTransit final : public TestTransport {
   public:
    explicit InTransit(std::unique_ptr<kvferry::Transport> base) : TestTransport(std::move(base)) {}
    Status SendControl(PeerId p, std::span<const std::byte> b) override {
      auto m = DecodeMessage(b);
      if (!m.ok() || !std::holds_alternative<FetchMsg>(*m)) return base_->SendControl(p, b);
      // The bytes of the changed message, with the original's trailing bytes (its checksum, if
      // it has one): what a flipped bit on the way looks like.
      FetchMsg changed = std::get<FetchMsg>(*m);
      changed.pool_blocks = 32;  // 64: the V half of a layer lands 32 blocks early
      std::vector<std::byte> bytes = EncodeMessage(changed);
      EXPECT_EQ(bytes.size(), b.size());
      std::copy(b.end() - 8, b.end(), bytes.end() - 8);
      return base_->SendControl(p, bytes);
    }
  };
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}, LayoutKind::kPerLayer, 64}, o,
             {}, [](auto t) { return std::make_unique<InTransit>(std::move(t)); });
  auto h = cl.Publish(27, {3, 4, 9}, 11);
  ASSERT_TRUE(cl.Fetch(h, {0, 5, 6}).ok());
  auto st = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(5000)));
  ASSERT_EQ(st.size(), 1u);
  EXPECT_NE(st[0].state, TransferState::kComplete);
  cl.Verify(27, {0, 5, 6}, 0, 0, 0, /*sentinels=*/true);
  EXPECT_TRUE(Config::Global().Reset("transfer.rma_row_min_bytes").ok());
}

// Issue 29: a handle with its layout byte or layer-wise flag altered (re-encoded: a valid
// checksum) kept its token, and on the tagged path without checksums completed with wrong KV
// (16 of 16). The token now authenticates every byte: the context rank leaves the FETCH
// unanswered, both sides end the request at their deadlines, and no destination block is written.
TEST(Transceiver, HandleWithAlteredLayoutOrFlagsIsNeverServed) {
  TransceiverOptions o;
  o.timeout = milliseconds(1500);
  o.rma = false;
  o.checksum = false;
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  const std::function<void(ContextHandle&)> alterations[] = {
      [](ContextHandle& h) { h.layout = LayoutKind::kBlockMajorNhd; },
      [](ContextHandle& h) { h.layer_wise = !h.layer_wise; },
  };
  uint64_t id = 51;
  for (const auto& alter : alterations) {
    auto decoded = DecodeHandle(cl.Publish(id, {0, 1}, 8));
    ASSERT_TRUE(decoded.ok());
    ContextHandle altered = *decoded;
    alter(altered);
    ASSERT_TRUE(cl.Fetch(EncodeHandle(altered), {2, 3}).ok());
    auto gs = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(6000)));
    ASSERT_EQ(gs.size(), 1u);
    EXPECT_EQ(gs[0].state, TransferState::kTimedOut) << gs[0].reason.ToString();
    EXPECT_EQ(gs[0].bytes, 0) << "bytes of an altered handle's request arrived";
    auto cs = cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(6000)));
    ASSERT_EQ(cs.size(), 1u);
    EXPECT_EQ(cs[0].state, TransferState::kTimedOut) << cs[0].reason.ToString();
    ++id;
  }
}

// A handle with a valid checksum (re-encoded) but hostile sizes: refused with the field named,
// or served, never an abort of the generation process (a bitmap or reservation sized by them).
TEST(Transceiver, HostileHandleSizesAreRefusedOrHarmless) {
  TransceiverOptions o;
  o.timeout = milliseconds(1500);
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  auto h = cl.Publish(21, {0, 1}, 8);
  auto decoded = DecodeHandle(h);
  ASSERT_TRUE(decoded.ok());
  ContextHandle hostile = *decoded;
  hostile.pool_blocks = int64_t{1} << 60;
  Status st = cl.Fetch(EncodeHandle(hostile), {0, 1});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("pool_blocks=1152921504606846976"), std::string_view::npos)
      << st.ToString();
  hostile = *decoded;
  hostile.chunk_bytes = 1;  // the generation rank plans with one-byte chunks: within bounds here
  hostile.prompt_tokens = INT64_MAX;
  st = cl.Fetch(EncodeHandle(hostile), {0, 1});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  // A context pool of 2^40 blocks sizes nothing here, but the handle is altered: the context
  // rank leaves its FETCH unanswered (the token authenticates every byte); the genuine handle
  // is served.
  hostile = *decoded;
  hostile.pool_blocks = int64_t{1} << 40;
  ASSERT_TRUE(cl.Fetch(EncodeHandle(hostile), {0, 1}).ok());
  auto polled = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(6000)));
  ASSERT_EQ(polled.size(), 1u);
  EXPECT_EQ(polled[0].state, TransferState::kTimedOut) << polled[0].reason.ToString();
  polled = cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(6000)));  // 21, never fetched
  ASSERT_EQ(polled.size(), 1u);
  EXPECT_EQ(polled[0].state, TransferState::kTimedOut) << polled[0].reason.ToString();
  h = cl.Publish(23, {0, 1}, 8);
  ASSERT_TRUE(cl.Fetch(h, {0, 1}).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1), 2);
  cl.Verify(23, {0, 1}, 8);
}

// A handle naming tiny chunks (valid checksum, re-encoded) is refused by the generation rank's
// chunk cap, which follows from its own chunk size (PlanChunkCap: its 4 MiB of staging and 96 KiB
// of pool in chunks of 1 MiB, times 64 = 256 chunks), naming the field and the bound; its memory
// budget alone (576 chunks of 512 bytes < 4 MiB) let it plan 576 chunks of 32 bytes.
TEST(Transceiver, HandleWithTinyChunksIsRefusedByTheRanksChunkCap) {
  TransceiverOptions o;
  o.chunk_bytes = 1 << 20;
  o.staging_chunks = 4;
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  auto h = cl.Publish(31, {0, 1, 2}, 12);  // 3 blocks of 6 KiB
  auto decoded = DecodeHandle(h);
  ASSERT_TRUE(decoded.ok());
  ContextHandle tiny = *decoded;
  tiny.chunk_bytes = 32;
  Status st = cl.Fetch(EncodeHandle(tiny), {3, 4, 5});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("chunk_bytes=32 "), std::string_view::npos) << st.ToString();
  EXPECT_NE(st.message().find("max_chunks=256 "), std::string_view::npos) << st.ToString();
  // The genuine handle (chunks of 1 MiB) is served.
  ASSERT_TRUE(cl.Fetch(h, {3, 4, 5}).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1), 2);
  cl.Verify(31, {3, 4, 5}, 12);
}

// A FETCH with the request's valid token but hostile sizes, sent straight to a context rank: a
// REJECT naming the field, not an abort of the context process; the genuine fetch still works.
TEST(Transceiver, HostileFetchWithAValidTokenIsRejected) {
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}});
  auto h = cl.Publish(22, {0, 1}, 8);
  auto decoded = DecodeHandle(h);
  ASSERT_TRUE(decoded.ok());
  auto peer_transport = cl.Transport();
  auto peer = peer_transport->Connect(cl.ctx_[0]->address(), DeadlineIn(milliseconds(1000)));
  ASSERT_TRUE(peer.ok());
  auto send_and_wait_reply = [&](const FetchMsg& f) -> StatusOr<ControlMsg> {
    EXPECT_TRUE(peer_transport->SendControl(*peer, EncodeMessage(f)).ok());
    auto deadline = DeadlineIn(milliseconds(3000));
    while (Clock::now() < deadline) {
      peer_transport->Progress();
      if (auto m = peer_transport->PollControl()) return DecodeMessage(m->bytes);
      std::this_thread::sleep_for(milliseconds(1));
    }
    return Status::DeadlineExceeded("no reply");
  };
  FetchMsg f;
  f.request_id = 22;
  f.token = decoded->token;
  f.handle_digest = HandleDigestOf(h);
  f.gen_instance = 99;
  f.gen_rank = 0;
  f.transfer_id = 5;
  f.shape = Shape();
  f.parallel = {1, 1, {}, 1, 0};
  f.prompt_tokens = 8;
  f.chunk_bytes = 4096;
  f.direct_min_bytes = kNoDirect;
  f.blocks = {0, 1};
  struct Hostile {
    const char* field;
    std::function<void(FetchMsg&)> set;
  };
  const Hostile cases[] = {
      {"pool_blocks=1152921504606846976", [](FetchMsg& m) { m.pool_blocks = int64_t{1} << 60; }},
      {"tp=65536 * pp=65536",
       [](FetchMsg& m) {
         m.parallel = {1 << 16, 1 << 16, {}, 1, 0};
         m.pool_blocks = 16;
       }},
      {"reused_blocks", [](FetchMsg& m) { m.reused_blocks = INT64_MIN; }},
  };
  for (const Hostile& c : cases) {
    FetchMsg m = f;
    m.pool_blocks = int64_t{1} << 40;
    c.set(m);
    auto reply = send_and_wait_reply(m);
    ASSERT_TRUE(reply.ok()) << c.field << ": " << reply.status().ToString();
    auto* rej = std::get_if<RejectMsg>(&*reply);
    ASSERT_NE(rej, nullptr) << c.field << ": expected a REJECT";
    EXPECT_EQ(rej->code, static_cast<uint8_t>(StatusCode::kInvalidArgument));
    EXPECT_NE(rej->reason.find(c.field), std::string::npos) << rej->reason;
  }
  // A generation pool of 2^40 blocks, otherwise genuine: accepted (it sizes nothing here).
  FetchMsg big = f;
  big.pool_blocks = int64_t{1} << 40;
  big.transfer_id = 6;
  auto reply = send_and_wait_reply(big);
  ASSERT_TRUE(reply.ok());
  EXPECT_NE(std::get_if<AcceptMsg>(&*reply), nullptr);
  // An ABORT whose code byte is 0 (OK): the request still ends with a failure reason.
  AbortMsg abort{22, 6, 0, "test done"};
  ASSERT_TRUE(peer_transport->SendControl(*peer, EncodeMessage(abort)).ok());
  auto cs = cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(cs.size(), 1u);
  EXPECT_EQ(cs[0].state, TransferState::kError);
  EXPECT_EQ(cs[0].reason.code(), StatusCode::kInternal) << cs[0].reason.ToString();
  EXPECT_NE(cs[0].reason.message().find("status code 0"), std::string_view::npos);
  // The context rank still serves: a new request goes through.
  auto h2 = cl.Publish(23, {2, 3}, 8);
  ASSERT_TRUE(cl.Fetch(h2, {2, 3}).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1), 2);
  cl.Verify(23, {2, 3}, 8);
}

// A FETCH with the request's valid token and one-byte chunks: the context rank would plan about
// 2^20 chunks (some 150 MB and 0.6 s of CPU) for a 1 MiB request. The plan is bounded by the
// rank's own pool and staging (33 MiB here): a REJECT naming chunk_bytes and the bound, and the
// genuine fetch still works.
TEST(Transceiver, FetchCannotMakeAPlanLargerThanThePoolAndStaging) {
  TransceiverOptions o;
  o.chunk_bytes = 4 << 20;
  o.staging_chunks = 8;
  Cluster cl({Shape(), {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 192},
             {Shape(), {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 192}, o);
  std::vector<int64_t> blocks(170);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<int64_t>(i);
  const int64_t tokens = 170 * 4;  // 170 blocks of 6 KiB: 1,044,480 bytes
  auto h = cl.Publish(26, blocks, tokens);
  auto decoded = DecodeHandle(h);
  ASSERT_TRUE(decoded.ok());
  auto peer_transport = cl.Transport();
  auto peer = peer_transport->Connect(cl.ctx_[0]->address(), DeadlineIn(milliseconds(1000)));
  ASSERT_TRUE(peer.ok());
  FetchMsg f;
  f.request_id = 26;
  f.token = decoded->token;
  f.handle_digest = HandleDigestOf(h);
  f.gen_instance = 99;
  f.gen_rank = 0;
  f.transfer_id = 5;
  f.shape = Shape();
  f.parallel = {1, 1, {}, 1, 0};
  f.pool_blocks = 192;
  f.prompt_tokens = tokens;
  f.chunk_bytes = 1;
  f.direct_min_bytes = kNoDirect;
  f.blocks = blocks;
  ASSERT_TRUE(peer_transport->SendControl(*peer, EncodeMessage(f)).ok());
  std::optional<ControlMsg> reply;
  for (auto deadline = DeadlineIn(milliseconds(10000)); !reply && Clock::now() < deadline;) {
    peer_transport->Progress();
    if (auto m = peer_transport->PollControl()) {
      auto decoded_reply = DecodeMessage(m->bytes);
      ASSERT_TRUE(decoded_reply.ok());
      reply = *decoded_reply;
    }
    std::this_thread::sleep_for(milliseconds(1));
  }
  ASSERT_TRUE(reply.has_value()) << "no reply to the FETCH";
  auto* rej = std::get_if<RejectMsg>(&*reply);
  ASSERT_NE(rej, nullptr) << "a FETCH with one-byte chunks was accepted";
  EXPECT_EQ(rej->code, static_cast<uint8_t>(StatusCode::kInvalidArgument));
  EXPECT_NE(rej->reason.find("chunk_bytes=1 "), std::string::npos) << rej->reason;
  EXPECT_NE(rej->reason.find("max_plan_bytes=34734080"), std::string::npos) << rej->reason;
  // The genuine fetch is served.
  ASSERT_TRUE(cl.Fetch(h, blocks).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1), 2);
  cl.Verify(26, blocks, tokens);
}

// A Fetch that fails part-way (the second context rank is unreachable) tells the context rank it
// already asked: that rank ends the request (and releases its blocks) at once, not at its deadline,
// and tells the other context rank of its DP group, which ends it too.
TEST(Transceiver, PartialFetchAbortsTheContextRanksAlreadyContacted) {
  TransceiverOptions o;
  o.timeout = milliseconds(20000);
  // The generation rank can't reach context rank 1 (an altered handle would not do: context rank
  // 0 leaves the FETCH of a handle whose token does not authenticate it unanswered).
  auto unreachable = std::make_shared<std::string>();
  class Unreachable final : public TransportWrapper {
   public:
    Unreachable(std::unique_ptr<kvferry::Transport> t, std::shared_ptr<std::string> address)
        : TransportWrapper(std::move(t)), address_(std::move(address)) {}
    StatusOr<PeerId> Connect(std::string_view address, Deadline deadline) override {
      if (address == *address_) return Status::Unavailable("nobody there");
      return TransportWrapper::Connect(address, deadline);
    }

   private:
    std::shared_ptr<std::string> address_;
  };
  Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o, {},
             [unreachable](std::unique_ptr<kvferry::Transport> t) {
               return std::make_unique<Unreachable>(std::move(t), unreachable);
             });
  *unreachable = cl.ctx_[1]->address();
  auto h = cl.Publish(24, {0, 1}, 8);
  auto t0 = Clock::now();
  // Fetch does not wait for the progress thread: the unreachable rank ends the request in Poll.
  Status st = cl.gen_[0]->Fetch(h, std::vector<int64_t>{0, 1}, 0);
  ASSERT_TRUE(st.ok()) << st.ToString();
  auto gs = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(gs.size(), 1u);
  EXPECT_EQ(gs[0].state, TransferState::kError);
  EXPECT_EQ(gs[0].reason.code(), StatusCode::kUnavailable) << gs[0].reason.ToString();
  EXPECT_NE(gs[0].reason.message().find("context rank 1"), std::string_view::npos)
      << gs[0].reason.ToString();
  auto cs = cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(cs.size(), 1u) << "context rank 0 still holds request 24";
  EXPECT_EQ(cs[0].state, TransferState::kError);
  EXPECT_NE(cs[0].reason.message().find("aborted"), std::string_view::npos)
      << cs[0].reason.ToString();
  // Context rank 1, never reached, is told by context rank 0 (SIBLING, wire version 8).
  auto other = cl.ctx_[1]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(other.size(), 1u) << "context rank 1 still holds request 24";
  EXPECT_EQ(other[0].state, TransferState::kError);
  EXPECT_NE(other[0].reason.message().find("context rank 0 ended it"), std::string_view::npos)
      << other[0].reason.ToString();
  EXPECT_LT(Clock::now() - t0, milliseconds(3000));
}

// Another peer of the fabric forges COMPLETE (and ACCEPT) for the generation rank's transfers
// (their ids are small numbers): the request must not be reported complete before its data is
// in place. Found by the protocol fuzzer (fuzz/corpus/protocol_fuzz/forged_complete).
TEST(Transceiver, ForgedCompleteFromAnotherPeerIsIgnored) {
  Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}});
  auto h = cl.Publish(25, {0, 1}, 8, 0, /*layer_wise=*/true);  // nothing ready: no data yet
  ASSERT_TRUE(cl.Fetch(h, {4, 5}).ok());
  // Fetch returns before its progress thread sent the FETCHes: forged messages that came before
  // would be dropped as unknown and prove nothing (on a loaded machine that took over 100 ms).
  for (auto end = Clock::now() + milliseconds(5000); Clock::now() < end;) {
    auto q = cl.gen_[0]->Query(25);
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    if (q->state != TransferState::kInit) break;
    std::this_thread::sleep_for(milliseconds(1));
  }
  auto hostile = cl.Transport();
  auto peer = hostile->Connect(cl.gen_[0]->address(), DeadlineIn(milliseconds(1000)));
  ASSERT_TRUE(peer.ok());
  for (uint32_t tid = 0; tid < 8; ++tid) {
    ASSERT_TRUE(hostile->SendControl(*peer, EncodeMessage(AcceptMsg{25, tid})).ok());
    ASSERT_TRUE(hostile->SendControl(*peer, EncodeMessage(CompleteMsg{25, tid})).ok());
  }
  std::this_thread::sleep_for(milliseconds(100));
  auto st = cl.gen_[0]->Query(25);
  ASSERT_TRUE(st.ok()) << "reported before its data arrived: " << st.status().ToString();
  EXPECT_EQ(st->state, TransferState::kInProgress);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(cl.ctx_[r]->MarkLayersReady(25, 6).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1), 3);
  cl.Verify(25, {4, 5}, 8);
}

}  // namespace
}  // namespace kvferry

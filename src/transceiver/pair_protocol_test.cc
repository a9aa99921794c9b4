// A pair's protocol phase (transceiver/pair_state.h) as both sides apply it: a message the
// protocol has no step for in the pair's phase, sent by the pair's own peer (a test transport
// playing the other side by hand), fails the request at once with an error naming the message and
// the phase, tells the peer, and leaves no staging slot leased.
#include <gtest/gtest.h>

#include <optional>
#include <thread>

#include "kvferry/config.h"
#include "testing/transceiver_test_cluster.h"
#include "transceiver/wire/handle.h"
#include "transceiver/wire/messages.h"

namespace kvferry {
namespace {

using namespace txtest;  // NOLINT: the shared harness

// The next control message of type T that `t` receives within 3 s, and who sent it.
template <typename T>
std::optional<std::pair<PeerId, T>> WaitFor(Transport& t) {
  for (auto deadline = DeadlineIn(milliseconds(3000)); Clock::now() < deadline;) {
    t.Progress();
    if (auto m = t.PollControl()) {
      auto msg = DecodeMessage(m->bytes);
      if (!msg.ok()) continue;
      if (auto* want = std::get_if<T>(&*msg)) return std::pair{m->from, *want};
      continue;
    }
    std::this_thread::sleep_for(milliseconds(1));
  }
  return std::nullopt;
}

// Publishes request `id` on context rank 0 and has generation rank 0 fetch it from `fake_ctx`
// instead (a test transport playing context rank 0, by hand): the FETCH that reached it, and from
// whom; none when the fetch failed or no FETCH came within 3 s.
std::optional<std::pair<PeerId, FetchMsg>> FetchRedirectedTo(Cluster& cl, Transport& fake_ctx,
                                                             uint64_t id) {
  auto decoded = DecodeHandle(cl.Publish(id, {0, 1}, 8));
  if (!decoded.ok()) {
    ADD_FAILURE() << decoded.status().ToString();
    return std::nullopt;
  }
  ContextHandle redirected = *decoded;
  redirected.addresses[0] = fake_ctx.LocalAddress();
  Status fetched = cl.gen_[0]->Fetch(EncodeHandle(redirected), std::vector<int64_t>{4, 5}, 0);
  if (!fetched.ok()) {
    ADD_FAILURE() << fetched.ToString();
    return std::nullopt;
  }
  return WaitFor<FetchMsg>(fake_ctx);
}

// The generation side: COMPLETE answers a pair's DONE (or, alone, a pair with no chunks), so one
// from the context rank before any of the pair's chunks is an error. It used to be dropped
// silently and the request waited for its deadline (20 s here).
TEST(PairProtocol, CompleteBeforeDoneFailsTheGenerationRequestNamingWhy) {
  TransceiverOptions o;
  o.timeout = milliseconds(20000);
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  auto fake_ctx = cl.Transport();  // plays context rank 0
  auto fetch = FetchRedirectedTo(cl, *fake_ctx, 31);
  ASSERT_TRUE(fetch.has_value()) << "no FETCH reached the fake context rank";
  const auto [gen_peer, f] = *fetch;
  ASSERT_TRUE(fake_ctx->SendControl(gen_peer, EncodeMessage(CompleteMsg{31, f.transfer_id})).ok());

  auto st = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(st.size(), 1u) << "a COMPLETE before DONE left the request waiting";
  EXPECT_EQ(st[0].state, TransferState::kError) << TransferStateName(st[0].state);
  EXPECT_EQ(st[0].reason.code(), StatusCode::kInvalidArgument) << st[0].reason.ToString();
  const std::string why(st[0].reason.message());
  EXPECT_NE(why.find("request 31: context rank 0 said COMPLETE before any of its"),
            std::string::npos)
      << why;
  // The context rank is told the request is off.
  auto abort = WaitFor<AbortMsg>(*fake_ctx);
  ASSERT_TRUE(abort.has_value()) << "the context rank was not told";
  EXPECT_EQ(abort->second.transfer_id, f.transfer_id);
  EXPECT_EQ(cl.gen_[0]->stats().staging_slots_in_use, 0);
  ASSERT_TRUE(cl.ctx_[0]->Cancel(31).ok());  // the genuine context rank never heard a FETCH
}

// A CHUNK saying complete (wire version 6) ends a pair without DONE and stands for ACCEPT: only a
// lone context rank's peer-memory pair may end so. Sent for a FETCH that offered no peer memory,
// it fails the request naming why, and the context rank is told (the pair did not end).
TEST(PairProtocol, CompleteChunkForAPairWithoutPeerMemoryFailsTheRequest) {
  ASSERT_TRUE(Config::Global().Set("transfer.peer_memory", "off").ok());
  TransceiverOptions o;
  o.timeout = milliseconds(20000);
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  auto fake_ctx = cl.Transport();  // plays context rank 0
  auto fetch = FetchRedirectedTo(cl, *fake_ctx, 33);
  ASSERT_TRUE(fetch.has_value()) << "no FETCH reached the fake context rank";
  const auto [gen_peer, f] = *fetch;
  EXPECT_TRUE(f.rma_target.peer_pool.empty());
  ChunkMsg last{33, f.transfer_id, 0, 1, false, 0};
  last.complete = true;
  ASSERT_TRUE(fake_ctx->SendControl(gen_peer, EncodeMessage(last)).ok());

  auto st = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  EXPECT_TRUE(Config::Global().Reset("transfer.peer_memory").ok());
  ASSERT_EQ(st.size(), 1u) << "a CHUNK saying complete left the request waiting";
  EXPECT_EQ(st[0].state, TransferState::kError) << TransferStateName(st[0].state);
  const std::string why(st[0].reason.message());
  EXPECT_NE(why.find("request 33: context rank 0 said complete"), std::string::npos) << why;
  EXPECT_NE(why.find("no peer memory offered"), std::string::npos) << why;
  auto abort = WaitFor<AbortMsg>(*fake_ctx);
  ASSERT_TRUE(abort.has_value()) << "the context rank was not told";
  EXPECT_EQ(abort->second.transfer_id, f.transfer_id);
  ASSERT_TRUE(cl.ctx_[0]->Cancel(33).ok());  // the genuine context rank never heard a FETCH
}

// A pair by puts without checksums says no DONE; its COMPLETE may follow a last CHUNK sent on its
// own (wire version 11), never precede it: a COMPLETE before the pair's chunks were reported fails
// the request naming why, and the context rank is told.
TEST(PairProtocol, CompleteBeforeTheLastChunkOfAPutPairFailsTheRequest) {
  ASSERT_TRUE(Config::Global().Set("transfer.peer_memory", "off").ok());
  TransceiverOptions o;
  o.timeout = milliseconds(20000);
  o.checksum = false;
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  auto fake_ctx = cl.Transport();  // plays context rank 0
  auto fetch = FetchRedirectedTo(cl, *fake_ctx, 35);
  ASSERT_TRUE(fetch.has_value()) << "no FETCH reached the fake context rank";
  const auto [gen_peer, f] = *fetch;
  ASSERT_TRUE(
      fake_ctx->SendControl(gen_peer, EncodeMessage(AcceptMsg{35, f.transfer_id, true, false}))
          .ok());
  ASSERT_TRUE(fake_ctx->SendControl(gen_peer, EncodeMessage(CompleteMsg{35, f.transfer_id})).ok());

  auto st = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  EXPECT_TRUE(Config::Global().Reset("transfer.peer_memory").ok());
  ASSERT_EQ(st.size(), 1u) << "a COMPLETE before the last CHUNK left the request waiting";
  EXPECT_EQ(st[0].state, TransferState::kError) << TransferStateName(st[0].state);
  const std::string why(st[0].reason.message());
  EXPECT_NE(why.find("request 35: context rank 0 said COMPLETE before its last CHUNK"),
            std::string::npos)
      << why;
  auto abort = WaitFor<AbortMsg>(*fake_ctx);
  ASSERT_TRUE(abort.has_value()) << "the context rank was not told";
  EXPECT_EQ(abort->second.transfer_id, f.transfer_id);
  EXPECT_EQ(cl.gen_[0]->stats().staging_slots_in_use, 0);
  ASSERT_TRUE(cl.ctx_[0]->Cancel(35).ok());  // the genuine context rank never heard a FETCH
}

// The context side: a generation rank posts receives (CREDIT) only until it has every chunk and
// says DONE. A CREDIT after DONE has no step in phase "done": the request fails naming it, and
// the chunks already packed into staging slots and being sent give their slots back. It used to
// start more sends to a rank that had said it was done, and wait for its deadline.
TEST(PairProtocol, CreditAfterDoneFailsTheContextRequestAndReturnsItsSlots) {
  TransceiverOptions o;
  o.timeout = milliseconds(20000);
  o.chunk_bytes = 4096;
  o.staging_chunks = 4;
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  auto h = cl.Publish(32, {0, 1}, 8);
  auto decoded = DecodeHandle(h);
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  auto fake_gen = cl.Transport();  // plays generation rank 0
  auto ctx = fake_gen->Connect(cl.ctx_[0]->address(), DeadlineIn(milliseconds(1000)));
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
  FetchMsg f;
  f.request_id = 32;
  f.token = decoded->token;
  f.handle_digest = HandleDigestOf(h);
  f.gen_instance = 99;
  f.gen_rank = 0;
  f.transfer_id = 5;
  f.shape = Shape();
  f.parallel = {1, 1, {}, 1, 0};
  f.pool_blocks = 16;
  f.prompt_tokens = 8;
  f.chunk_bytes = 1024;  // several staged chunks, none direct
  f.direct_min_bytes = kNoDirect;
  f.blocks = {4, 5};
  ASSERT_TRUE(fake_gen->SendControl(*ctx, EncodeMessage(f)).ok());
  auto accept = WaitFor<AcceptMsg>(*fake_gen);
  ASSERT_TRUE(accept.has_value()) << "the FETCH was not accepted";
  // Two chunks credited: the context rank packs them into staging slots and sends them; the fake
  // never receives them, so they stay in flight. Then DONE, then a CREDIT for more.
  ASSERT_TRUE(fake_gen->SendControl(*ctx, EncodeMessage(CreditMsg{32, 5, 2, {}})).ok());
  const auto sending = DeadlineIn(milliseconds(3000));
  while (cl.ctx_[0]->stats().staging_slots_in_use < 1 && Clock::now() < sending)
    std::this_thread::sleep_for(milliseconds(1));
  EXPECT_GE(cl.ctx_[0]->stats().staging_slots_in_use, 1) << "no chunk was staged";
  ASSERT_TRUE(fake_gen->SendControl(*ctx, EncodeMessage(DoneMsg{32, 5, 0})).ok());
  ASSERT_TRUE(fake_gen->SendControl(*ctx, EncodeMessage(CreditMsg{32, 5, 4, {}})).ok());

  auto st = cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(st.size(), 1u) << "a CREDIT after DONE left the request waiting";
  EXPECT_EQ(st[0].state, TransferState::kError) << TransferStateName(st[0].state);
  const std::string why(st[0].reason.message());
  EXPECT_NE(why.find("request 32: generation rank 0"), std::string::npos) << why;
  EXPECT_NE(why.find("CREDIT in phase done of a context pair"), std::string::npos) << why;
  EXPECT_EQ(cl.ctx_[0]->stats().staging_slots_in_use, 0) << "a staging slot stayed leased";
  EXPECT_EQ(cl.ctx_[0]->stats().live_requests, 0);
  auto abort = WaitFor<AbortMsg>(*fake_gen);
  ASSERT_TRUE(abort.has_value()) << "the generation rank was not told";
  EXPECT_EQ(abort->second.request_id, 32u);
}

}  // namespace
}  // namespace kvferry

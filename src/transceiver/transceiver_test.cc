// The transceiver end to end over the in-process transport: every rank of a context instance and
// of a generation instance in one process, data checked element by element with the test-data
// generator, faults injected through the in-process fabric.
#include "kvferry/transceiver.h"

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
#include "kvferry/transport_wrapper.h"
#include "testing/testdata.h"
#include "testing/transceiver_test_cluster.h"
#include "transceiver/engine/engine.h"
#include "transceiver/wire/handle.h"
#include "transceiver/wire/messages.h"

namespace kvferry {
namespace {

using namespace txtest;  // NOLINT: the shared harness

// with it fetched another request. A context side now refuses it; the generation side, which
// holds no secret, does not need one.
TEST(Transceiver, ContextSideRefusesTheAllZeroSecret) {
  auto dev = OpenCpuDevice();
  const KvShape shape = Shape();
  const PoolSpec spec{shape, ParallelConfig{}, 0, LayoutKind::kBlockMajor, MemoryKind::kHost, 8};
  auto pool = std::move(BlockPool::Create(*dev, spec).value());
  auto fabric = InProcFabric::Create();
  auto transport = [&] {
    TransportOptions t;
    t.fabric = fabric;
    return std::move(CreateTransport(t).value());
  };
  TransceiverOptions o;
  o.transport = "inproc";
  auto zero = ContextSide::Create(*dev, pool, o, transport());
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("NewInstanceSecret"), std::string_view::npos)
      << zero.status().ToString();
  EXPECT_TRUE(GenerationSide::Create(*dev, pool, o, transport()).ok());

  using Secret = std::array<uint8_t, 16>;
  const Secret a = NewInstanceSecret(), b = NewInstanceSecret();
  EXPECT_NE(a, Secret{});
  EXPECT_NE(a, b);
  o.instance_secret = a;
  auto side = ContextSide::Create(*dev, pool, o, transport());
  EXPECT_TRUE(side.ok()) << side.status().ToString();
}

TEST(Transceiver, ReusedPrefixMovesOnlyMissingBlocks) {
  Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}});
  std::vector<int64_t> cb{0, 1, 2, 3}, gb{4, 5, 6, 7};
  auto h = cl.Publish(5, cb, 16);
  ASSERT_TRUE(cl.Fetch(h, gb, 2).ok());
  auto st = cl.Drain(0, 0, 1);
  ExpectAllComplete(st, 3);
  cl.Verify(5, gb, 16, 2);
}

// A generation side that holds the whole prompt already (an engine's local prefix hit) still
// fetches, with every block reused: nothing moves, and both sides end the request at once (the
// context side frees its blocks then, not at its hold deadline).
TEST(Transceiver, FetchWithEveryBlockReusedEndsBothSidesAtOnce) {
  TransceiverOptions o;
  o.timeout = std::chrono::seconds(60);
  Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  std::vector<int64_t> cb{0, 1, 2, 3}, gb{4, 5, 6, 7};
  auto h = cl.Publish(6, cb, 16);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(cl.Fetch(h, gb, 4).ok());
  auto st = cl.Drain(0, 0, 1);
  ExpectAllComplete(st, 3);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  for (const auto& s : st) EXPECT_EQ(s.bytes, 0) << "nothing to move";
  cl.Verify(6, gb, 16, 4);
}

TEST(Transceiver, LayerWiseSendsLayersAsTheyBecomeReady) {
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}});
  std::vector<int64_t> cb{0, 1}, gb{2, 3};
  auto h = cl.Publish(9, cb, 8, 0, /*layer_wise=*/true);
  ASSERT_TRUE(cl.Fetch(h, gb).ok());
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(cl.gen_[0]->Query(9)->state, TransferState::kInProgress)
      << "nothing moves before layers are ready";
  ASSERT_TRUE(cl.ctx_[0]->MarkLayersReady(9, 3).ok());
  auto ev = std::shared_ptr<Event>(std::move(cl.device_->CreateEvent().value()));
  auto stream = std::move(cl.device_->CreateStream().value());
  ASSERT_TRUE(stream->Record(*ev).ok());
  ASSERT_TRUE(cl.ctx_[0]->MarkLayerReadyOn(9, 5, ev).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1), 2);
  cl.Verify(9, gb, 8);
  EXPECT_FALSE(cl.ctx_[0]->MarkLayersReady(9, 99).ok());
}

TEST(Transceiver, ManyRequestsInFlightWithSmallStaging) {
  TransceiverOptions o;
  o.chunk_bytes = 4096;
  o.staging_chunks = 2;
  Cluster cl({Shape(), {2, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 256},
             {Shape(), {4, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 256}, o);
  const int kRequests = 64;
  for (int i = 0; i < kRequests; ++i) {
    std::vector<int64_t> cb{2 * i, 2 * i + 1}, gb{255 - 2 * i, 254 - 2 * i};
    auto h = cl.Publish(1000 + i, cb, 7);
    ASSERT_TRUE(cl.Fetch(h, gb).ok());
  }
  ExpectAllComplete(cl.Drain(0, 0, kRequests, milliseconds(30000)), kRequests * 6);
  for (int i = 0; i < kRequests; ++i) cl.Verify(1000 + i, {255 - 2 * i, 254 - 2 * i}, 7);
  // Every side's progress thread did work, and all of its CPU is at least its busy part.
  auto check = [&](const auto& sides) {
    for (const auto& side : sides) {
      const TransceiverStats s = side->stats();
      EXPECT_EQ(s.requests_ended, kRequests);
      EXPECT_GT(s.busy_cpu_seconds, 0);
      EXPECT_GE(s.thread_cpu_seconds, s.busy_cpu_seconds);
    }
  };
  check(cl.ctx_);
  check(cl.gen_);
}

TEST(Transceiver, MismatchedShapesAreRefusedNamingBothValues) {
  Cluster cl({Shape(4, 2, DType::kBf16), {1, 1, {}, 1, 0}},
             {Shape(4, 2, DType::kInt8), {1, 1, {}, 1, 0}});
  auto h = cl.Publish(1, {0, 1}, 8);
  Status st = cl.Fetch(h, {0, 1});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("bf16"), std::string_view::npos) << st.ToString();
  EXPECT_NE(st.message().find("int8"), std::string_view::npos) << st.ToString();
  ASSERT_TRUE(cl.ctx_[0]->Cancel(1).ok());
}

TEST(Transceiver, PerBlockScalesWithoutThemInThePoolAreRefused) {
  auto dev = OpenCpuDevice();
  PoolSpec spec{Shape(4, 2, DType::kFp8E4M3), {1, 1, {}, 1, 0},  0,
                LayoutKind::kBlockMajor,      MemoryKind::kHost, 8};
  auto pool = BlockPool::Create(*dev, spec).value();
  TransceiverOptions o;
  o.transport = "inproc";
  o.kv_scales.granularity = ScaleGranularity::kBlock;
  TransportOptions t;
  t.name = "inproc";
  t.fabric = InProcFabric::Create();
  auto side = GenerationSide::Create(*dev, pool, o, std::move(CreateTransport(t).value()));
  ASSERT_FALSE(side.ok());
  EXPECT_NE(side.status().message().find("per block, and the pool has none"), std::string::npos)
      << side.status().ToString();
}

TEST(Transceiver, FetchOfARequestLiveOnThisRankIsRefusedAtOnce) {
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}});
  // Layer-wise with no layer ready: the first fetch can't complete before the second call (a
  // whole 2-block transfer had, now and then, once put pairs stopped waiting for COMPLETE).
  auto h = cl.Publish(3, {0, 1}, 8, 0, /*layer_wise=*/true);
  ASSERT_TRUE(cl.gen_[0]->Fetch(h, std::vector<int64_t>{0, 1}, 0).ok());
  // Claimed by the first call before it returned, whether or not its FETCH went out yet.
  Status again = cl.gen_[0]->Fetch(h, std::vector<int64_t>{2, 3}, 0);
  EXPECT_EQ(again.code(), StatusCode::kInvalidArgument) << again.ToString();
  EXPECT_NE(again.message().find("already being fetched"), std::string_view::npos)
      << again.ToString();
  ASSERT_TRUE(cl.ctx_[0]->MarkLayersReady(3, Shape().layers).ok());
  auto gs = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(5000)));
  ASSERT_EQ(gs.size(), 1u);
  EXPECT_EQ(gs[0].state, TransferState::kComplete) << gs[0].reason.ToString();
  EXPECT_EQ(cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(5000))).size(), 1u);
}

TEST(Transceiver, MarkReadyOfAnIdLiveOrRecentlyEndedIsRefusedAtOnce) {
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}});
  auto h = cl.Publish(5, {0, 1}, 8);
  // MarkReady claims its id before it returns, whether or not the progress thread took the
  // request yet: the status is there at once, and a second MarkReady is refused.
  auto q = cl.ctx_[0]->Query(5);
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_FALSE(IsTerminal(q->state));
  auto again = cl.ctx_[0]->MarkReady(5, std::vector<int64_t>{2, 3}, 8);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(again.status().message().find("already marked ready"), std::string_view::npos)
      << again.status().ToString();
  // Layers marked right after MarkReady reach the request (the calls are ordered after it).
  ASSERT_TRUE(cl.ctx_[0]->MarkLayersReady(5, 1).ok());
  ASSERT_TRUE(cl.Fetch(h, {0, 1}).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1), 2);
  cl.Verify(5, {0, 1}, 8);
  // Ended and released: the id stays taken (a replayed handle must not find new blocks).
  again = cl.ctx_[0]->MarkReady(5, std::vector<int64_t>{2, 3}, 8);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("already marked ready"), std::string_view::npos)
      << again.status().ToString();
}

TEST(Transceiver, MalformedTruncatedAndForgedHandlesAreRefused) {
  TransceiverOptions o;
  o.timeout = milliseconds(1500);
  ASSERT_TRUE(Config::Global().Set("transfer.unknown_request_wait_ms", "100").ok());
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  auto h = cl.Publish(3, {0, 1}, 8);
  // Truncated, corrupted, garbage: refused at Fetch, the context side unaffected.
  std::vector<std::byte> cut(h.begin(), h.begin() + h.size() / 2);
  EXPECT_FALSE(cl.Fetch(cut, {0, 1}).ok());
  auto bad = h;
  bad[20] ^= std::byte{1};
  EXPECT_EQ(cl.Fetch(bad, {0, 1}).code(), StatusCode::kDataLoss);
  std::vector<std::byte> junk(64, std::byte{7});
  EXPECT_FALSE(cl.Fetch(junk, {0, 1}).ok());
  // Forged: a well-formed handle with a made-up token, and one altered to name another request
  // (valid checksum): the context rank leaves their FETCHes unanswered (an answer would connect
  // back to whoever sent them), and each ends at its deadline, saying the answer never came.
  auto decoded = DecodeHandle(h);
  ASSERT_TRUE(decoded.ok());
  ContextHandle forged = *decoded;
  forged.token[0] ^= 1;
  ASSERT_TRUE(cl.Fetch(EncodeHandle(forged), {2, 3}).ok());
  ContextHandle unknown = *decoded;
  unknown.request_id = 999;
  ASSERT_TRUE(cl.Fetch(EncodeHandle(unknown), {4, 5}).ok());
  auto st = cl.gen_[0]->Poll(2, DeadlineIn(milliseconds(6000)));
  ASSERT_EQ(st.size(), 2u);
  for (const TransferStatus& s : st) {
    EXPECT_EQ(s.state, TransferState::kTimedOut) << s.request_id;
    EXPECT_NE(s.reason.message().find("does not authenticate"), std::string_view::npos)
        << s.reason.ToString();
  }
  // Request 3 was never fetched: its context rank ends it at its own deadline.
  auto cs = cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(6000)));
  ASSERT_EQ(cs.size(), 1u);
  EXPECT_EQ(cs[0].state, TransferState::kTimedOut) << cs[0].reason.ToString();
  // A genuine handle works, once; a replay is refused.
  h = cl.Publish(4, {0, 1}, 8);
  ASSERT_TRUE(cl.Fetch(h, {0, 1}).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1), 2);
  cl.Verify(4, {0, 1}, 8);
  ASSERT_TRUE(cl.Fetch(h, {4, 5}).ok());
  st = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].state, TransferState::kError);
  EXPECT_NE(st[0].reason.message().find("replay"), std::string_view::npos)
      << st[0].reason.ToString();
  EXPECT_TRUE(Config::Global().Reset("transfer.unknown_request_wait_ms").ok());
  EXPECT_EQ(cl.gen_[0]->Query(12345).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(cl.ctx_[0]->Cancel(12345).code(), StatusCode::kNotFound);
}

// TP2 -> TP2: generation rank 0 takes no chunk from context rank 1, so that pair gets no ACCEPT
// (wire version 7) and rank 0 says DONE to it as soon as its chunks from context rank 0 are in
// place. Here context rank 1 marks the request ready only after that DONE came: it must keep the
// DONE with the waiting FETCH, or the request never completes there (its deadline).
TEST(Transceiver, DoneOfAPairWithoutChunksBeforeTheContextRankKnowsTheRequest) {
  TransceiverOptions o;
  o.timeout = milliseconds(5000);
  Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {2, 1, {}, 1, 0}}, o);
  const std::vector<int64_t> blocks{2, 3};
  auto h = cl.Publish(41, blocks, 7, 0, false, /*only_rank=*/0);
  ASSERT_TRUE(cl.Fetch(h, {5, 6}).ok());
  std::this_thread::sleep_for(milliseconds(300));  // rank 0's chunks land, its DONEs go out
  EXPECT_EQ(cl.Publish(41, blocks, 7, 0, false, /*only_rank=*/1), h);
  const auto start = Clock::now();
  ExpectAllComplete(cl.Drain(0, 0, 1, milliseconds(4000)), 4);
  EXPECT_LT(Clock::now() - start, milliseconds(2000)) << "a rank waited for its deadline";
  cl.Verify(41, {5, 6}, 7);
}

// A FETCH that reaches a context rank after the request's deadline (seen under ASan at load 26:
// the generation rank's first FETCH came 3 s late) is refused naming both causes, not only a
// replay: "already delivered" would send the reader looking for a duplicate handle.
TEST(Transceiver, FetchAfterTheContextDeadlineIsRefusedNamingTheDeadline) {
  TransceiverOptions o;
  o.timeout = milliseconds(200);
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  auto h = cl.Publish(5, {0, 1}, 8);
  auto cs = cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(cs.size(), 1u);
  EXPECT_EQ(cs[0].state, TransferState::kTimedOut);
  ASSERT_TRUE(cl.Fetch(h, {0, 1}).ok());
  auto st = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].state, TransferState::kError);
  EXPECT_NE(st[0].reason.message().find("later than the request's deadline"),
            std::string_view::npos)
      << st[0].reason.ToString();
}

TEST(Transceiver, DeadContextRankEndsTheRequestWithinTheDeadline) {
  TransceiverOptions o;
  o.timeout = milliseconds(1500);
  Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  auto h = cl.Publish(4, {0, 1}, 8, 0, /*layer_wise=*/true);  // nothing ready: data never flows
  ASSERT_TRUE(cl.Fetch(h, {0, 1}).ok());
  std::this_thread::sleep_for(milliseconds(50));
  ASSERT_TRUE(cl.fabric_->Kill(cl.ctx_[1]->address()).ok());
  auto t0 = Clock::now();
  auto st = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(5000)));
  ASSERT_EQ(st.size(), 1u);
  EXPECT_TRUE(st[0].state == TransferState::kError || st[0].state == TransferState::kTimedOut)
      << TransferStateName(st[0].state);
  EXPECT_LT(Clock::now() - t0, milliseconds(3000));
  // The surviving context rank ends too (abort from the generation side, or its own deadline).
  auto cs = cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(5000)));
  ASSERT_EQ(cs.size(), 1u);
  EXPECT_NE(cs[0].state, TransferState::kComplete);
}

TEST(Transceiver, SilentContextTimesOutAndCancelEndsBothSides) {
  TransceiverOptions o;
  o.timeout = milliseconds(300);
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o);
  auto h = cl.Publish(6, {0, 1}, 8, 0, true);
  ASSERT_TRUE(cl.Fetch(h, {0, 1}).ok());
  auto st = cl.Drain(0, 0, 1, milliseconds(5000));
  ASSERT_EQ(st.size(), 2u);
  for (auto& s : st) EXPECT_NE(s.state, TransferState::kComplete);
  bool timed_out = false;
  for (auto& s : st) timed_out |= s.state == TransferState::kTimedOut;
  EXPECT_TRUE(timed_out);
  // Cancel from the generation side: the context side ends with the reason.
  TransceiverOptions o2;
  o2.staging_chunks = 1;
  o2.chunk_bytes = 4096;
  Cluster c2({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o2);
  auto h2 = c2.Publish(8, {0, 1}, 8, 0, true);
  ASSERT_TRUE(c2.Fetch(h2, {0, 1}).ok());
  std::this_thread::sleep_for(milliseconds(30));
  ASSERT_TRUE(c2.gen_[0]->Cancel(8).ok());
  auto g = c2.gen_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(g.size(), 1u);
  EXPECT_EQ(g[0].state, TransferState::kCancelled);
  auto c = c2.ctx_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].state, TransferState::kError);
  EXPECT_NE(c[0].reason.message().find("aborted"), std::string_view::npos)
      << c[0].reason.ToString();
  // Staging was not leaked: a full request still goes through with one staging slot.
  auto h3 = c2.Publish(10, {2, 3}, 8);
  ASSERT_TRUE(c2.Fetch(h3, {2, 3}).ok());
  ExpectAllComplete(c2.Drain(0, 0, 1), 2);
  c2.Verify(10, {2, 3}, 8);
}

// Rewrites the FETCH messages a generation rank sends (a peer lying about its target).

class Paths : public ::testing::TestWithParam<bool> {};  // one-sided or tagged

TEST_P(Paths, CorruptedByteFailsTheRequestWithDataLoss) {
  PeerMemoryKnob puts("off");  // a corrupting transport needs the bytes to cross it
  // Equal dtypes, then a conversion (checksums of the converted bytes).
  for (const auto& [nth, gen_dtype] :
       {std::pair{1, DType::kFp16}, {3, DType::kFp16}, {1, DType::kFp8E4M3}, {2, DType::kBf16}}) {
    Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(4, 2, gen_dtype), {4, 1, {}, 1, 0}},
               SmallChunks(GetParam()), [n = nth](auto t) {
                 return std::make_unique<CorruptingTransport>(std::move(t), n);
               });
    auto h = cl.Publish(21, {3, 4, 9}, 11);
    ASSERT_TRUE(cl.Fetch(h, {0, 5, 6}).ok());
    auto st = cl.Drain(0, 0, 1, milliseconds(5000));
    bool data_loss = false;
    for (const TransferStatus& s : st) {
      EXPECT_NE(s.state, TransferState::kComplete) << "request " << s.request_id;
      if (s.reason.code() == StatusCode::kDataLoss) {
        data_loss = true;
        EXPECT_NE(s.reason.message().find("checksum"), std::string_view::npos)
            << s.reason.ToString();
      }
    }
    EXPECT_TRUE(data_loss) << "corrupting data op " << nth << " to " << DTypeName(gen_dtype);
  }
}

TEST_P(Paths, PeerWithoutOneSidedFallsBackToTagged) {
  // Either side without one-sided operations: the other side's offer or answer says tagged.
  for (bool ctx_lacks : {true, false}) {
    TransportHook no_rma = [](auto t) { return std::make_unique<NoRma>(std::move(t)); };
    Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {4, 1, {}, 1, 0}}, SmallChunks(GetParam()),
               ctx_lacks ? no_rma : TransportHook{}, ctx_lacks ? TransportHook{} : no_rma);
    std::vector<int64_t> gb{0, 5, 6};
    auto h = cl.Publish(22, {3, 4, 9}, 11);
    ASSERT_TRUE(cl.Fetch(h, gb).ok());
    ExpectAllComplete(cl.Drain(0, 0, 1), 6);
    cl.Verify(22, gb, 11, 0, 0, /*sentinels=*/true);
  }
}

INSTANTIATE_TEST_SUITE_P(Transceiver, Paths, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "rma" : "tagged"; });

TEST(Transceiver, LyingRmaTargetsAreRefusedAndWriteNothingOutsideTheDestination) {
  PeerMemoryKnob puts("off");  // the transport's put checks (peer_memory_test: the copy checks)
  struct Lie {
    const char* name;
    std::function<void(FetchMsg&)> edit;
    const char* says;
  };
  const Lie lies[] = {
      {"region too small", [](FetchMsg& f) { f.rma_target.pool[0].bytes = 64; }, "declares"},
      {"missing region", [](FetchMsg& f) { f.rma_target.pool.clear(); }, "pool regions"},
      {"slots too small", [](FetchMsg& f) { f.rma_target.slot_bytes = 16; }, "staging"},
      {"wrapping address", [](FetchMsg& f) { f.rma_target.pool[0].address = ~uint64_t{0} - 8; },
       "wraps"},
      // Well-formed but not this request's memory: another key, or the region moved.
      {"foreign key", [](FetchMsg& f) { f.rma_target.pool[0].rkey = f.rma_target.staging.rkey; },
       "outside the registration"},
      {"moved region", [](FetchMsg& f) { f.rma_target.pool[0].address += uint64_t{1} << 40; },
       "outside the registration"},
      {"garbage key", [](FetchMsg& f) { f.rma_target.pool[0].rkey = {std::byte{1}}; },
       "not a remote key"},
  };
  for (const Lie& lie : lies) {
    TransceiverOptions o = SmallChunks(true);
    ASSERT_TRUE(Config::Global().Set("transfer.rma_row_min_bytes", "1").ok());
    Cluster cl({Shape(), {1, 1, {}, 1, 0}},
               {Shape(), {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 64}, o, {},
               [&](auto t) { return std::make_unique<FetchTamperer>(std::move(t), lie.edit); });
    auto h = cl.Publish(23, {3, 4, 9}, 11);
    ASSERT_TRUE(cl.Fetch(h, {0, 5, 6}).ok());
    auto st = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(5000)));
    ASSERT_EQ(st.size(), 1u) << lie.name;
    EXPECT_EQ(st[0].state, TransferState::kError) << lie.name;
    EXPECT_NE(st[0].reason.message().find(lie.says), std::string_view::npos)
        << lie.name << ": " << st[0].reason.ToString();
    // Nothing outside the destination blocks changed; the moved region may have hit blocks
    // 0..63 only through the registration check, which refused it.
    cl.Verify(23, {0, 5, 6}, 0, 0, 0, /*sentinels=*/true);
    EXPECT_TRUE(Config::Global().Reset("transfer.rma_row_min_bytes").ok());
  }
}

// Records the control messages a side sends (type, and whether a CHUNK says complete).
class MessageLog final : public TestTransport {
 public:
  struct Shared {
    Mutex mu;
    std::vector<std::string> sent GUARDED_BY(mu);
  };
  MessageLog(std::unique_ptr<kvferry::Transport> base, std::shared_ptr<Shared> log)
      : TestTransport(std::move(base)), log_(std::move(log)) {}
  Status SendControl(PeerId p, std::span<const std::byte> b) override {
    auto m = DecodeMessage(b);
    std::string name = "?";
    if (m.ok()) {
      static const char* const kNames[] = {"FETCH", "ACCEPT",   "REJECT", "CREDIT", "DONE",
                                           "ABORT", "COMPLETE", "CHUNK",  "SIBLING"};
      name = kNames[m->index()];
      if (auto* k = std::get_if<ChunkMsg>(&*m); k && k->complete) name = "CHUNK(complete)";
    }
    {
      MutexLock lock(log_->mu);
      log_->sent.push_back(name);
    }
    return base_->SendControl(p, b);
  }

 private:
  std::shared_ptr<Shared> log_;
};

// Wire version 10: a pair by transport puts without checksums ends with its last CHUNK saying
// complete, as a peer-memory pair does: no DONE, no COMPLETE. Measured on the 2-core machine, the
// DONE -> COMPLETE round trip (two more wake-ups of loaded progress threads) was on the critical
// path of a 128-token request by UCX puts (docs/vllm.md). With checksums the pair still says
// DONE and gets COMPLETE (the generation rank could refuse a chunk). Version 11: a last chunk that
// came packed into a staging slot is reported at once when the request still waits for other
// pairs or context ranks, and COMPLETE follows (HeldLastChunksDoNotStarveTheOtherContextRanks);
// a lone pair, or one whose rows were all put, still folds.
TEST(Transceiver, PutPairsFoldCompleteIntoTheLastChunk) {
  ASSERT_TRUE(Config::Global().Set("transfer.peer_memory", "off").ok());
  const struct {
    const char* name;
    SideSpec ctx, gen;
  } kCases[] = {
      {"tp1_to_tp1", {Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}},
      {"tp2_to_tp4", {Shape(), {2, 1, {}, 1, 0}}, {Shape(), {4, 1, {}, 1, 0}}},
      {"tp4_to_tp2", {Shape(), {4, 1, {}, 1, 0}}, {Shape(), {2, 1, {}, 1, 0}}},
  };
  uint64_t id = 60;
  for (const auto& c : kCases) {
    for (const char* row_min : {"256", "1"}) {  // small rows packed; every row put
      for (const bool checksum : {false, true}) {
        SCOPED_TRACE(fmt::format("{} rma_row_min_bytes {} checksum {}", c.name, row_min, checksum));
        ASSERT_TRUE(Config::Global().Set("transfer.rma_row_min_bytes", row_min).ok());
        TransceiverOptions o = SmallChunks(true);
        o.checksum = checksum;
        auto ctx_log = std::make_shared<MessageLog::Shared>();
        auto gen_log = std::make_shared<MessageLog::Shared>();
        Cluster cl(
            c.ctx, c.gen, o,
            [&](auto t) { return std::make_unique<MessageLog>(std::move(t), ctx_log); },
            [&](auto t) { return std::make_unique<MessageLog>(std::move(t), gen_log); });
        const std::vector<int64_t> cb{3, 4, 9, 1, 12}, gb{0, 5, 6, 2, 11};
        const int64_t tokens = 4 * 4 + 3;
        ++id;
        auto h = cl.Publish(id, cb, tokens);
        ASSERT_FALSE(h.empty());
        ASSERT_TRUE(cl.Fetch(h, gb, 0).ok());
        ExpectAllComplete(cl.Drain(0, 0, 1), c.ctx.parallel.world_size() +
                                                 static_cast<size_t>(c.gen.parallel.world_size()));
        cl.Verify(id, gb, tokens, 0, 0, /*sentinels=*/true);
        std::map<std::string, int> ctx_sent, gen_sent;
        {
          MutexLock lock(ctx_log->mu);
          for (const auto& n : ctx_log->sent) ++ctx_sent[n];
        }
        {
          MutexLock lock(gen_log->mu);
          for (const auto& n : gen_log->sent) ++gen_sent[n];
        }
        EXPECT_GT(ctx_sent["ACCEPT"], 0);
        if (checksum) {
          EXPECT_EQ(ctx_sent["CHUNK(complete)"], 0);
          EXPECT_EQ(gen_sent["DONE"], ctx_sent["ACCEPT"]);
          EXPECT_EQ(ctx_sent["COMPLETE"], ctx_sent["ACCEPT"]);
        } else {
          // Each pair with chunks (every ACCEPT) ends by a CHUNK saying complete or, its last
          // chunk staged and reported early, by COMPLETE; no DONE.
          EXPECT_EQ(ctx_sent["CHUNK(complete)"] + ctx_sent["COMPLETE"], ctx_sent["ACCEPT"]);
          EXPECT_EQ(gen_sent["DONE"], 0);
          if (std::string_view(row_min) == "1" || std::string_view(c.name) == "tp1_to_tp1") {
            EXPECT_EQ(ctx_sent["CHUNK(complete)"], ctx_sent["ACCEPT"]);
          }
        }
        EXPECT_EQ(ctx_sent["ABORT"] + gen_sent["ABORT"], 0);
      }
    }
  }
  EXPECT_TRUE(Config::Global().Reset("transfer.rma_row_min_bytes").ok());
  EXPECT_TRUE(Config::Global().Reset("transfer.peer_memory").ok());
}

// The last CHUNK of a pair by puts must not wait in a generation staging slot for the other
// context ranks (wire version 11). Seen in vLLM, prefill TP2 -> decode TP1 (scripts/test-vllm):
// the decode rank offered its pool as peer memory, which the prefill workers could not map (an
// engine's tensors, not shared memory), so each pair put and was credited after its ACCEPT.
// Context rank 0 answered first, got every staging slot, and held each pair's last CHUNK until
// rank 1 said SIBLING, while that chunk's packed rows sat unpacked in the slot: rank 1 was never
// credited and every request ran into its deadline. Here rank 1 marks the requests ready only
// after rank 0's pairs landed, and there are twice as many requests as slots.
TEST(Transceiver, HeldLastChunksDoNotStarveTheOtherContextRanks) {
  PeerMemoryKnob on;
  ASSERT_TRUE(Config::Global().Set("transfer.rma_row_min_bytes", "1048576").ok());  // all packed
  TransceiverOptions o = SmallChunks(true);
  o.checksum = false;
  o.timeout = milliseconds(3000);
  auto unmappable = [](FetchMsg& f) {
    PeerHandle h = DecodePeerHandle(f.rma_target.peer_pool[0]).value();
    h.pid = NoSuchPid();
    f.rma_target.peer_pool[0] = EncodePeerHandle(h);
  };
  Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, o, {},
             [&](auto t) { return std::make_unique<FetchTamperer>(std::move(t), unmappable); });
  const int kRequests = 2 * static_cast<int>(o.staging_chunks);
  std::vector<std::vector<std::byte>> handles;
  for (int i = 0; i < kRequests; ++i) {
    handles.push_back(cl.Publish(200 + i, {i}, 3, 0, false, /*only_rank=*/0));
    ASSERT_TRUE(cl.Fetch(handles.back(), {10 + i}).ok());
  }
  std::this_thread::sleep_for(milliseconds(300));  // rank 0's chunks land in staging slots
  for (int i = 0; i < kRequests; ++i) {
    EXPECT_EQ(cl.Publish(200 + i, {i}, 3, 0, false, /*only_rank=*/1), handles[i]);
  }
  const auto start = Clock::now();
  ExpectAllComplete(cl.Drain(0, 0, kRequests, milliseconds(5000)), 3 * kRequests);
  EXPECT_LT(Clock::now() - start, milliseconds(2000)) << "a rank waited for its deadline";
  for (int i = 0; i < kRequests; ++i) cl.Verify(200 + i, {10 + i}, 3);
  EXPECT_EQ(cl.gen_[0]->stats().staging_slots_in_use, 0);
  EXPECT_TRUE(Config::Global().Reset("transfer.rma_row_min_bytes").ok());
}

}  // namespace
}  // namespace kvferry

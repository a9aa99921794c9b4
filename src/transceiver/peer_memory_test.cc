// The peer-memory data path (a context rank copies straight into the mapped generation pool) and
// the in-flight bound, over the in-process cluster: the CPU device shares memory between ranks
// of one process (transfer.peer_memory=on), which runs the same protocol a GPU runs over CUDA IPC.
#include "device/peer_memory.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "testing/transceiver_test_cluster.h"
#include "transceiver/engine/engine.h"
#include "transceiver/paths/peer_copies.h"

namespace kvferry {
namespace {

using namespace txtest;  // NOLINT: the shared harness

TEST(PeerMemory, HandlesRoundTripAndRefuseAnotherProcessOrHost) {
  auto dev = OpenCpuDevice();
  std::vector<std::byte> buf(4096);
  auto h = dev->ExportMemory(buf.data(), buf.size(), MemoryKind::kHost);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  auto m = dev->ImportMemory(*h);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->data(), buf.data());
  EXPECT_EQ((*m)->size(), buf.size());

  PeerHandle other = DecodePeerHandle(*h).value();
  other.pid = NoSuchPid();
  auto st = dev->ImportMemory(EncodePeerHandle(other)).status();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("process"), std::string_view::npos) << st.ToString();

  other = DecodePeerHandle(*h).value();
  other.host[0] ^= 1;
  st = dev->ImportMemory(EncodePeerHandle(other)).status();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_NE(st.message().find("another host"), std::string_view::npos) << st.ToString();

  for (size_t n = 0; n < h->size(); ++n) {
    EXPECT_FALSE(dev->ImportMemory(std::span(*h).first(n)).ok()) << "truncated to " << n;
  }
  EXPECT_FALSE(dev->ExportMemory(nullptr, 10, MemoryKind::kHost).ok());
}

// Counts the data operations a context rank's transport is asked for.
class CountingTransport final : public TestTransport {
 public:
  CountingTransport(std::unique_ptr<Transport> base, std::shared_ptr<int> ops)
      : TestTransport(std::move(base)), ops_(std::move(ops)) {}
  StatusOr<std::unique_ptr<TransportOp>> Send(PeerId p, uint64_t tag, const void* buf, size_t n,
                                              MemoryKind k) override {
    ++*ops_;
    return base_->Send(p, tag, buf, n, k);
  }
  StatusOr<std::unique_ptr<TransportOp>> Put(PeerId p, const void* local, size_t n, MemoryKind k,
                                             uint64_t addr,
                                             std::span<const std::byte> rkey) override {
    ++*ops_;
    return base_->Put(p, local, n, k, addr, rkey);
  }

 private:
  std::shared_ptr<int> ops_;
};

TEST(PeerMemory, HeterogeneousSplitsMoveWithOneCopyPerBatchAndNoStaging) {
  PeerMemoryKnob on;
  TransceiverOptions o;
  o.chunk_bytes = 4096;  // many chunks per pair: batched into one copy and one CHUNK
  o.staging_chunks = 1;
  o.checksum = false;
  auto ops = std::make_shared<int>(0);
  Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {4, 1, {}, 1, 0}, LayoutKind::kPerLayer}, o,
             [&](auto t) { return std::make_unique<CountingTransport>(std::move(t), ops); });
  std::vector<int64_t> cb{3, 4, 9, 1}, gb{0, 5, 6, 2};
  auto h = cl.Publish(31, cb, 15);
  ASSERT_TRUE(cl.Fetch(h, gb).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1), 6);
  cl.Verify(31, gb, 15, 0, 0, /*sentinels=*/true);
  for (auto& g : cl.gen_) EXPECT_EQ(g->stats().staging_slots_in_use, 0);
  EXPECT_EQ(*ops, 0) << "data moved through the transport, not by copies into the peer pool";
}

// Counts the CHUNK messages a context rank sends.
class ChunkCounter final : public TestTransport {
 public:
  ChunkCounter(std::unique_ptr<Transport> base, std::shared_ptr<int> chunks)
      : TestTransport(std::move(base)), chunks_(std::move(chunks)) {}
  Status SendControl(PeerId p, std::span<const std::byte> b) override {
    auto m = DecodeMessage(b);
    if (m.ok() && std::holds_alternative<ChunkMsg>(*m)) ++*chunks_;
    return base_->SendControl(p, b);
  }

 private:
  std::shared_ptr<int> chunks_;
};

// 96 MiB per pair is two copy batches (transfer.peer_batch_bytes 64 MiB), both in flight at once:
// the generation rank hears of them by one CHUNK (it was one per batch: each message costs
// syscalls on both sides), and every byte lands.
TEST(PeerMemory, BatchesInFlightTogetherAreReportedByOneChunk) {
  PeerMemoryKnob on;
  ASSERT_TRUE(Config::Global().Set("transfer.peer_batch_bytes", "67108864").ok());
  const KvShape big{2, 8, 128, DType::kBf16, 2, 1024};  // 8 MiB blocks
  TransceiverOptions o;
  o.checksum = false;
  auto chunks = std::make_shared<int>(0);
  Cluster cl({big, {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 12},
             {big, {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 12}, o,
             [&](auto t) { return std::make_unique<ChunkCounter>(std::move(t), chunks); });
  std::vector<int64_t> cb{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  std::vector<int64_t> gb{11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0};
  auto h = cl.Publish(33, cb, 12 * 1024);
  ASSERT_TRUE(cl.Fetch(h, gb).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1, milliseconds(60000)), 2);
  cl.Verify(33, gb, 12 * 1024);
  EXPECT_EQ(*chunks, 1);
  EXPECT_TRUE(Config::Global().Reset("transfer.peer_batch_bytes").ok());
}

TEST(PeerMemory, CopiesThatContinueEachOtherMergeIntoOneTallerCopy) {
  std::vector<std::byte> src(1 << 16), dst(1 << 16);
  auto desc = [&](size_t s, size_t d, size_t rows, size_t bytes, size_t sp, size_t dp) {
    CopyDesc c{};
    c.src = src.data() + s;
    c.dst = dst.data() + d;
    c.rows = rows;
    c.bytes = bytes;
    c.src_pitch = sp;
    c.dst_pitch = dp;
    return c;
  };
  // Head slices of two consecutive blocks: 4 rows of 64 bytes, source pitch 128, packed
  // destination.
  CopyDesc a = desc(0, 0, 4, 64, 128, 64);
  EXPECT_TRUE(ExtendRows(a, desc(512, 256, 4, 64, 128, 64)));
  EXPECT_EQ(a.rows, 8u);
  EXPECT_EQ(a.src_pitch, 128u);
  EXPECT_EQ(a.dst_pitch, 64u);
  // One-row copies back to back become rows at their own length.
  CopyDesc b = desc(0, 0, 1, 100, 0, 0);
  EXPECT_TRUE(ExtendRows(b, desc(100, 100, 1, 100, 0, 0)));
  EXPECT_EQ(b.rows, 2u);
  EXPECT_EQ(b.src_pitch, 100u);
  // Not continuing: a gap, another row length, another pitch, a row that overlaps the last.
  CopyDesc c = desc(0, 0, 4, 64, 128, 64);
  EXPECT_FALSE(ExtendRows(c, desc(640, 256, 4, 64, 128, 64)));
  EXPECT_FALSE(ExtendRows(c, desc(512, 256, 4, 32, 128, 64)));
  EXPECT_FALSE(ExtendRows(c, desc(512, 256, 4, 64, 256, 64)));
  CopyDesc d = desc(0, 0, 1, 100, 0, 0);
  EXPECT_FALSE(ExtendRows(d, desc(50, 50, 1, 100, 0, 0)));
  EXPECT_EQ(c.rows, 4u);
  EXPECT_EQ(d.rows, 1u);
}

// TP2 -> TP4, block-major at both ends, consecutive blocks: each pair's head slices merge into one
// tall copy per batch; every byte lands, nothing outside the destination blocks changes.
TEST(PeerMemory, MergedHeadSlicesLandByteForByte) {
  PeerMemoryKnob on;
  // transfer.peer_merge_pairs, and transfer.peer_hold_launches 0 (the default) or 2
  for (const char* merge : {"true", "false", "hold2"}) {
    ASSERT_TRUE(
        Config::Global().Set("transfer.peer_merge_pairs", merge[0] == 'f' ? "false" : "true").ok());
    ASSERT_TRUE(
        Config::Global().Set("transfer.peer_hold_launches", merge[0] == 'h' ? "2" : "0").ok());
    TransceiverOptions o;
    o.checksum = false;
    Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {4, 1, {}, 1, 0}}, o);
    auto h = cl.Publish(35, {2, 3, 4, 5}, 15);
    ASSERT_TRUE(cl.Fetch(h, {4, 5, 6, 7}).ok());
    ExpectAllComplete(cl.Drain(0, 0, 1), 6);
    cl.Verify(35, {4, 5, 6, 7}, 15, 0, 0, /*sentinels=*/true);
  }
  ASSERT_TRUE(Config::Global().Reset("transfer.peer_merge_pairs").ok());
  ASSERT_TRUE(Config::Global().Reset("transfer.peer_hold_launches").ok());
}

class Knob {
 public:
  Knob(const char* name, const char* value) : name_(name) {
    EXPECT_TRUE(Config::Global().Set(name, value).ok());
  }
  ~Knob() { EXPECT_TRUE(Config::Global().Reset(name_).ok()); }

 private:
  const char* name_;
};

double Counter(const std::vector<std::pair<std::string, double>>& v, const std::string& name) {
  for (const auto& [n, x] : v) {
    if (n == name) return x;
  }
  ADD_FAILURE() << name << " is not in the profile";
  return -1;
}

// transfer.peer_merge_pairs: a context rank of TP2 -> TP4 whose two pairs become ready together
// copies both in one CopyBatch (one launch instead of two); every byte lands, nothing outside the
// destination blocks changes.
TEST(PeerMemory, PairsReadyTogetherGoOutAsOneLaunch) {
  PeerMemoryKnob on;
  Knob merge("transfer.peer_merge_pairs", "true");
  Knob profile("transfer.profile", "true");
  TransceiverOptions o;
  o.checksum = false;
  Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {4, 1, {}, 1, 0}}, o);
  auto h = cl.Publish(36, {2, 3, 4, 5}, 15, 0, /*layer_wise=*/true);
  ASSERT_TRUE(cl.Fetch(h, {4, 5, 6, 7}).ok());
  // Both FETCHes in on each context rank before any layer is ready: each hears from the two
  // generation ranks whose heads it holds (wire version 8), and nothing else comes before the
  // first layer.
  const auto deadline = Clock::now() + milliseconds(10000);
  for (int r = 0; r < 2; ++r) {
    while (Counter(cl.ctx_[r]->metrics().profile, "control_received") < 2 &&
           Clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(1));
    }
    ASSERT_EQ(Counter(cl.ctx_[r]->metrics().profile, "control_received"), 2) << "rank " << r;
  }
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(cl.ctx_[r]->MarkLayersReady(36, 6).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1), 6);
  cl.Verify(36, {4, 5, 6, 7}, 15, 0, 0, /*sentinels=*/true);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(Counter(cl.ctx_[r]->metrics().profile, "batches"), 1) << "context rank " << r;
  }
}

// A context rank whose part is done waits for the other context ranks of its DP group (SIBLING,
// wire version 8). When one of them dies first, the transport fails the receive that watches it:
// the survivor and its generation rank end at once, naming the dead rank, not at their deadline.
TEST(PeerMemory, ContextRankWaitingForADeadSiblingEndsAtOnce) {
  PeerMemoryKnob on;
  Knob profile("transfer.profile", "true");
  TransceiverOptions o;
  o.checksum = false;
  o.timeout = milliseconds(20000);
  Cluster cl({Shape(), {2, 1, {}, 1, 0}}, {Shape(), {2, 1, {}, 1, 0}}, o);
  auto h = cl.Publish(37, {2, 3}, 7, 0, /*layer_wise=*/true);  // nothing ready
  ASSERT_TRUE(cl.Fetch(h, {4, 5}).ok());
  ASSERT_TRUE(cl.ctx_[0]->MarkLayersReady(37, 6).ok());  // rank 0's part moves, rank 1's never
  // Rank 1 heard generation rank 1's FETCH and rank 0's SIBLING: rank 0 is done and watches it.
  const auto deadline = Clock::now() + milliseconds(10000);
  while (Counter(cl.ctx_[1]->metrics().profile, "control_received") < 2 && Clock::now() < deadline)
    std::this_thread::sleep_for(milliseconds(1));
  ASSERT_EQ(Counter(cl.ctx_[1]->metrics().profile, "control_received"), 2);
  ASSERT_TRUE(cl.fabric_->Kill(cl.ctx_[1]->address()).ok());
  const auto start = Clock::now();
  auto ctx = cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(5000)));
  auto gen = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(5000)));
  ASSERT_EQ(ctx.size(), 1u) << "the surviving context rank still waits";
  ASSERT_EQ(gen.size(), 1u) << "its generation rank still waits";
  EXPECT_LT(Clock::now() - start, milliseconds(5000));
  EXPECT_EQ(ctx[0].state, TransferState::kError) << ctx[0].reason.ToString();
  EXPECT_EQ(ctx[0].reason.code(), StatusCode::kUnavailable) << ctx[0].reason.ToString();
  EXPECT_NE(ctx[0].reason.message().find("context rank 1 is unreachable"), std::string_view::npos)
      << ctx[0].reason.ToString();
  EXPECT_EQ(gen[0].state, TransferState::kError) << gen[0].reason.ToString();
  EXPECT_NE(gen[0].reason.message().find("context rank 1 is unreachable"), std::string_view::npos)
      << gen[0].reason.ToString();
  EXPECT_EQ(cl.ctx_[0]->stats().live_requests, 0);
  EXPECT_EQ(cl.gen_[0]->stats().live_requests, 0);
}

// What the gather kernel gets for bench transfer's Llama-3-8B TP2 -> TP4 (block-major at both
// ends, 32 tokens per block, 4k tokens in consecutive blocks): the planner's pieces of one pair
// and the copies PeerCopies makes of them (ExtendRows) are head slices of 16 KiB (2 of a context
// rank's 4 heads x 32 tokens x 128 x bf16) at a source pitch of 32 KiB into packed 16 KiB rows, the
// shape gather_kernel_bench_test times. Printed, and checked.
TEST(PeerMemory, Llama3Tp2ToTp4CopiesAreHeadSlicesOf16KiB) {
  const KvShape llama{32, 8, 128, DType::kBf16, 2, 32};
  PlanInput in;
  in.ctx = {llama, {2, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 128};
  in.gen = {llama, {4, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 128};
  in.prompt_tokens = 4096;
  for (int64_t b = 0; b < 128; ++b) {
    in.ctx_blocks.push_back(b);
    in.gen_blocks.push_back(b);
  }
  auto plans = PlanForCtxRank(in, 0);
  ASSERT_TRUE(plans.ok()) << plans.status().ToString();
  ASSERT_EQ(plans->size(), 2u);  // generation ranks 0 and 1
  const PairPlan& pp = plans->front();
  // PeerCopies' merging over fake addresses (offsets from two distinct bases; nothing is read).
  const uintptr_t src_base = uintptr_t{1} << 40, dst_base = uintptr_t{1} << 41;
  std::vector<CopyDesc> out;
  size_t pieces = 0;
  for (const Chunk& c : pp.chunks) {
    for (const Piece& p : c.pieces) {
      ++pieces;
      EXPECT_EQ(p.bytes, 16 << 10);
      if (p.rows > 1) {
        EXPECT_EQ(p.src_pitch, 32 << 10);
        EXPECT_EQ(p.dst_pitch, 16 << 10);
      }
      CopyDesc d{};
      d.src = reinterpret_cast<const void*>(src_base + p.src_offset);
      d.dst = reinterpret_cast<void*>(dst_base + p.dst_offset);
      d.bytes = p.bytes;
      d.rows = p.rows;
      d.src_pitch = p.src_pitch;
      d.dst_pitch = p.dst_pitch;
      if (out.empty() || !ExtendRows(out.back(), d)) out.push_back(d);
    }
  }
  std::printf(
      "llama3-8b tp2->tp4, 4k tokens, context rank 0 -> generation rank 0: %zu chunks, %zu "
      "pieces (first: %lld rows of %lld bytes, pitches %lld/%lld), merged into %zu copies "
      "(first: %zu rows of %zu bytes, pitches %zu/%zu), %lld bytes\n",
      pp.chunks.size(), pieces, static_cast<long long>(pp.chunks[0].pieces[0].rows),
      static_cast<long long>(pp.chunks[0].pieces[0].bytes),
      static_cast<long long>(pp.chunks[0].pieces[0].src_pitch),
      static_cast<long long>(pp.chunks[0].pieces[0].dst_pitch), out.size(), out[0].rows,
      out[0].bytes, out[0].src_pitch, out[0].dst_pitch, static_cast<long long>(pp.bytes));
  EXPECT_EQ(pp.bytes, int64_t{128} * 64 * (16 << 10));
  size_t rows = 0;
  for (const CopyDesc& d : out) rows += d.rows;
  EXPECT_EQ(rows, 128u * 64);
}

// Counts the CREDIT messages a generation rank sends.
class CreditCounter final : public TestTransport {
 public:
  CreditCounter(std::unique_ptr<Transport> base, std::shared_ptr<int> credits)
      : TestTransport(std::move(base)), credits_(std::move(credits)) {}
  Status SendControl(PeerId p, std::span<const std::byte> b) override {
    auto m = DecodeMessage(b);
    if (m.ok() && std::holds_alternative<CreditMsg>(*m)) ++*credits_;
    return base_->SendControl(p, b);
  }

 private:
  std::shared_ptr<int> credits_;
};

// A FETCH that offers the pool as peer memory credits no staging slot before ACCEPT: a context
// rank that copies into the pool never reads a credit (it was one wasted message per pair and
// request), and one that falls back to puts is credited after its ACCEPT.
TEST(PeerMemory, OfferedPoolIsCreditedOnlyWhenTheContextRankPuts) {
  PeerMemoryKnob on;
  for (const bool lie : {false, true}) {
    auto credits = std::make_shared<int>(0);
    auto unmappable = [](FetchMsg& f) {
      PeerHandle h = DecodePeerHandle(f.rma_target.peer_pool[0]).value();
      h.pid = NoSuchPid();
      f.rma_target.peer_pool[0] = EncodePeerHandle(h);
    };
    Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, SmallChunks(true), {},
               [&](std::unique_ptr<Transport> t) {
                 if (lie) t = std::make_unique<FetchTamperer>(std::move(t), unmappable);
                 return std::make_unique<CreditCounter>(std::move(t), credits);
               });
    auto h = cl.Publish(34, {3, 4, 9}, 11);
    ASSERT_TRUE(cl.Fetch(h, {0, 5, 6}).ok());
    ExpectAllComplete(cl.Drain(0, 0, 1), 2);
    cl.Verify(34, {0, 5, 6}, 11, 0, 0, /*sentinels=*/true);
    if (lie)
      EXPECT_GT(*credits, 0) << "puts into staging need credits";
    else
      EXPECT_EQ(*credits, 0) << "copies into the peer pool need no credit";
  }
}

// A generation rank may offer handles that don't map (another process, or a region smaller than
// its target declares): the context rank then puts through the transport instead, and nothing
// outside the destination blocks changes.
TEST(PeerMemory, UnmappableOrShortHandlesFallBackToTransportPuts) {
  PeerMemoryKnob on;
  const std::function<void(FetchMsg&)> lies[] = {
      [](FetchMsg& f) {
        PeerHandle h = DecodePeerHandle(f.rma_target.peer_pool[0]).value();
        h.pid = NoSuchPid();
        f.rma_target.peer_pool[0] = EncodePeerHandle(h);
      },
      [](FetchMsg& f) {
        PeerHandle h = DecodePeerHandle(f.rma_target.peer_pool[0]).value();
        h.bytes = 64;
        f.rma_target.peer_pool[0] = EncodePeerHandle(h);
      },
  };
  for (const auto& lie : lies) {
    Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {1, 1, {}, 1, 0}}, SmallChunks(true), {},
               [&](auto t) { return std::make_unique<FetchTamperer>(std::move(t), lie); });
    auto h = cl.Publish(32, {3, 4, 9}, 11);
    ASSERT_TRUE(cl.Fetch(h, {0, 5, 6}).ok());
    ExpectAllComplete(cl.Drain(0, 0, 1), 2);
    cl.Verify(32, {0, 5, 6}, 11, 0, 0, /*sentinels=*/true);
  }
}

// 256 requests live at once on every rank (layer-wise, nothing moves until the layers are
// ready), then all delivered: per-request state, not per-rank slots, bounds what is in flight.
void ManyInFlight(const char* peer_memory, int requests) {
  PeerMemoryKnob on(peer_memory);
  TransceiverOptions o;
  o.chunk_bytes = 4096;
  o.staging_chunks = 2;
  o.timeout = milliseconds(60000);
  const int64_t blocks = 2 * requests;
  Cluster cl({Shape(), {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, blocks},
             {Shape(), {1, 1, {}, 1, 0}, LayoutKind::kPerLayer, blocks}, o);
  for (int i = 0; i < requests; ++i) {
    auto h = cl.Publish(5000 + i, {2 * i, 2 * i + 1}, 7, 0, /*layer_wise=*/true);
    ASSERT_TRUE(cl.Fetch(h, {blocks - 1 - 2 * i, blocks - 2 - 2 * i}).ok());
  }
  EXPECT_EQ(cl.ctx_[0]->stats().live_requests, requests);
  EXPECT_EQ(cl.gen_[0]->stats().live_requests, requests);
  for (int i = 0; i < requests; ++i) ASSERT_TRUE(cl.ctx_[0]->MarkLayersReady(5000 + i, 6).ok());
  ExpectAllComplete(cl.Drain(0, 0, requests, milliseconds(60000)), 2 * requests);
  for (int i = 0; i < requests; ++i)
    cl.Verify(5000 + i, {blocks - 1 - 2 * i, blocks - 2 - 2 * i}, 7);
  EXPECT_EQ(cl.ctx_[0]->stats().live_requests, 0);
  EXPECT_EQ(cl.gen_[0]->stats().staging_slots_in_use, 0);
}

// Counts every control message sent, by type (ControlMsg's alternative index), over all ranks.
struct Tally {
  std::array<std::atomic<int>, std::variant_size_v<ControlMsg>> sent{};
  std::atomic<int> complete_chunks{0};  // CHUNKs saying complete
  int Of(size_t type) const { return sent[type].load(); }
};
class MessageTally final : public TestTransport {
 public:
  MessageTally(std::unique_ptr<Transport> base, std::shared_ptr<Tally> tally)
      : TestTransport(std::move(base)), tally_(std::move(tally)) {}
  Status SendControl(PeerId p, std::span<const std::byte> b) override {
    auto m = DecodeMessage(b);
    if (m.ok()) {
      ++tally_->sent[m->index()];
      if (auto* k = std::get_if<ChunkMsg>(&*m); k && k->complete) ++tally_->complete_chunks;
    }
    return base_->SendControl(p, b);
  }

 private:
  std::shared_ptr<Tally> tally_;
};

// Messages per request. A context rank that copies every chunk into the mapped generation pools
// knows when its generation ranks hold the request; once every other context rank of its DP group
// said the same (SIBLING, wire version 8), each pair takes a FETCH and one CHUNK saying complete
// (standing for ACCEPT too), not FETCH, ACCEPT, CHUNK, DONE and COMPLETE (each message costs a
// send and a receive on the control transport: 114-163 us of progress-thread CPU per TP1->TP1
// request on the H200, most of it those five). Pairs with nothing to move exchange nothing.
// TP2->TP4: 10 messages a request (4 FETCH, 4 CHUNK, 2 SIBLING); 28 in version 7, 36 before.
TEST(PeerMemory, EachPairEndsByOneCompleteChunk) {
  PeerMemoryKnob on;
  TransceiverOptions o;
  o.checksum = false;
  constexpr int kRequests = 3;
  constexpr size_t kFetch = 0, kAccept = 1, kDone = 4, kComplete = 6, kChunk = 7, kSibling = 8;
  for (const auto& [ctx_tp, gen_tp] : {std::pair{1, 2}, {2, 2}, {2, 4}}) {
    auto tally = std::make_shared<Tally>();
    auto hook = [&](std::unique_ptr<Transport> t) -> std::unique_ptr<Transport> {
      return std::make_unique<MessageTally>(std::move(t), tally);
    };
    Cluster cl({Shape(), {ctx_tp, 1, {}, 1, 0}},
               {Shape(), {gen_tp, 1, {}, 1, 0}, LayoutKind::kPerLayer}, o, hook, hook);
    for (int i = 0; i < kRequests; ++i) {
      std::vector<int64_t> cb{4 * i, 4 * i + 1}, gb{4 * i + 3, 4 * i + 2};
      auto h = cl.Publish(700 + i, cb, 7);
      ASSERT_TRUE(cl.Fetch(h, gb).ok());
      ExpectAllComplete(cl.Drain(0, 0, 1), ctx_tp + gen_tp);
      cl.Verify(700 + i, gb, 7);
    }
    const int with_chunks = kRequests * gen_tp;  // each generation rank's heads: one context rank
    SCOPED_TRACE(fmt::format("TP{} -> TP{}", ctx_tp, gen_tp));
    EXPECT_EQ(tally->Of(kFetch), with_chunks);
    EXPECT_EQ(tally->Of(kAccept), 0);
    EXPECT_EQ(tally->Of(kChunk), with_chunks);  // the copies of a pair land in one batch here
    EXPECT_EQ(tally->complete_chunks.load(), with_chunks);
    EXPECT_EQ(tally->Of(kDone) + tally->Of(kComplete), 0);
    EXPECT_EQ(tally->Of(kSibling), kRequests * ctx_tp * (ctx_tp - 1));
    for (auto& g : cl.gen_) EXPECT_EQ(g->stats().live_requests, 0);
    for (auto& c : cl.ctx_) EXPECT_EQ(c->stats().live_requests, 0);
  }
}

// A peer-memory pair is answered by its first CHUNK, not by ACCEPT; when one generation
// rank cancels before any copy could run (layers not ready), the context rank passes the ABORT on
// and the other generation rank, still waiting for its answer, ends at once (not at its deadline),
// and nothing stays live.
TEST(PeerMemory, CancelWhileTheAnswersAreOwedEndsEveryRankAtOnce) {
  PeerMemoryKnob on;
  TransceiverOptions o;
  o.checksum = false;
  o.timeout = milliseconds(20000);
  auto tally = std::make_shared<Tally>();
  auto hook = [&](std::unique_ptr<Transport> t) -> std::unique_ptr<Transport> {
    return std::make_unique<MessageTally>(std::move(t), tally);
  };
  Cluster cl({Shape(), {1, 1, {}, 1, 0}}, {Shape(), {2, 1, {}, 1, 0}, LayoutKind::kPerLayer}, o,
             hook, hook);
  auto h = cl.Publish(720, {0, 1}, 7, 0, /*layer_wise=*/true);
  ASSERT_TRUE(cl.Fetch(h, {3, 2}).ok());
  for (auto until = DeadlineIn(milliseconds(3000)); tally->Of(0) < 2 && Clock::now() < until;)
    std::this_thread::sleep_for(milliseconds(1));
  ASSERT_EQ(tally->Of(0), 2) << "both FETCHes sent";
  ASSERT_TRUE(cl.gen_[1]->Cancel(720).ok());
  const auto start = Clock::now();
  auto ctx = cl.ctx_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  auto gen0 = cl.gen_[0]->Poll(1, DeadlineIn(milliseconds(3000)));
  auto gen1 = cl.gen_[1]->Poll(1, DeadlineIn(milliseconds(3000)));
  ASSERT_EQ(ctx.size(), 1u);
  ASSERT_EQ(gen0.size(), 1u) << "the generation rank awaiting its answer was not told";
  ASSERT_EQ(gen1.size(), 1u);
  EXPECT_LT(Clock::now() - start, milliseconds(5000));
  EXPECT_EQ(ctx[0].state, TransferState::kError) << ctx[0].reason.ToString();
  EXPECT_EQ(gen0[0].state, TransferState::kError) << gen0[0].reason.ToString();
  EXPECT_EQ(gen1[0].state, TransferState::kCancelled) << gen1[0].reason.ToString();
  EXPECT_EQ(tally->complete_chunks.load(), 0);
  EXPECT_EQ(cl.ctx_[0]->stats().live_requests, 0);
  for (auto& g : cl.gen_) EXPECT_EQ(g->stats().live_requests, 0);
}

TEST(PeerMemory, TwoHundredFiftySixRequestsInFlightPerRank) { ManyInFlight("on", 256); }
TEST(Transceiver, TwoHundredFiftySixRequestsInFlightPerRankOverTransportPuts) {
  ManyInFlight("off", 256);
}

// Counts the Progress() calls of a rank while it waits for the copies of one request: the
// context rank from receiving FETCH to sending CHUNK, the generation rank from sending FETCH to
// receiving CHUNK (a lone context rank answers a peer-memory FETCH by that CHUNK, with no ACCEPT),
// and how long that was: its progress loop's iterations meanwhile.
struct LoopCount {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> ns{0};
};
class LoopCounter final : public TestTransport {
 public:
  LoopCounter(std::unique_ptr<Transport> base, std::shared_ptr<LoopCount> ctx,
              std::shared_ptr<LoopCount> gen)
      : TestTransport(std::move(base)), ctx_(std::move(ctx)), gen_(std::move(gen)) {}
  bool Progress() override {
    if (waiting_ != nullptr) ++waiting_->calls;
    return base_->Progress();
  }
  Status SendControl(PeerId p, std::span<const std::byte> b) override {
    Note(b, /*sent=*/true);
    return base_->SendControl(p, b);
  }
  std::optional<ControlMessage> PollControl() override {
    auto m = base_->PollControl();
    if (m) Note(m->bytes, /*sent=*/false);
    return m;
  }

 private:
  // FETCH starts the count of the side that sends it (generation) or receives it (context),
  // CHUNK ends it.
  void Note(std::span<const std::byte> bytes, bool sent) {
    auto m = DecodeMessage(bytes);
    if (m.ok() && std::holds_alternative<FetchMsg>(*m) && waiting_ == nullptr) {
      waiting_ = sent ? gen_.get() : ctx_.get();
      since_ = Clock::now();
    } else if (m.ok() && std::holds_alternative<ChunkMsg>(*m) &&
               waiting_ == (sent ? ctx_.get() : gen_.get())) {
      waiting_->ns +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since_).count();
      waiting_ = nullptr;
    }
  }
  std::shared_ptr<LoopCount> ctx_, gen_;
  LoopCount* waiting_ = nullptr;  // progress thread only
  Clock::time_point since_;
};

// While a context rank's only work is peer-memory copies on its CPU stream, its progress thread
// naps until the stream wakes it (transfer.stream_nap_us, 1 ms) instead of polling every 50 us
// after spinning 200 us, and the generation rank, which only waits for the CHUNK, naps
// transfer.peer_wait_nap_us (500 us): on 2 cores each of those wake-ups preempted the copying
// thread (perf sched: 2,700 preemptions, 10% of the copy's time, for 4 GB of Llama-3-8B requests;
// with TP2->TP4, four generation ranks polled beside two copying threads). 96 MiB copies for at
// least a few ms; both loops used to run once per 0.1 ms or faster meanwhile on an idle machine
// (and the context rank's hundreds of times in its spin). (Under load the old loops' naps
// stretched too, and the old code passed about half the time at load 10.)
TEST(PeerMemory, ProgressThreadsNapWhileOnlyCopiesRun) {
  PeerMemoryKnob on;
  const KvShape big{2, 8, 128, DType::kBf16, 2, 1024};  // 8 MiB blocks
  TransceiverOptions o;
  o.checksum = false;
  auto ctx = std::make_shared<LoopCount>(), gen = std::make_shared<LoopCount>();
  auto hook = [&](std::unique_ptr<Transport> t) -> std::unique_ptr<Transport> {
    return std::make_unique<LoopCounter>(std::move(t), ctx, gen);
  };
  Cluster cl({big, {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 12},
             {big, {1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 12}, o, hook, hook);
  std::vector<int64_t> cb{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  std::vector<int64_t> gb{11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0};
  auto h = cl.Publish(34, cb, 12 * 1024);
  ASSERT_TRUE(cl.Fetch(h, gb).ok());
  ExpectAllComplete(cl.Drain(0, 0, 1, milliseconds(60000)), 2);
  cl.Verify(34, gb, 12 * 1024);
  const double ctx_ms = static_cast<double>(ctx->ns.load()) / 1e6;
  const double gen_ms = static_cast<double>(gen->ns.load()) / 1e6;
  ASSERT_GT(ctx_ms, 0) << "the context rank received no FETCH then sent no CHUNK";
  ASSERT_GT(gen_ms, 0) << "the generation rank sent no FETCH then received no CHUNK";
  // One nap per iteration (a loaded machine only stretches the naps), plus the launch and the
  // wake-ups at the stream's end.
  EXPECT_LE(static_cast<double>(ctx->calls.load()), ctx_ms / 0.8 + 6)
      << "context progress loop iterations in " << ctx_ms << " ms of copying";
  EXPECT_LE(static_cast<double>(gen->calls.load()), gen_ms / 0.4 + 6)
      << "generation progress loop iterations in " << gen_ms << " ms of waiting for the CHUNK";
}

// Naps of 1 s on both sides for one test's life: a request that ends in milliseconds was woken by
// its messages, one that takes a second or more waited a nap out.
struct LongNaps {
  Knob wait{"transfer.peer_wait_nap_us", "1000000"};
  Knob stream{"transfer.stream_nap_us", "1000000"};
};

// Three TP2->TP2 requests from `first_id` on, each complete, verified and well under a nap.
void ExpectRequestsEndWithinANap(Cluster& cl, uint64_t first_id, const char* why) {
  for (uint64_t id = first_id; id < first_id + 3; ++id) {
    std::vector<int64_t> blocks{0, 1, 2, 3};
    auto h = cl.Publish(id, blocks, 16);
    ASSERT_TRUE(cl.Fetch(h, blocks).ok());
    auto st = cl.Drain(0, 0, 1, milliseconds(20000));
    ExpectAllComplete(st, 4);
    for (const TransferStatus& s : st) {
      EXPECT_LT(s.seconds, 0.9) << "request " << id << " took " << s.seconds << " s: " << why;
    }
    cl.Verify(id, blocks, 16);
  }
}

// The naps are the longest a waiting progress thread sleeps, not how late it notices a peer: a
// CHUNK, a COMPLETE or the end of a copy wakes it (ProgressWakeup over the transport's wakeup fd;
// the in-process transport has one). With both naps at 1 s, a request used to take more than 2 s
// (the generation rank slept through the CHUNK, then through the COMPLETE that answered its
// DONE); it takes milliseconds now. (bench transfer, Llama-3-8B, 128 tokens, one at a time: 0.58
// of the 1.9 ms per request was that COMPLETE.)
TEST(PeerMemory, PeersMessagesWakeNappingProgressThreads) {
  PeerMemoryKnob on;
  LongNaps naps;
  TransceiverOptions o;
  o.checksum = false;
  Cluster cl({Shape(), {2, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 8},
             {Shape(), {2, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 8}, o);
  ExpectRequestsEndWithinANap(cl, 50, "a napping progress thread did not wake for a message");
  EXPECT_EQ(cl.gen_[0]->metrics().data_path, "peer-memory");
}

// With several requests live a generation rank naps without arming the transport (its context
// ranks send without waking it) and a context rank whose stream copies does not listen either:
// a message waits at most a nap, then every request ends complete. Naps of 200 ms here.
TEST(PeerMemory, SeveralLiveRequestsTakeTheirMessagesByTheNap) {
  PeerMemoryKnob on;
  Knob wait{"transfer.peer_wait_nap_us", "200000"};
  Knob stream{"transfer.stream_nap_us", "200000"};
  TransceiverOptions o;
  o.checksum = false;
  Cluster cl({Shape(), {2, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 8},
             {Shape(), {2, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 8}, o);
  const std::vector<int64_t> a{0, 1, 2, 3}, b{4, 5, 6, 7};
  auto ha = cl.Publish(80, a, 16);
  auto hb = cl.Publish(81, b, 16);
  ASSERT_TRUE(cl.Fetch(ha, a).ok());
  ASSERT_TRUE(cl.Fetch(hb, b).ok());
  auto st = cl.Drain(0, 0, 2, milliseconds(20000));
  ExpectAllComplete(st, 8);
  for (const TransferStatus& s : st) {
    // FETCH, ACCEPT, CHUNK, DONE, COMPLETE: a few naps at most, however late each message.
    EXPECT_LT(s.seconds, 5.0) << "request " << s.request_id << " took " << s.seconds << " s";
  }
  cl.Verify(80, a, 16);
  cl.Verify(81, b, 16);
}

// UCX's ucp_worker_arm says busy when events came since the last progress: the loop must look
// again soon, not nap. This transport does that once after every message it hands out; with the
// naps at 1 s, a request took 1 s or more when a refused arm fell back to the full nap.
class BusyAfterMessages final : public TestTransport {
 public:
  using TestTransport::TestTransport;
  int WakeupFd() override { return base_->WakeupFd(); }
  bool ArmWakeup() override {
    if (busy_once_) {
      busy_once_ = false;
      return false;
    }
    return base_->ArmWakeup();
  }
  std::optional<ControlMessage> PollControl() override {
    auto m = base_->PollControl();
    busy_once_ |= m.has_value();
    return m;
  }

 private:
  bool busy_once_ = false;
};

TEST(PeerMemory, AnArmThatFindsEventsIsFollowedByAShortLook) {
  PeerMemoryKnob on;
  LongNaps naps;
  TransceiverOptions o;
  o.checksum = false;
  auto hook = [](std::unique_ptr<Transport> t) -> std::unique_ptr<Transport> {
    return std::make_unique<BusyAfterMessages>(std::move(t));
  };
  Cluster cl({Shape(), {2, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 8},
             {Shape(), {2, 1, {}, 1, 0}, LayoutKind::kBlockMajor, 8}, o, hook, hook);
  ExpectRequestsEndWithinANap(cl, 60, "a refused arm was followed by the whole nap");
}

}  // namespace
}  // namespace kvferry

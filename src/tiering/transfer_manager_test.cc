#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "kvferry/tiering.h"
#include "testing/memory_slab_store.h"
#include "testing/tiering_test_util.h"

namespace kvferry::tiering {
namespace {

using namespace std::chrono_literals;
using testing::ExpectBlockHolds;
using testing::FillAll;
using testing::GatedSlabStore;
using testing::MakePool;

Deadline Soon() { return DeadlineIn(10s); }

// Holds a stream back until Open() (a HostCallback gate).
class Gate {
 public:
  explicit Gate(Stream& s) {
    auto f = open_.get_future().share();
    EXPECT_TRUE(s.HostCallback([f] { f.wait(); }).ok());
  }
  void Open() { open_.set_value(); }

 private:
  std::promise<void> open_;
};

struct Fixture {
  explicit Fixture(LayoutKind layout = LayoutKind::kBlockMajor, DType dtype = DType::kBf16,
                   bool with_file = false, int64_t staging = 8)
      : dev(OpenCpuDevice()),
        primary(MakePool(*dev, layout, MemoryKind::kDevice, 8, dtype)),
        host(MakePool(*dev, layout, MemoryKind::kPinnedHost, 8, dtype)),
        mem(primary.layout().block_bytes(), 16),
        faults(&mem) {
    TransferOptions o;
    o.file_staging_blocks = staging;
    auto m = TransferManager::Create(*dev, primary, &host, with_file ? &faults : nullptr, o);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    tm = std::move(m).value();
  }
  std::unique_ptr<Device> dev;
  BlockPool primary, host;
  MemorySlabStore mem;
  FaultInjectingSlabStore faults;
  std::unique_ptr<TransferManager> tm;
};

TEST(TransferManager, OffloadOnboardRoundTrip) {
  Fixture f;
  FillAll(f.primary, 100);
  std::vector<BlockMove> out = {{0, 4}, {1, 5}, {2, 6}, {5, 0}};
  auto b = f.tm->Offload(Tier::kHost, out);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_TRUE(b->Wait(Soon()).ok());
  EXPECT_EQ(b->descriptors(), 2u);  // 0..2 -> 4..6 coalesce; 5 -> 0 alone
  ExpectBlockHolds(f.host, 4, 100);
  ExpectBlockHolds(f.host, 6, 102);
  ExpectBlockHolds(f.host, 0, 105);
  FillAll(f.primary, 900);  // overwrite, then bring back
  std::vector<BlockMove> in = {{4, 7}, {0, 3}};
  auto c = f.tm->Onboard(Tier::kHost, in);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c->Wait(Soon()).ok());
  ExpectBlockHolds(f.primary, 7, 100);
  ExpectBlockHolds(f.primary, 3, 105);
  auto st = f.tm->stats();
  EXPECT_EQ(st.batches, 2);
  EXPECT_EQ(st.blocks, 6);
  EXPECT_EQ(st.descriptors, 4);
}

// Per-block scales do not move with the tiers yet: refused, not lost on the way.
TEST(TransferManager, RefusesAPrimaryWithPerBlockScales) {
  auto dev = OpenCpuDevice();
  PoolSpec s;
  s.shape = testing::SmallShape(DType::kFp8E4M3);
  s.memory = MemoryKind::kDevice;
  s.blocks = 4;
  s.block_scales = true;
  auto primary = BlockPool::Create(*dev, s);
  ASSERT_TRUE(primary.ok()) << primary.status().ToString();
  auto m = TransferManager::Create(*dev, *primary, nullptr, nullptr, TransferOptions{});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("per-block scales"), std::string_view::npos);
}

TEST(TransferManager, OnboardWaitsForPendingOffloadOfTheSameBlock) {
  Fixture f;
  FillAll(f.primary, 100);
  FillAll(f.host, 500);
  Gate gate(f.tm->offload_stream());
  std::vector<BlockMove> out = {{0, 3}};
  auto off = f.tm->Offload(Tier::kHost, out);
  ASSERT_TRUE(off.ok());
  std::vector<BlockMove> in = {{3, 6}};  // reads host 3, which the offload is writing
  auto on = f.tm->Onboard(Tier::kHost, in);
  ASSERT_TRUE(on.ok());
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(off->Query());
  EXPECT_FALSE(on->Query());
  ExpectBlockHolds(f.primary, 6, 106);  // untouched while the offload is held back
  gate.Open();
  ASSERT_TRUE(on->Wait(Soon()).ok());
  ExpectBlockHolds(f.primary, 6, 100);  // the offloaded bytes, not the stale host bytes
}

TEST(TransferManager, WriteWaitsForPendingReadOfItsDestination) {
  Fixture f;
  FillAll(f.primary, 100);
  FillAll(f.host, 500);
  Gate gate(f.tm->offload_stream());
  std::vector<BlockMove> out = {{2, 3}};  // reads primary 2 (held back)
  auto off = f.tm->Offload(Tier::kHost, out);
  ASSERT_TRUE(off.ok());
  std::vector<BlockMove> in = {{5, 2}};  // overwrites primary 2 from host 5
  auto on = f.tm->Onboard(Tier::kHost, in);
  ASSERT_TRUE(on.ok());
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(on->Query());
  ExpectBlockHolds(f.primary, 2, 102);
  gate.Open();
  ASSERT_TRUE(on->Wait(Soon()).ok());
  ASSERT_TRUE(off->Wait(Soon()).ok());
  ExpectBlockHolds(f.host, 3, 102);  // the offload saw the old bytes
  ExpectBlockHolds(f.primary, 2, 505);
}

TEST(TransferManager, SyncWithComputeOrdersComputeAfterCopies) {
  Fixture f;
  FillAll(f.primary, 100);
  auto compute = std::move(f.dev->CreateStream()).value();
  Gate gate(f.tm->offload_stream());
  std::vector<BlockMove> out = {{1, 1}};
  ASSERT_TRUE(f.tm->Offload(Tier::kHost, out).ok());
  ASSERT_TRUE(f.tm->SyncWithCompute(*compute).ok());
  std::atomic<bool> ran{false};
  ASSERT_TRUE(compute->HostCallback([&] { ran = true; }).ok());
  std::this_thread::sleep_for(30ms);
  EXPECT_FALSE(ran.load());
  gate.Open();
  ASSERT_TRUE(compute->Synchronize(Soon()).ok());
  EXPECT_TRUE(ran.load());
  ExpectBlockHolds(f.host, 1, 101);
}

struct PartialCase {
  LayoutKind src_layout, dst_layout;
  DType dtype;
};

class PartialCopy : public ::testing::TestWithParam<PartialCase> {};

TEST_P(PartialCopy, MatchesCpuReference) {
  const PartialCase pc = GetParam();
  auto dev = OpenCpuDevice();
  auto primary = MakePool(*dev, pc.src_layout, MemoryKind::kDevice, 6, pc.dtype);
  auto host = MakePool(*dev, pc.dst_layout, MemoryKind::kPinnedHost, 6, pc.dtype);
  auto tm = std::move(TransferManager::Create(*dev, primary, &host, nullptr)).value();
  FillAll(primary, 10);
  FillAll(host, 70);
  for (int32_t n : {1, 2, 3}) {
    auto src = testing::Snapshot(primary);
    auto want = testing::Snapshot(host);
    std::vector<BlockMove> moves = {{0, 1, n}, {1, 2, n}, {4, 0, n}};
    for (const BlockMove& m : moves) {
      testing::ReferenceCopy(primary, src, m.src, host, want, m.dst, n);
    }
    auto b = tm->Offload(Tier::kHost, moves);
    ASSERT_TRUE(b.ok());
    ASSERT_TRUE(b->Wait(Soon()).ok());
    EXPECT_EQ(testing::Snapshot(host), want) << "tokens=" << n;
    ExpectBlockHolds(host, 1, 10, n);
    // And back, partially, into other primary blocks.
    src = testing::Snapshot(host);
    want = testing::Snapshot(primary);
    std::vector<BlockMove> back = {{1, 5, n}};
    testing::ReferenceCopy(host, src, 1, primary, want, 5, n);
    auto c = tm->Onboard(Tier::kHost, back);
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE(c->Wait(Soon()).ok());
    EXPECT_EQ(testing::Snapshot(primary), want);
    FillAll(host, 70);
    FillAll(primary, 10);
  }
}

INSTANTIATE_TEST_SUITE_P(
    DtypesAndLayouts, PartialCopy,
    ::testing::Values(PartialCase{LayoutKind::kBlockMajor, LayoutKind::kBlockMajor, DType::kInt8},
                      PartialCase{LayoutKind::kBlockMajor, LayoutKind::kBlockMajor, DType::kBf16},
                      PartialCase{LayoutKind::kBlockMajor, LayoutKind::kBlockMajor, DType::kFp32},
                      PartialCase{LayoutKind::kPerLayer, LayoutKind::kPerLayer, DType::kFp8E4M3},
                      PartialCase{LayoutKind::kPerLayer, LayoutKind::kPerLayer, DType::kFp16},
                      PartialCase{LayoutKind::kPerLayer, LayoutKind::kPerLayer, DType::kFp32},
                      PartialCase{LayoutKind::kPerLayer, LayoutKind::kBlockMajor, DType::kBf16},
                      PartialCase{LayoutKind::kBlockMajor, LayoutKind::kPerLayer, DType::kInt8}));

// A direct batch is planned and queued in slices of 16, 32, 64 ... moves (CopyDirect): 120 moves
// whose consecutive ids would coalesce across the slice boundaries, partial moves among whole
// ones, land byte for byte as the CPU reference says, both ways, and nothing else is written.
TEST(TransferManager, DirectBatchInSlicesMatchesCpuReference) {
  auto dev = OpenCpuDevice();
  constexpr int64_t kBlocks = 130;
  const int64_t tpb = testing::SmallShape().tokens_per_block;
  auto primary = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, kBlocks);
  auto host = MakePool(*dev, LayoutKind::kBlockMajor, MemoryKind::kPinnedHost, kBlocks);
  auto tm = std::move(TransferManager::Create(*dev, primary, &host, nullptr)).value();
  FillAll(primary, 10);
  FillAll(host, 500);
  std::vector<BlockMove> moves;
  for (int64_t i = 0; i < 120; ++i) {
    moves.push_back({i, (i + 7) % kBlocks, i % 7 == 3 ? int32_t{2} : int32_t{0}});
  }
  auto run = [&](Tier from, Tier to, const BlockPool& src, BlockPool& dst) {
    const auto src_bytes = testing::Snapshot(src);
    auto want = testing::Snapshot(dst);
    for (const BlockMove& m : moves) {
      testing::ReferenceCopy(src, src_bytes, m.src, dst, want, m.dst,
                             m.tokens > 0 ? m.tokens : tpb);
    }
    auto b = tm->Move(from, to, moves);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    ASSERT_TRUE(b->Wait(Soon()).ok());
    EXPECT_EQ(testing::Snapshot(dst), want);
  };
  run(Tier::kPrimary, Tier::kHost, primary, host);
  for (BlockMove& m : moves) std::swap(m.src, m.dst);
  FillAll(primary, 900);
  run(Tier::kHost, Tier::kPrimary, host, primary);
}

TEST(TransferManager, PrimaryToPrimaryPartialCopy) {
  Fixture f;
  FillAll(f.primary, 100);
  std::vector<BlockMove> m = {{2, 6, 3}};
  auto b = f.tm->Move(Tier::kPrimary, Tier::kPrimary, m);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(b->Wait(Soon()).ok());
  ExpectBlockHolds(f.primary, 6, 102, 3);
  auto r = CheckBlock(f.primary, 106, BlockTokens{6, 0, 4});  // token 3 still the old block's
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->has_value());
  EXPECT_EQ((*r)->at.token, 0);  // tokens < 3 changed
}

TEST(TransferManager, RejectsBadMoves) {
  Fixture f;
  std::vector<BlockMove> m = {{0, 8}};
  auto b = f.tm->Offload(Tier::kHost, m);
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("block 0 -> 8"), std::string_view::npos);
  m = {{0, 1, 5}};
  EXPECT_NE(f.tm->Offload(Tier::kHost, m).status().message().find("tokens=5"),
            std::string_view::npos);
  m = {{0, 1}, {2, 1}};
  EXPECT_NE(f.tm->Offload(Tier::kHost, m).status().message().find("two moves"),
            std::string_view::npos);
  m = {{0, 1}};
  EXPECT_NE(f.tm->Offload(Tier::kFile, m).status().message().find("not attached"),
            std::string_view::npos);
  EXPECT_FALSE(f.tm->Move(Tier::kHost, Tier::kHost, m).ok());
  m = {{1, 2, 2}, {2, 3, 2}};  // block 2 read and written in one batch
  EXPECT_NE(f.tm->Move(Tier::kPrimary, Tier::kPrimary, m).status().message().find("both read"),
            std::string_view::npos);
  m = {{4, 4, 2}};
  EXPECT_FALSE(f.tm->Move(Tier::kPrimary, Tier::kPrimary, m).ok());
}

TEST(TransferManager, RejectsMismatchedPools) {
  auto dev = OpenCpuDevice();
  auto primary = MakePool(*dev, LayoutKind::kBlockMajor, MemoryKind::kDevice, 4);
  auto host8 = MakePool(*dev, LayoutKind::kBlockMajor, MemoryKind::kPinnedHost, 4, DType::kInt8);
  auto r = TransferManager::Create(*dev, primary, &host8, nullptr);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("differ"), std::string_view::npos);
  auto dev_host = MakePool(*dev, LayoutKind::kBlockMajor, MemoryKind::kDevice, 4);
  EXPECT_NE(TransferManager::Create(*dev, primary, &dev_host, nullptr)
                .status()
                .message()
                .find("host tier must be"),
            std::string_view::npos);
  auto host_primary = MakePool(*dev, LayoutKind::kBlockMajor, MemoryKind::kHost, 4);
  EXPECT_FALSE(TransferManager::Create(*dev, host_primary, nullptr, nullptr).ok());
}

BlockMove FileMove(int64_t src, int64_t dst, uint64_t k, int32_t tokens = 0) {
  return BlockMove{src, dst, tokens, BlockKey{k, ~k}};
}

TEST(TransferManager, FileTierRoundTripBothLayouts) {
  for (LayoutKind layout : {LayoutKind::kBlockMajor, LayoutKind::kPerLayer}) {
    Fixture f(layout, DType::kBf16, /*with_file=*/true);
    FillAll(f.primary, 100);
    std::vector<BlockMove> out = {FileMove(0, 3, 1), FileMove(1, 4, 2), FileMove(6, 9, 3)};
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(f.mem.Allocate().ok());
    auto b = f.tm->Offload(Tier::kFile, out);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    ASSERT_TRUE(b->Wait(Soon()).ok());
    FillAll(f.primary, 900);
    std::vector<BlockMove> in = {FileMove(3, 5, 1), FileMove(4, 6, 2), FileMove(9, 2, 3, 2)};
    auto c = f.tm->Onboard(Tier::kFile, in);
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE(c->Wait(Soon()).ok());
    ExpectBlockHolds(f.primary, 5, 100);
    ExpectBlockHolds(f.primary, 6, 101);
    ExpectBlockHolds(f.primary, 2, 106, 2);  // partial onboard
    // Host <-> file too.
    std::vector<BlockMove> h = {FileMove(5, 7, 8)};
    FillAll(f.host, 300);
    ASSERT_TRUE(f.tm->Move(Tier::kHost, Tier::kFile, h).value().Wait(Soon()).ok());
    std::vector<BlockMove> hb = {FileMove(7, 0, 8)};
    ASSERT_TRUE(f.tm->Move(Tier::kFile, Tier::kHost, hb).value().Wait(Soon()).ok());
    ExpectBlockHolds(f.host, 0, 305);
  }
}

TEST(TransferManager, FailedFileWriteLeavesBlockIntactAndReportsIt) {
  Fixture f(LayoutKind::kBlockMajor, DType::kBf16, true);
  FillAll(f.primary, 100);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(f.mem.Allocate().ok());
  f.faults.FailNextWrites(1);
  std::vector<BlockMove> out = {FileMove(0, 0, 1), FileMove(1, 1, 2)};
  auto b = f.tm->Offload(Tier::kFile, out);
  ASSERT_TRUE(b.ok());
  Status st = b->Wait(Soon());
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("primary block 0"), std::string_view::npos) << st.ToString();
  EXPECT_EQ(b->items()[0].code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(b->items()[1].ok());
  ExpectBlockHolds(f.primary, 0, 100);
  ExpectBlockHolds(f.primary, 1, 101);
  EXPECT_EQ(f.tm->stats().file_write_errors, 1);
}

TEST(TransferManager, CorruptSlotOnboardsAsDataLossAndLeavesDestination) {
  Fixture f(LayoutKind::kPerLayer, DType::kBf16, true);
  FillAll(f.primary, 100);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(f.mem.Allocate().ok());
  std::vector<BlockMove> out = {FileMove(0, 0, 1), FileMove(1, 1, 2)};
  ASSERT_TRUE(f.tm->Offload(Tier::kFile, out).value().Wait(Soon()).ok());
  ASSERT_TRUE(f.mem.CorruptForTest(1, 17));
  std::vector<BlockMove> in = {FileMove(0, 4, 1), FileMove(1, 5, 2)};
  auto c = f.tm->Onboard(Tier::kFile, in);
  ASSERT_TRUE(c.ok());
  Status st = c->Wait(Soon());
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("checksum"), std::string_view::npos) << st.ToString();
  ExpectBlockHolds(f.primary, 4, 100);
  ExpectBlockHolds(f.primary, 5, 105);  // not written
  // A wrong key is a miss too.
  std::vector<BlockMove> wrong = {FileMove(0, 6, 77)};
  EXPECT_EQ(f.tm->Onboard(Tier::kFile, wrong).value().Wait(Soon()).code(), StatusCode::kDataLoss);
}

// The caller never waits for a disk: an offload of a block a stuck file read is still writing is
// ordered after that read by the submit thread, while Move returns at once (it used to wait on
// the caller's thread until the read had ended).
TEST(TransferManager, MoveReturnsWhileItsDependencyWaitsForTheDisk) {
  auto dev = OpenCpuDevice();
  BlockPool primary = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, 8);
  BlockPool host = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kPinnedHost, 8);
  MemorySlabStore mem(primary.layout().block_bytes(), 4);
  GatedSlabStore gated(&mem);
  auto tm = std::move(TransferManager::Create(*dev, primary, &host, &gated)).value();
  FillAll(primary, 100);
  ASSERT_TRUE(mem.Allocate().ok());
  std::vector<BlockMove> out = {FileMove(3, 0, 1)};
  ASSERT_TRUE(tm->Offload(Tier::kFile, out).value().Wait(Soon()).ok());
  gated.Close();
  std::vector<BlockMove> in = {FileMove(0, 7, 1)};
  auto c = tm->Onboard(Tier::kFile, in);  // the read hangs
  ASSERT_TRUE(c.ok());
  // A safety net: if Move waited for the read, the test would hang without it.
  std::thread opener([&] {
    std::this_thread::sleep_for(3s);
    gated.Open();
  });
  const auto t0 = Clock::now();
  std::vector<BlockMove> down = {{7, 2}};  // reads primary 7: must see the onboarded bytes
  auto d = tm->Offload(Tier::kHost, down);
  const auto took = Clock::now() - t0;
  ASSERT_TRUE(d.ok());
  EXPECT_LT(took, 1s);
  EXPECT_FALSE(d->Query());
  EXPECT_GE(tm->stats().submits_queued, 1);
  gated.Open();
  opener.join();
  ASSERT_TRUE(d->Wait(Soon()).ok());
  ASSERT_TRUE(c->Wait(Soon()).ok());
  ExpectBlockHolds(host, 2, 103);
  ASSERT_TRUE(tm->WaitSubmitted(Soon()).ok());
  EXPECT_EQ(tm->stats().submits_queued, 0);
}

// Plugged, Move queues batches without starting them; the last Unplug starts them all (nested
// plugs count); a call that waits for submissions runs the queue whatever the plug.
TEST(TransferManager, PluggedMovesStartAtTheLastUnplug) {
  auto dev = OpenCpuDevice();
  BlockPool primary = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, 8);
  BlockPool host = MakePool(*dev, LayoutKind::kBlockMajor, MemoryKind::kPinnedHost, 8);
  auto tm = std::move(TransferManager::Create(*dev, primary, &host, nullptr)).value();
  FillAll(primary, 100);
  tm->Plug();
  tm->Plug();
  std::vector<BlockMove> a = {{1, 5}, {2, 6}}, b = {{3, 7}};
  auto ba = tm->Offload(Tier::kHost, a);
  auto bb = tm->Offload(Tier::kHost, b);
  ASSERT_TRUE(ba.ok() && bb.ok());
  tm->Unplug();  // still plugged once
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(tm->stats().submits_queued, 2);
  EXPECT_FALSE(ba->Query());
  EXPECT_FALSE(bb->Query());
  tm->Unplug();
  ASSERT_TRUE(ba->Wait(Soon()).ok());
  ASSERT_TRUE(bb->Wait(Soon()).ok());
  ExpectBlockHolds(host, 5, 101);
  ExpectBlockHolds(host, 6, 102);
  ExpectBlockHolds(host, 7, 103);
  {
    TransferManager::SubmitPlug plug(*tm);
    std::vector<BlockMove> c = {{4, 0}};
    auto bc = tm->Offload(Tier::kHost, c);
    ASSERT_TRUE(bc.ok());
    ASSERT_TRUE(tm->WaitSubmitted(Soon()).ok());  // runs the queue under the plug
    EXPECT_EQ(tm->stats().submits_queued, 0);
    ASSERT_TRUE(bc->Wait(Soon()).ok());
    ExpectBlockHolds(host, 0, 104);
    std::vector<BlockMove> d = {{5, 1}};  // the kick lasts until the queue is empty: held again
    auto bd = tm->Offload(Tier::kHost, d);
    ASSERT_TRUE(bd.ok());
    std::this_thread::sleep_for(50ms);
    EXPECT_FALSE(bd->Query());
  }
  ASSERT_TRUE(tm->Drain(Soon()).ok());
  ExpectBlockHolds(host, 1, 105);
}

TEST(TransferManager, FileBatchLargerThanStagingIsRejected) {
  Fixture f(LayoutKind::kBlockMajor, DType::kBf16, true, /*staging=*/2);
  std::vector<BlockMove> out = {FileMove(0, 0, 1), FileMove(1, 1, 2), FileMove(2, 2, 3)};
  EXPECT_NE(f.tm->Offload(Tier::kFile, out).status().message().find("staging"),
            std::string_view::npos);
}

TEST(TransferManager, OffloadAfterFileOnboardWaitsForIt) {
  Fixture f(LayoutKind::kBlockMajor, DType::kBf16, true);
  FillAll(f.primary, 100);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(f.mem.Allocate().ok());
  std::vector<BlockMove> out = {FileMove(3, 0, 1)};
  ASSERT_TRUE(f.tm->Offload(Tier::kFile, out).value().Wait(Soon()).ok());
  std::vector<BlockMove> in = {FileMove(0, 7, 1)};
  auto c = f.tm->Onboard(Tier::kFile, in);  // writes primary 7 later, from the worker
  ASSERT_TRUE(c.ok());
  std::vector<BlockMove> down = {{7, 2}};  // reads primary 7: must see the onboarded bytes
  auto d = f.tm->Offload(Tier::kHost, down);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(d->Wait(Soon()).ok());
  ExpectBlockHolds(f.host, 2, 103);
  ASSERT_TRUE(f.tm->Drain(Soon()).ok());
}

}  // namespace
}  // namespace kvferry::tiering

namespace kvferry::tiering {
namespace {

// Device staging (forced on the CPU device): a per-layer primary pool and a block-major host
// pool; whole-block offloads and onboards go gather -> staging -> host and back, in chunks of the
// staging, with the same bytes as the direct path (the CPU reference); batches with partial moves
// go direct.
TEST(TransferManager, DeviceStagedCopiesMatchTheDirectPath) {
  auto dev = OpenCpuDevice();
  BlockPool primary = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, 10);
  BlockPool host = MakePool(*dev, LayoutKind::kBlockMajor, MemoryKind::kPinnedHost, 10);
  TransferOptions o;
  o.device_staging = DeviceStaging::kAlways;
  o.device_staging_blocks = 4;  // two halves of 2: batches of 7 go in 4 chunks, halves alternating
  auto tm = TransferManager::Create(*dev, primary, &host, nullptr, o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  ASSERT_TRUE((*tm)->device_staged());
  FillAll(primary, 100);
  FillAll(host, 700);
  std::vector<BlockMove> out = {{0, 9}, {1, 8}, {2, 7}, {3, 0}, {4, 1}, {9, 2}, {8, 3}};
  auto b = (*tm)->Offload(Tier::kHost, out);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_TRUE(b->Wait(Soon()).ok());
  for (const BlockMove& m : out) ExpectBlockHolds(host, m.dst, 100 + m.src);
  FillAll(primary, 900);
  std::vector<BlockMove> in = {{9, 5}, {0, 6}, {1, 7}, {2, 8}};
  auto c = (*tm)->Onboard(Tier::kHost, in);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c->Wait(Soon()).ok());
  ExpectBlockHolds(primary, 5, 100);
  ExpectBlockHolds(primary, 6, 103);
  ExpectBlockHolds(primary, 7, 104);
  ExpectBlockHolds(primary, 8, 109);
  ExpectBlockHolds(primary, 0, 900);  // untouched
  // A batch with partial moves goes direct: only their tokens land, both ways, the rest of each
  // destination block keeps its bytes (the CPU reference, on snapshots).
  std::vector<BlockMove> part = {{4, 3, 2}, {6, 1, 3}, {5, 9, 1}};
  std::vector<std::byte> want_host = testing::Snapshot(host);
  const std::vector<std::byte> prim = testing::Snapshot(primary);
  for (const BlockMove& m : part)
    testing::ReferenceCopy(primary, prim, m.src, host, want_host, m.dst, m.tokens);
  auto d = (*tm)->Offload(Tier::kHost, part);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(d->Wait(Soon()).ok());
  EXPECT_TRUE(testing::Snapshot(host) == want_host);
  std::vector<BlockMove> part_in = {{3, 2, 2}, {1, 4, 3}, {9, 0, 1}};
  std::vector<std::byte> want_prim = testing::Snapshot(primary);
  const std::vector<std::byte> hb = testing::Snapshot(host);
  for (const BlockMove& m : part_in)
    testing::ReferenceCopy(host, hb, m.src, primary, want_prim, m.dst, m.tokens);
  auto e = (*tm)->Onboard(Tier::kHost, part_in);
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE(e->Wait(Soon()).ok());
  EXPECT_TRUE(testing::Snapshot(primary) == want_prim);
  // Same block layouts on both sides: auto stages nothing (the link would see the same
  // fragments); always stages in the primary's own order (a batch of whole blocks; the mixed one
  // goes direct).
  BlockPool host2 = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kPinnedHost, 4);
  TransferOptions a = o;
  a.device_staging = DeviceStaging::kAuto;
  auto tm2 = TransferManager::Create(*dev, primary, &host2, nullptr, a);
  ASSERT_TRUE(tm2.ok());
  EXPECT_FALSE((*tm2)->device_staged());
  auto tm3 = TransferManager::Create(*dev, primary, &host2, nullptr, o);
  ASSERT_TRUE(tm3.ok());
  ASSERT_TRUE((*tm3)->device_staged());
  FillAll(host2, 500);
  for (const std::vector<BlockMove>& batch : {std::vector<BlockMove>{{7, 2}, {0, 1}, {5, 3}},
                                              std::vector<BlockMove>{{2, 0, 3}, {8, 3, 1}}}) {
    std::vector<std::byte> want2 = testing::Snapshot(host2);
    const std::vector<std::byte> p2 = testing::Snapshot(primary);
    for (const BlockMove& m : batch) {
      testing::ReferenceCopy(primary, p2, m.src, host2, want2, m.dst, m.tokens == 0 ? 4 : m.tokens);
    }
    auto f = (*tm3)->Offload(Tier::kHost, batch);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE(f->Wait(Soon()).ok());
    EXPECT_TRUE(testing::Snapshot(host2) == want2);
  }
}

// CreatePackedHostPool: the host tier an engine makes for device staging, packed in its primary's
// block order (NHD layouts -> block-major-nhd, HND -> block-major), the primary's shape; a
// staged round trip through it keeps every byte.
TEST(TransferManager, PackedHostPoolKeepsThePrimaryOrder) {
  auto dev = OpenCpuDevice();
  const std::pair<LayoutKind, LayoutKind> want[] = {
      {LayoutKind::kPerLayer, LayoutKind::kBlockMajorNhd},
      {LayoutKind::kPerLayerHnd, LayoutKind::kBlockMajor},
      {LayoutKind::kPerLayerKvNhd, LayoutKind::kBlockMajorNhd},
      {LayoutKind::kPerLayerKvHnd, LayoutKind::kBlockMajor},
      {LayoutKind::kFlashInferNhd, LayoutKind::kBlockMajorNhd},
      {LayoutKind::kFlashInferHnd, LayoutKind::kBlockMajor},
      {LayoutKind::kBlockMajor, LayoutKind::kBlockMajor},
      {LayoutKind::kBlockMajorNhd, LayoutKind::kBlockMajorNhd},
  };
  for (const auto& [kind, packed] : want) {
    SCOPED_TRACE(std::string(LayoutKindName(kind)));
    BlockPool primary = MakePool(*dev, kind, MemoryKind::kDevice, 10);
    auto layout = PackedHostLayout(primary);
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    EXPECT_EQ(*layout, packed);
    auto host = CreatePackedHostPool(*dev, primary, 7);
    ASSERT_TRUE(host.ok()) << host.status().ToString();
    EXPECT_EQ(host->layout().kind(), packed);
    EXPECT_EQ(host->memory(), MemoryKind::kPinnedHost);
    EXPECT_EQ(host->blocks(), 7);
    EXPECT_TRUE(host->shape() == primary.shape());
    TransferOptions o;
    o.device_staging = DeviceStaging::kAlways;  // the CPU device stages only when told to
    o.device_staging_blocks = 4;
    auto tm = TransferManager::Create(*dev, primary, &*host, nullptr, o);
    ASSERT_TRUE(tm.ok()) << tm.status().ToString();
    FillAll(primary, 100);
    std::vector<BlockMove> out = {{0, 6}, {3, 0}, {9, 2}, {4, 3}, {7, 5}};
    auto b = (*tm)->Offload(Tier::kHost, out);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    ASSERT_TRUE(b->Wait(Soon()).ok());
    FillAll(primary, 900);
    std::vector<BlockMove> in = {{6, 1}, {0, 2}, {2, 8}, {3, 5}, {5, 9}};
    auto c = (*tm)->Onboard(Tier::kHost, in);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_TRUE(c->Wait(Soon()).ok());
    for (size_t i = 0; i < in.size(); ++i) ExpectBlockHolds(primary, in[i].dst, 100 + out[i].src);
    ExpectBlockHolds(primary, 0, 900);  // untouched
  }
  BlockPool primary = MakePool(*dev, LayoutKind::kPerLayer, MemoryKind::kDevice, 4);
  auto none = CreatePackedHostPool(*dev, primary, 0);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry::tiering

// BlockPool::Wrap on the CPU device: every engine layout preset round-trips element-exact through
// the engine's own index formula, explicit byte strides name their preset, bad regions are refused
// with errors naming the values, and Device::WrapStream/WrapEvent order against an engine's stream.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <string>

#include "testing/wrap_test_util.h"

namespace kvferry::testing {
namespace {

using std::chrono::milliseconds;

PoolSpec Spec(LayoutKind layout, MemoryKind memory = MemoryKind::kHost) {
  PoolSpec s;
  s.shape = KvShape{6, 4, 16, DType::kFp16, 2, 8};
  s.parallel = ParallelConfig{2, 2, {}, 1, 0};  // rank 3: layers [3, 6), heads [2, 4)
  s.rank = 3;
  s.layout = layout;
  s.memory = memory;
  s.blocks = 5;
  return s;
}

PoolDims DimsOf(const PoolSpec& s) {
  return RankPoolDims(s.shape, *SliceOf(s.shape, s.parallel, s.rank), s.blocks);
}

// The engine's tensors: one allocation per tensor, owned by the test like an engine owns them.
struct Engine {
  std::vector<Buffer> tensors;
  std::vector<ExternalRegion> regions;
};

Engine MakeEngine(Device& dev, const PoolSpec& spec, bool reversed_with_ranges = false) {
  Engine e;
  const PoolDims n = DimsOf(spec);
  const int32_t count = EngineTensors(spec.layout, n);
  const int64_t bytes = EngineTensorBytes(spec.layout, n, spec.shape.ElementBytes());
  auto lay = PoolLayout::Make(spec.layout, n, spec.shape.ElementBytes());
  for (int32_t r = 0; r < count; ++r) {
    e.tensors.push_back(std::move(dev.Allocate(spec.memory, static_cast<size_t>(bytes)).value()));
    ExternalRegion x{e.tensors.back().data(), bytes, spec.memory, 0, {}, {}};
    if (reversed_with_ranges) {
      x.layers = lay->RegionLayers(r);
      x.kv = lay->RegionKv(r);
    }
    e.regions.push_back(x);
  }
  if (reversed_with_ranges) std::reverse(e.regions.begin(), e.regions.end());
  return e;
}

class EveryEngineLayout : public ::testing::TestWithParam<LayoutKind> {};

TEST_P(EveryEngineLayout, RoundTripsElementExactThroughTheEnginesIndex) {
  auto dev = OpenCpuDevice();
  for (bool reversed : {false, true}) {
    PoolSpec spec = Spec(GetParam());
    Engine eng = MakeEngine(*dev, spec, reversed);
    auto pool = BlockPool::Wrap(*dev, spec, eng.regions);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    EXPECT_TRUE(pool->wrapped());
    EXPECT_EQ(pool->layout().kind(), GetParam());
    ASSERT_EQ(pool->num_regions(), static_cast<int32_t>(eng.tensors.size()));
    for (int32_t r = 0; r < pool->num_regions(); ++r) {
      EXPECT_EQ(pool->region(r), eng.tensors[r].data()) << "regions are put in layout order";
      EXPECT_EQ(pool->region_size(r), EngineTensorBytes(GetParam(), DimsOf(spec), 2));
      EXPECT_EQ(pool->region_memory(r), MemoryKind::kHost);
    }
    FillAllBlocks(*pool, 100);
    ExpectEngineElements(GetParam(), *pool, 100, [&](int32_t r) { return eng.tensors[r].data(); });
    ExpectAllBlocks(*pool, 100);
    // Extents of every block cover exactly the pool's bytes once.
    std::vector<int64_t> ids(static_cast<size_t>(spec.blocks));
    for (int64_t b = 0; b < spec.blocks; ++b) ids[b] = b;
    auto ext = pool->BlockExtents(ids);
    ASSERT_TRUE(ext.ok());
    int64_t covered = 0;
    for (const Extent& x : *ext) covered += x.bytes;
    EXPECT_EQ(covered, pool->layout().total_bytes());
  }
}

TEST_P(EveryEngineLayout, AllocatedPoolOfTheKindMatchesTheEngineToo) {
  auto dev = OpenCpuDevice();
  auto pool = BlockPool::Create(*dev, Spec(GetParam()));
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_FALSE(pool->wrapped());
  FillAllBlocks(*pool, 7);
  ExpectEngineElements(GetParam(), *pool, 7, [&](int32_t r) { return pool->region(r); });
}

INSTANTIATE_TEST_SUITE_P(Wrap, EveryEngineLayout, ::testing::ValuesIn(NamedLayoutKinds()),
                         [](const auto& info) {
                           std::string s(LayoutKindName(info.param));
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

TEST(WrapLayout, TorchByteStridesNameTheirPreset) {
  const PoolSpec spec = Spec(LayoutKind::kPerLayerHnd);
  const PoolDims n = DimsOf(spec);  // (5, 3, 2, 2, 8, 16)
  const int64_t eb = 2;
  // vLLM HND kv_caches[l]: shape [2, B, H, T, D], torch strides times element size.
  const int64_t D = n[kDimAxis], T = n[kTokenAxis], H = n[kHeadAxis], B = n[kBlockAxis];
  PoolStrides bytes{};
  bytes[kKvAxis] = B * H * T * D * eb;
  bytes[kBlockAxis] = H * T * D * eb;
  bytes[kHeadAxis] = T * D * eb;
  bytes[kTokenAxis] = D * eb;
  bytes[kDimAxis] = eb;
  auto lay = PoolLayout::FromByteStrides(n, bytes, RegionSplit::kPerLayer, eb);
  ASSERT_TRUE(lay.ok()) << lay.status().ToString();
  EXPECT_EQ(lay->kind(), LayoutKind::kPerLayerHnd) << lay->ToString();
  EXPECT_EQ(*lay, PoolLayout::VllmPerLayer(n, eb, HeadOrder::kHnd));
  // A padded block stride is still a valid layout, but no preset: kCustom.
  bytes[kBlockAxis] += 64;
  bytes[kKvAxis] = B * bytes[kBlockAxis];
  auto padded = PoolLayout::FromByteStrides(n, bytes, RegionSplit::kPerLayer, eb);
  ASSERT_TRUE(padded.ok()) << padded.status().ToString();
  EXPECT_EQ(padded->kind(), LayoutKind::kCustom);
  EXPECT_EQ(padded->region_bytes(), ((2 - 1) * bytes[kKvAxis] + (B - 1) * bytes[kBlockAxis] +
                                     (H - 1) * T * D * eb + (T - 1) * D * eb + (D - 1) * eb) +
                                        eb);
}

TEST(WrapLayout, BadStridesAreNamed) {
  const PoolDims n = DimsOf(Spec(LayoutKind::kBlockMajor));
  PoolStrides s = PoolLayout::BlockMajor(n, 2).strides();
  PoolStrides bytes{};
  for (int a = 0; a < kNumAxes; ++a) bytes[a] = s[a] * 2;
  bytes[kTokenAxis] = 33;  // not a multiple of the element
  auto odd = PoolLayout::FromByteStrides(n, bytes, RegionSplit::kNone, 2);
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("token stride 33"), std::string_view::npos)
      << odd.status().ToString();
  bytes[kTokenAxis] = 2 * 8;  // tokens overlap heads' rows: aliasing
  auto alias = PoolLayout::FromByteStrides(n, bytes, RegionSplit::kNone, 2);
  ASSERT_FALSE(alias.ok());
  EXPECT_NE(alias.status().message().find("aliases"), std::string_view::npos)
      << alias.status().ToString();
  bytes = {};
  for (int a = 0; a < kNumAxes; ++a) bytes[a] = s[a] * 2;
  bytes[kDimAxis] = 4;  // head_dim not contiguous
  auto gap = PoolLayout::FromByteStrides(n, bytes, RegionSplit::kNone, 2);
  ASSERT_FALSE(gap.ok());
  EXPECT_NE(gap.status().message().find("dim stride"), std::string_view::npos);
}

// Each bad region is refused with the region index and the offending value in the message.
TEST(WrapValidation, NamesWhatDoesNotFit) {
  auto dev = OpenCpuDevice();
  const PoolSpec spec = Spec(LayoutKind::kPerLayerKvNhd);
  auto expect_error = [&](const std::vector<ExternalRegion>& regions,
                          std::vector<std::string> needles, const PoolSpec& s) {
    auto pool = BlockPool::Wrap(*dev, s, regions);
    ASSERT_FALSE(pool.ok());
    EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
    for (const std::string& n : needles) {
      EXPECT_NE(pool.status().message().find(n), std::string_view::npos)
          << "'" << n << "' not in: " << pool.status().ToString();
    }
  };
  Engine eng = MakeEngine(*dev, spec);
  const int64_t need = eng.regions[0].bytes;

  std::vector<ExternalRegion> r = eng.regions;
  r.pop_back();
  expect_error(r, {"5 regions given", "has 6"}, spec);

  r = eng.regions;
  r[2].base = nullptr;
  expect_error(r, {"region 2", "null base"}, spec);

  r = eng.regions;
  r[1].base = static_cast<std::byte*>(r[1].base) + 1;
  expect_error(r, {"region 1", "not aligned to the 2-byte element"}, spec);

  r = eng.regions;
  r[4].bytes = need - 2;
  expect_error(r, {"region 4", std::to_string(need - 2), std::to_string(need)}, spec);

  r = eng.regions;
  r[3].base = static_cast<std::byte*>(r[2].base) + 64;  // overlaps region 2
  expect_error(r, {"regions 2", "and 3", "overlap"}, spec);

  r = eng.regions;
  r[5].base = r[0].base;  // aliases region 0
  expect_error(r, {"regions 0", "and 5", "overlap"}, spec);

  r = eng.regions;
  r[0].memory = MemoryKind::kPinnedHost;
  expect_error(r, {"region 0", "pinned-host", "host"}, spec);

  PoolSpec on_device = spec;
  on_device.memory = MemoryKind::kDevice;
  r = eng.regions;
  for (auto& x : r) x.memory = MemoryKind::kDevice;
  r[1].device = 3;
  expect_error(r, {"region 1", "device 3", "cpu:0"}, on_device);

  r = eng.regions;
  for (int32_t i = 0; i < 6; ++i) {
    r[i].layers = Range{i / 2, i / 2 + 1};
    r[i].kv = Range{i % 2, i % 2 + 1};
  }
  r[4].layers = Range{0, 2};
  expect_error(r, {"region 4", "layers [0, 2)", "no region"}, spec);
  r[4].layers = Range{0, 1};
  expect_error(r, {"regions 0 and 4", "layers [0, 1) kv [0, 1)"}, spec);

  PoolSpec custom = spec;
  custom.layout = LayoutKind::kCustom;
  expect_error(eng.regions, {"custom layout needs strides"}, custom);

  // A custom layout of the wrong dims.
  auto other = PoolLayout::Make(LayoutKind::kBlockMajor, {5, 2, 2, 2, 8, 16}, 2);
  auto pool = BlockPool::Wrap(*dev, spec, *other, eng.regions);
  ASSERT_FALSE(pool.ok());
  EXPECT_NE(pool.status().message().find("(5,2,2,2,8,16)"), std::string_view::npos)
      << pool.status().ToString();
}

TEST(WrapValidation, AWrappedPoolNeverFreesTheEnginesMemory) {
  auto dev = OpenCpuDevice();
  const PoolSpec spec = Spec(LayoutKind::kBlockMajor);
  Engine eng = MakeEngine(*dev, spec);
  {
    auto pool = BlockPool::Wrap(*dev, spec, eng.regions);
    ASSERT_TRUE(pool.ok());
    FillAllBlocks(*pool, 1);
    BlockPool moved = std::move(pool).value();
    EXPECT_EQ(moved.region(0), eng.tensors[0].data());
  }
  // The engine's tensor is intact after the pool is gone (and freed once, by its owner).
  auto again = BlockPool::Wrap(*dev, spec, eng.regions);
  ASSERT_TRUE(again.ok());
  ExpectAllBlocks(*again, 1);
}

// ---- native streams and events ---------------------------------------------------------------

TEST(WrapNative, CpuStreamAndEventWrapOnlyThisDevicesLiveHandles) {
  auto dev = OpenCpuDevice();
  auto other = OpenCpuDevice();
  auto engine_stream = std::move(dev->CreateStream().value());
  auto engine_event = std::move(dev->CreateEvent().value());
  auto foreign_event = std::move(other->CreateEvent().value());

  EXPECT_EQ(dev->WrapStream(nullptr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev->WrapEvent(nullptr).status().code(), StatusCode::kInvalidArgument);
  auto foreign = dev->WrapEvent(foreign_event.get());
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.status().message().find("not a live event of this cpu device"),
            std::string_view::npos);
  int junk = 0;
  EXPECT_EQ(dev->WrapStream(&junk).status().code(), StatusCode::kInvalidArgument);
  // An event is not a stream.
  EXPECT_EQ(dev->WrapStream(engine_event.get()).status().code(), StatusCode::kInvalidArgument);

  auto ws = dev->WrapStream(engine_stream.get());
  ASSERT_TRUE(ws.ok()) << ws.status().ToString();
  auto we = dev->WrapEvent(engine_event.get());
  ASSERT_TRUE(we.ok()) << we.status().ToString();

  // The engine's stream holds work; the wrapped event, recorded by the engine after it, is not
  // complete until that work is; a kvferry stream waiting on it runs after it.
  std::atomic<int> step{0};
  std::promise<void> gate;
  auto open = gate.get_future().share();
  ASSERT_TRUE(engine_stream
                  ->HostCallback([open, &step] {
                    open.wait();
                    step = 1;
                  })
                  .ok());
  ASSERT_TRUE(engine_stream->Record(*engine_event).ok());
  EXPECT_FALSE((*we)->Query());
  auto mine = std::move(dev->CreateStream().value());
  int seen = -1;
  ASSERT_TRUE(mine->Wait(**we).ok());
  ASSERT_TRUE(mine->HostCallback([&] { seen = step.load(); }).ok());
  // Work through the wrapped stream joins the engine's queue, after the gate.
  int order = -1;
  ASSERT_TRUE((*ws)->HostCallback([&] { order = step.load(); }).ok());
  gate.set_value();
  ASSERT_TRUE((*we)->Synchronize(DeadlineIn(milliseconds(5000))).ok());
  ASSERT_TRUE(mine->Synchronize(DeadlineIn(milliseconds(5000))).ok());
  ASSERT_TRUE((*ws)->Synchronize(DeadlineIn(milliseconds(5000))).ok());
  EXPECT_EQ(seen, 1);
  EXPECT_EQ(order, 1);
  // Dropping the wrappers leaves the engine's handles alive and usable.
  ws->reset();
  we->reset();
  ASSERT_TRUE(engine_stream->Record(*engine_event).ok());
  EXPECT_TRUE(engine_event->Synchronize(DeadlineIn(milliseconds(5000))).ok());
  // A destroyed stream is no longer wrappable.
  void* gone = engine_stream.get();
  engine_stream.reset();
  EXPECT_EQ(dev->WrapStream(gone).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry::testing

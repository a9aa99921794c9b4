// Wrapped engine memory through the rest of kvferry on the CPU device: the transceiver moves a
// request between wrapped pools of every engine layout and allocated block-major pools over the
// in-process transport (layer-wise, gated by an engine's wrapped event), and the tiering manager
// offloads and onboards blocks of a wrapped primary pool, ordered against a wrapped compute
// stream. Data is checked element by element with the test-data generator.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <string>

#include "kvferry/inproc_transport.h"
#include "kvferry/tiering.h"
#include "kvferry/transceiver.h"
#include "kvferry/transport.h"
#include "testing/memory_slab_store.h"
#include "testing/wrap_test_util.h"

namespace kvferry::testing {
namespace {

using std::chrono::milliseconds;

constexpr KvShape kShape{4, 4, 16, DType::kBf16, 2, 8};
constexpr int64_t kBlocks = 8;

// Engine-owned tensors of `kind` for one rank, and the wrapped pool over them.
struct EngineRank {
  std::vector<Buffer> tensors;
  std::optional<BlockPool> pool;
};

void WrapEngine(Device& dev, const PoolSpec& spec, EngineRank& out) {
  const PoolDims n =
      RankPoolDims(spec.shape, *SliceOf(spec.shape, spec.parallel, spec.rank), spec.blocks);
  const int64_t bytes = EngineTensorBytes(spec.layout, n, spec.shape.ElementBytes());
  std::vector<ExternalRegion> regions;
  for (int32_t r = 0; r < EngineTensors(spec.layout, n); ++r) {
    out.tensors.push_back(std::move(dev.Allocate(spec.memory, static_cast<size_t>(bytes)).value()));
    std::memset(out.tensors.back().data(), 0xA5, static_cast<size_t>(bytes));
    regions.push_back({out.tensors.back().data(), bytes, spec.memory, 0, {}, {}});
  }
  auto pool = BlockPool::Wrap(dev, spec, regions);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  out.pool.emplace(std::move(pool).value());
}

struct Side {
  ParallelConfig parallel;
  LayoutKind layout = LayoutKind::kBlockMajor;
  bool wrapped = false;
};

class WrappedTransfer : public ::testing::TestWithParam<LayoutKind> {
 protected:
  void Build(const Side& ctx, const Side& gen) {
    dev_ = OpenCpuDevice();
    fabric_ = InProcFabric::Create();
    ctx_ranks_.resize(static_cast<size_t>(ctx.parallel.world_size()));
    gen_ranks_.resize(static_cast<size_t>(gen.parallel.world_size()));
    TransceiverOptions o;
    o.transport = "inproc";
    o.timeout = milliseconds(10000);
    o.instance_secret[0] = 9;
    for (int r = 0; r < ctx.parallel.world_size(); ++r) MakeRank(ctx, r, ctx_ranks_[r]);
    for (int r = 0; r < ctx.parallel.world_size(); ++r) {
      auto side = ContextSide::Create(*dev_, *ctx_ranks_[r].pool, o, NewTransport());
      ASSERT_TRUE(side.ok()) << side.status().ToString();
      ctx_.push_back(std::move(side).value());
    }
    std::vector<std::string> addrs;
    for (auto& c : ctx_) addrs.push_back(c->address());
    for (auto& c : ctx_) ASSERT_TRUE(c->SetInstanceAddresses(addrs).ok());
    o.instance_id = 3;
    for (int r = 0; r < gen.parallel.world_size(); ++r) {
      MakeRank(gen, r, gen_ranks_[r]);
      auto side = GenerationSide::Create(*dev_, *gen_ranks_[r].pool, o, NewTransport());
      ASSERT_TRUE(side.ok()) << side.status().ToString();
      gen_.push_back(std::move(side).value());
    }
  }

  void MakeRank(const Side& s, int rank, EngineRank& out) {
    PoolSpec spec{kShape, s.parallel, rank, s.layout, MemoryKind::kHost, kBlocks};
    if (s.wrapped) {
      WrapEngine(*dev_, spec, out);
      return;
    }
    auto pool = BlockPool::Create(*dev_, spec);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    for (int32_t i = 0; i < pool->num_regions(); ++i)
      std::memset(pool->region(i), 0xA5, static_cast<size_t>(pool->layout().region_bytes()));
    out.pool.emplace(std::move(pool).value());
  }

  std::unique_ptr<kvferry::Transport> NewTransport() {
    TransportOptions t;
    t.name = "inproc";
    t.fabric = fabric_;
    return std::move(CreateTransport(t).value());
  }

  // Moves request `id` of `tokens` tokens from ctx blocks to gen blocks; checks every element on
  // every generation rank. With `events`, the request is layer-wise and each context rank's
  // layers become ready through an engine event recorded on an engine stream, both wrapped.
  void Move(uint64_t id, const std::vector<int64_t>& ctx_blocks,
            const std::vector<int64_t>& gen_blocks, int64_t tokens, bool events) {
    const int64_t tpb = kShape.tokens_per_block;
    std::vector<std::byte> handle;
    std::vector<std::unique_ptr<Stream>> engine_streams;
    std::vector<std::unique_ptr<Event>> engine_events;
    for (size_t r = 0; r < ctx_.size(); ++r) {
      for (size_t i = 0; i < ctx_blocks.size(); ++i) {
        const int64_t valid = std::min<int64_t>(tpb, tokens - static_cast<int64_t>(i) * tpb);
        ASSERT_TRUE(
            FillBlock(*ctx_ranks_[r].pool, id, {ctx_blocks[i], int64_t(i) * tpb, valid}).ok());
      }
      auto h = events ? ctx_[r]->BeginLayerWise(id, ctx_blocks, tokens)
                      : ctx_[r]->MarkReady(id, ctx_blocks, tokens);
      ASSERT_TRUE(h.ok()) << h.status().ToString();
      handle = *h;
    }
    for (auto& g : gen_) ASSERT_TRUE(g->Fetch(handle, gen_blocks, 0).ok());
    std::promise<void> gate;
    std::shared_future<void> open = gate.get_future().share();
    if (events) {
      // The "engine": its compute stream is held by a gate; each layer's event is recorded on it.
      for (size_t r = 0; r < ctx_.size(); ++r) {
        engine_streams.push_back(std::move(dev_->CreateStream().value()));
        Stream& s = *engine_streams.back();
        ASSERT_TRUE(s.HostCallback([open] { open.wait(); }).ok());
        const int32_t layers = ctx_ranks_[r].pool->slice().layer_count;
        for (int32_t l = 0; l < layers; ++l) {
          engine_events.push_back(std::move(dev_->CreateEvent().value()));
          ASSERT_TRUE(s.Record(*engine_events.back()).ok());
          auto wrapped = dev_->WrapEvent(engine_events.back().get());
          ASSERT_TRUE(wrapped.ok()) << wrapped.status().ToString();
          ASSERT_TRUE(
              ctx_[r]->MarkLayerReadyOn(id, l, std::shared_ptr<Event>(std::move(*wrapped))).ok());
        }
      }
      // Nothing may arrive before the engine's events complete.
      std::this_thread::sleep_for(milliseconds(50));
      for (auto& g : gen_) {
        auto q = g->Query(id);
        ASSERT_TRUE(q.ok());
        EXPECT_FALSE(IsTerminal(q->state)) << "finished before the engine's layers were ready";
      }
      gate.set_value();
    }
    const Deadline deadline = DeadlineIn(milliseconds(10000));
    for (auto& c : ctx_) {
      auto s = c->Poll(1, deadline);
      ASSERT_EQ(s.size(), 1u);
      EXPECT_EQ(s[0].state, TransferState::kComplete) << s[0].reason.ToString();
    }
    for (auto& g : gen_) {
      auto s = g->Poll(1, deadline);
      ASSERT_EQ(s.size(), 1u);
      EXPECT_EQ(s[0].state, TransferState::kComplete) << s[0].reason.ToString();
    }
    for (auto& rank : gen_ranks_) {
      for (size_t i = 0; i < gen_blocks.size(); ++i) {
        const int64_t valid = std::min<int64_t>(tpb, tokens - static_cast<int64_t>(i) * tpb);
        auto r = CheckBlock(*rank.pool, id, {gen_blocks[i], int64_t(i) * tpb, valid});
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        EXPECT_FALSE(r->has_value())
            << LayoutKindName(GetParam()) << " block " << i << ": " << (*r)->ToString();
      }
    }
  }

  std::unique_ptr<Device> dev_;
  std::shared_ptr<InProcFabric> fabric_;
  std::vector<EngineRank> ctx_ranks_, gen_ranks_;
  std::vector<std::unique_ptr<ContextSide>> ctx_;
  std::vector<std::unique_ptr<GenerationSide>> gen_;
};

// Context: the engine's own tensors (TP2), generation: kvferry's block-major pools (TP1).
TEST_P(WrappedTransfer, FromWrappedEnginePoolsIntoBlockMajor) {
  Build({ParallelConfig{2, 1, {}, 1, 0}, GetParam(), true},
        {ParallelConfig{1, 1, {}, 1, 0}, LayoutKind::kBlockMajor, false});
  Move(11, {5, 6, 1, 2}, {0, 1, 2, 7}, 29, /*events=*/false);
  Move(12, {0, 3}, {4, 5}, 16, /*events=*/true);
}

// Context: block-major TP1 over PP2; generation: the engine's tensors, TP2.
TEST_P(WrappedTransfer, FromBlockMajorIntoWrappedEnginePools) {
  Build({ParallelConfig{1, 2, {}, 1, 0}, LayoutKind::kBlockMajor, false},
        {ParallelConfig{2, 1, {}, 1, 0}, GetParam(), true});
  Move(21, {0, 1, 2, 3}, {3, 4, 5, 6}, 30, /*events=*/false);
}

INSTANTIATE_TEST_SUITE_P(Wrap, WrappedTransfer, ::testing::ValuesIn(NamedLayoutKinds()),
                         [](const auto& info) {
                           std::string s(LayoutKindName(info.param));
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

// An engine's tensor whose strides match no named layout (padded blocks, from its byte strides)
// is a transfer source and destination: the strides travel in the handle and the FETCH.
TEST(WrappedTransferCustom, PaddedEngineTensorsOnBothSides) {
  auto dev = OpenCpuDevice();
  PoolSpec spec{kShape, ParallelConfig{}, 0, LayoutKind::kCustom, MemoryKind::kHost, 4};
  const PoolDims n = RankPoolDims(kShape, *SliceOf(kShape, spec.parallel, 0), 4);
  // [block][layer][kv][head][token][dim] with `pad` bytes after each block.
  auto wrap = [&](int64_t pad, std::vector<Buffer>& keep) {
    PoolStrides bytes{};
    const int64_t eb = 2, row = n[kDimAxis] * eb;
    bytes[kDimAxis] = eb;
    bytes[kTokenAxis] = row;
    bytes[kHeadAxis] = row * n[kTokenAxis];
    bytes[kKvAxis] = bytes[kHeadAxis] * n[kHeadAxis];
    bytes[kLayerAxis] = bytes[kKvAxis] * n[kKvAxis];
    bytes[kBlockAxis] = bytes[kLayerAxis] * n[kLayerAxis] + pad;
    auto lay = PoolLayout::FromByteStrides(n, bytes, RegionSplit::kNone, eb);
    EXPECT_TRUE(lay.ok());
    EXPECT_EQ(lay->kind(), LayoutKind::kCustom);
    keep.push_back(std::move(dev->Allocate(MemoryKind::kHost, lay->region_bytes()).value()));
    std::memset(keep.back().data(), 0xA5, static_cast<size_t>(lay->region_bytes()));
    ExternalRegion region{keep.back().data(), lay->region_bytes(), MemoryKind::kHost, 0, {}, {}};
    return BlockPool::Wrap(*dev, spec, *lay, std::span(&region, 1));
  };
  std::vector<Buffer> keep;
  auto ctx_pool = wrap(256, keep);
  auto gen_pool = wrap(64, keep);
  ASSERT_TRUE(ctx_pool.ok()) << ctx_pool.status().ToString();
  ASSERT_TRUE(gen_pool.ok()) << gen_pool.status().ToString();
  TransceiverOptions o;
  o.transport = "inproc";
  o.instance_secret = NewInstanceSecret();
  TransportOptions t;
  t.fabric = InProcFabric::Create();
  auto ctx = ContextSide::Create(*dev, *ctx_pool, o, std::move(CreateTransport(t).value()));
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
  ASSERT_TRUE((*ctx)->SetInstanceAddresses({(*ctx)->address()}).ok());
  o.instance_id = 5;
  auto gen = GenerationSide::Create(*dev, *gen_pool, o, std::move(CreateTransport(t).value()));
  ASSERT_TRUE(gen.ok()) << gen.status().ToString();
  const int64_t tpb = kShape.tokens_per_block, tokens = 3 * tpb - 2;
  const std::vector<int64_t> cb{3, 0, 2}, gb{1, 2, 0};
  for (size_t i = 0; i < cb.size(); ++i) {
    ASSERT_TRUE(
        FillBlock(*ctx_pool, 7, {cb[i], int64_t(i) * tpb, std::min(tpb, tokens - int64_t(i) * tpb)})
            .ok());
  }
  auto h = (*ctx)->MarkReady(7, cb, tokens);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_TRUE((*gen)->Fetch(*h, gb, 0).ok());
  const Deadline deadline = DeadlineIn(milliseconds(10000));
  auto cs = (*ctx)->Poll(1, deadline);
  auto gs = (*gen)->Poll(1, deadline);
  ASSERT_EQ(cs.size(), 1u);
  ASSERT_EQ(gs.size(), 1u);
  EXPECT_EQ(cs[0].state, TransferState::kComplete) << cs[0].reason.ToString();
  EXPECT_EQ(gs[0].state, TransferState::kComplete) << gs[0].reason.ToString();
  for (size_t i = 0; i < gb.size(); ++i) {
    auto r = CheckBlock(*gen_pool, 7,
                        {gb[i], int64_t(i) * tpb, std::min(tpb, tokens - int64_t(i) * tpb)});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_FALSE(r->has_value()) << "block " << i << ": " << (*r)->ToString();
  }
  // The padding after each generation block is never written.
  const std::byte* base = gen_pool->region(0);
  const int64_t block = gen_pool->layout().strides()[kBlockAxis] * 2;
  for (int64_t b = 0; b < 3; ++b) {
    for (int64_t k = block - 64; k < block; ++k) {
      ASSERT_EQ(base[b * block + k], std::byte{0xA5}) << "block " << b << " pad byte " << k;
    }
  }
}

// ---- tiering ---------------------------------------------------------------------------------

class WrappedTiering : public ::testing::TestWithParam<LayoutKind> {};

// Primary: the engine's device tensors (device memory of the CPU device), wrapped. Host tier and
// file tier: kvferry's own. Blocks go down and come back element-exact; the engine's compute
// stream (wrapped) orders the copies.
TEST_P(WrappedTiering, OffloadAndOnboardAWrappedPrimaryPool) {
  auto dev = OpenCpuDevice();
  PoolSpec spec{kShape, ParallelConfig{2, 1, {}, 1, 0}, 1, GetParam(), MemoryKind::kDevice,
                kBlocks};
  EngineRank engine;
  WrapEngine(*dev, spec, engine);
  ASSERT_TRUE(engine.pool);
  BlockPool& primary = *engine.pool;
  PoolSpec host_spec = spec;
  host_spec.layout = LayoutKind::kBlockMajor;
  host_spec.memory = MemoryKind::kPinnedHost;
  auto host = BlockPool::Create(*dev, host_spec);
  ASSERT_TRUE(host.ok());
  tiering::MemorySlabStore file(primary.layout().block_bytes(), 16);
  TransferOptions o;
  o.file_staging_blocks = 4;
  auto tm = TransferManager::Create(*dev, primary, &*host, &file, o);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();

  auto engine_stream = std::move(dev->CreateStream().value());
  auto compute = dev->WrapStream(engine_stream.get());
  ASSERT_TRUE(compute.ok()) << compute.status().ToString();
  // The engine "computes" blocks 0..3 on its stream, behind a gate; offloads wait for it.
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  const int64_t tpb = kShape.tokens_per_block;
  ASSERT_TRUE(engine_stream
                  ->HostCallback([open, &primary, tpb] {
                    open.wait();
                    for (int64_t b = 0; b < 4; ++b)
                      (void)FillBlock(primary, 500 + b, {b, b * tpb, tpb});
                  })
                  .ok());
  ASSERT_TRUE((*tm)->WaitForCompute(**compute).ok());
  std::vector<BlockMove> down = {{0, 2}, {1, 3}, {2, 4}};
  auto b1 = (*tm)->Offload(Tier::kHost, down);
  ASSERT_TRUE(b1.ok()) << b1.status().ToString();
  auto slot = file.Allocate();
  ASSERT_TRUE(slot.ok()) << slot.status().ToString();
  const int64_t slot_id = static_cast<int64_t>(*slot);
  std::vector<BlockMove> to_file = {{3, slot_id, 0, BlockKey{1, 3}}};
  auto b2 = (*tm)->Offload(Tier::kFile, to_file);
  ASSERT_TRUE(b2.ok()) << b2.status().ToString();
  std::this_thread::sleep_for(milliseconds(30));
  EXPECT_FALSE(b1->Query()) << "an offload ran before the engine's compute stream";
  gate.set_value();
  ASSERT_TRUE(b1->Wait(DeadlineIn(milliseconds(10000))).ok());
  {
    Status st = b2->Wait(DeadlineIn(milliseconds(10000)));
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  for (int64_t b = 0; b < 3; ++b) {
    auto r = CheckBlock(*host, 500 + b, {b + 2, b * tpb, tpb});
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r->has_value()) << (*r)->ToString();
  }
  // Scribble over the engine's tensors, then bring everything back into other blocks.
  for (auto& t : engine.tensors) std::memset(t.data(), 0x3C, t.size());
  std::vector<BlockMove> up = {{2, 5}, {3, 6}, {4, 7}};
  auto b3 = (*tm)->Onboard(Tier::kHost, up);
  ASSERT_TRUE(b3.ok());
  std::vector<BlockMove> from_file = {{slot_id, 0, 0, BlockKey{1, 3}}};
  auto b4 = (*tm)->Onboard(Tier::kFile, from_file);
  ASSERT_TRUE(b4.ok()) << b4.status().ToString();
  ASSERT_TRUE(b3->Wait(DeadlineIn(milliseconds(10000))).ok());
  ASSERT_TRUE(b4->Wait(DeadlineIn(milliseconds(10000))).ok());
  ASSERT_TRUE((*tm)->SyncWithCompute(**compute).ok());
  ASSERT_TRUE((*compute)->Synchronize(DeadlineIn(milliseconds(10000))).ok());
  for (int64_t b = 0; b < 3; ++b) {
    auto r = CheckBlock(primary, 500 + b, {b + 5, b * tpb, tpb});
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r->has_value()) << LayoutKindName(GetParam()) << ": " << (*r)->ToString();
  }
  auto r = CheckBlock(primary, 503, {0, 3 * tpb, tpb});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->has_value()) << LayoutKindName(GetParam()) << ": " << (*r)->ToString();
}

INSTANTIATE_TEST_SUITE_P(Wrap, WrappedTiering, ::testing::ValuesIn(NamedLayoutKinds()),
                         [](const auto& info) {
                           std::string s(LayoutKindName(info.param));
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

}  // namespace
}  // namespace kvferry::testing

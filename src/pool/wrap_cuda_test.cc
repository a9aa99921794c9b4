// External memory on the CUDA device (label gpu; skipped without a GPU): an engine's cudaMalloc'd
// KV tensors of every layout, wrapped, go through the tiering manager (GPU <-> pinned host,
// ordered against the engine's own cudaStream_t) and the transceiver (wrapped vLLM-HND device
// pool -> block-major device pool over inproc) element-exact; bad native handles are refused.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "device/cuda_entry.h"
#include "kvferry/inproc_transport.h"
#include "kvferry/tiering.h"
#include "kvferry/transceiver.h"
#include "kvferry/transport.h"
#include "testing/wrap_test_util.h"

namespace kvferry::testing {
namespace {

using std::chrono::milliseconds;

constexpr KvShape kShape{4, 4, 64, DType::kBf16, 2, 16};
constexpr int64_t kBlocks = 8;

Deadline Soon() { return DeadlineIn(milliseconds(30000)); }

#define SKIP_WITHOUT_GPU() \
  if (internal::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA GPU present"

// The engine: cudaMalloc'd tensors and its own stream.
struct Engine {
  std::vector<void*> tensors;
  int64_t tensor_bytes = 0;
  cudaStream_t stream = nullptr;
  ~Engine() {
    for (void* p : tensors) cudaFree(p);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

PoolSpec SpecOf(LayoutKind kind, MemoryKind memory, ParallelConfig parallel = {}, int rank = 0) {
  return PoolSpec{kShape, parallel, rank, kind, memory, kBlocks};
}

// Allocates the engine's tensors for `spec` and wraps them.
BlockPool WrapEngine(Device& dev, const PoolSpec& spec, Engine& eng) {
  const PoolDims n =
      RankPoolDims(spec.shape, *SliceOf(spec.shape, spec.parallel, spec.rank), spec.blocks);
  eng.tensor_bytes = EngineTensorBytes(spec.layout, n, spec.shape.ElementBytes());
  std::vector<ExternalRegion> regions;
  for (int32_t r = 0; r < EngineTensors(spec.layout, n); ++r) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, static_cast<size_t>(eng.tensor_bytes)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0xA5, static_cast<size_t>(eng.tensor_bytes)), cudaSuccess);
    eng.tensors.push_back(p);
    regions.push_back({p, eng.tensor_bytes, MemoryKind::kDevice, 0, {}, {}});
  }
  EXPECT_EQ(cudaStreamCreateWithFlags(&eng.stream, cudaStreamNonBlocking), cudaSuccess);
  auto pool = BlockPool::Wrap(dev, spec, regions);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  return std::move(pool).value();
}

// Region-by-region copies between a device pool and a host pool of the same layout.
void CopyRegions(const BlockPool& dst, const BlockPool& src, cudaStream_t s) {
  ASSERT_EQ(dst.num_regions(), src.num_regions());
  for (int32_t r = 0; r < dst.num_regions(); ++r) {
    ASSERT_EQ(
        cudaMemcpyAsync(dst.region(r), src.region(r),
                        static_cast<size_t>(src.layout().region_bytes()), cudaMemcpyDefault, s),
        cudaSuccess);
  }
}

class WrappedCuda : public ::testing::TestWithParam<LayoutKind> {};

TEST_P(WrappedCuda, TieringRoundTripOnTheEnginesStream) {
  SKIP_WITHOUT_GPU();
  auto dev = std::move(OpenDevice("cuda:0").value());
  auto cpu = OpenCpuDevice();
  Engine eng;
  BlockPool primary = WrapEngine(*dev, SpecOf(GetParam(), MemoryKind::kDevice), eng);
  auto reference = BlockPool::Create(*cpu, SpecOf(GetParam(), MemoryKind::kHost));
  ASSERT_TRUE(reference.ok());
  FillAllBlocks(*reference, 300);
  auto host = BlockPool::Create(*dev, SpecOf(LayoutKind::kBlockMajor, MemoryKind::kPinnedHost));
  ASSERT_TRUE(host.ok());
  auto tm = TransferManager::Create(*dev, primary, &*host, nullptr);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  auto compute = dev->WrapStream(eng.stream);
  ASSERT_TRUE(compute.ok()) << compute.status().ToString();

  // The engine uploads its KV on its stream; the offload must wait for it.
  CopyRegions(primary, *reference, eng.stream);
  ASSERT_TRUE((*tm)->WaitForCompute(**compute).ok());
  std::vector<BlockMove> all;
  for (int64_t b = 0; b < kBlocks; ++b) all.push_back({b, kBlocks - 1 - b});
  auto down = (*tm)->Offload(Tier::kHost, all);
  ASSERT_TRUE(down.ok()) << down.status().ToString();
  ASSERT_TRUE(down->Wait(Soon()).ok());
  const int64_t tpb = kShape.tokens_per_block;
  for (int64_t b = 0; b < kBlocks; ++b) {
    auto r = CheckBlock(*host, 300 + b, {kBlocks - 1 - b, b * tpb, tpb});
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r->has_value()) << LayoutKindName(GetParam()) << ": " << (*r)->ToString();
  }
  // The engine clears its tensors; blocks come back where they were; the engine reads them on
  // its stream after SyncWithCompute.
  for (void* p : eng.tensors)
    ASSERT_EQ(cudaMemsetAsync(p, 0, static_cast<size_t>(eng.tensor_bytes), eng.stream),
              cudaSuccess);
  ASSERT_TRUE((*tm)->WaitForCompute(**compute).ok());
  std::vector<BlockMove> back;
  for (int64_t b = 0; b < kBlocks; ++b) back.push_back({kBlocks - 1 - b, b});
  auto up = (*tm)->Onboard(Tier::kHost, back);
  ASSERT_TRUE(up.ok());
  ASSERT_TRUE((*tm)->SyncWithCompute(**compute).ok());
  auto out = BlockPool::Create(*cpu, SpecOf(GetParam(), MemoryKind::kHost));
  ASSERT_TRUE(out.ok());
  CopyRegions(*out, primary, eng.stream);
  ASSERT_EQ(cudaStreamSynchronize(eng.stream), cudaSuccess);
  ASSERT_TRUE(up->Wait(Soon()).ok());
  ExpectEngineElements(GetParam(), *out, 300, [&](int32_t r) { return out->region(r); });
  compute->reset();
  EXPECT_EQ(cudaStreamQuery(eng.stream), cudaSuccess) << "the engine's stream outlives the wrapper";
}

INSTANTIATE_TEST_SUITE_P(Wrap, WrappedCuda, ::testing::ValuesIn(NamedLayoutKinds()),
                         [](const auto& info) {
                           std::string s(LayoutKindName(info.param));
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

// A request from the engine's vLLM-HND device tensors (TP2) into block-major device pools (TP1),
// layer-wise, each layer gated by the engine's cudaEvent_t recorded on its stream.
TEST(WrappedCudaTransfer, VllmHndIntoBlockMajorOverInproc) {
  SKIP_WITHOUT_GPU();
  auto dev = std::move(OpenDevice("cuda:0").value());
  auto cpu = OpenCpuDevice();
  auto fabric = InProcFabric::Create();
  auto transport = [&] {
    TransportOptions t;
    t.fabric = fabric;
    t.device_memory_is_host = false;  // GPU pools: the in-process transport must stage them
    return std::move(CreateTransport(t).value());
  };
  TransceiverOptions o;
  o.transport = "inproc";
  o.timeout = milliseconds(20000);
  o.instance_secret[0] = 5;
  const ParallelConfig ctx_par{2, 1, {}, 1, 0};
  Engine eng[2];
  std::vector<BlockPool> ctx_pools;
  std::vector<std::unique_ptr<ContextSide>> ctx;
  for (int r = 0; r < 2; ++r) {
    ctx_pools.push_back(WrapEngine(
        *dev, SpecOf(LayoutKind::kPerLayerHnd, MemoryKind::kDevice, ctx_par, r), eng[r]));
  }
  for (int r = 0; r < 2; ++r) {
    auto side = ContextSide::Create(*dev, ctx_pools[r], o, transport());
    ASSERT_TRUE(side.ok()) << side.status().ToString();
    ctx.push_back(std::move(side).value());
  }
  std::vector<std::string> addrs{ctx[0]->address(), ctx[1]->address()};
  for (auto& c : ctx) ASSERT_TRUE(c->SetInstanceAddresses(addrs).ok());
  auto gen_pool = BlockPool::Create(*dev, SpecOf(LayoutKind::kBlockMajor, MemoryKind::kDevice));
  ASSERT_TRUE(gen_pool.ok());
  o.instance_id = 1;
  auto gen = GenerationSide::Create(*dev, *gen_pool, o, transport());
  ASSERT_TRUE(gen.ok()) << gen.status().ToString();

  const uint64_t id = 77;
  const int64_t tokens = 3 * kShape.tokens_per_block + 5;
  const std::vector<int64_t> ctx_blocks{6, 2, 3, 0}, gen_blocks{1, 2, 3, 4};
  std::vector<cudaEvent_t> events;
  std::vector<std::byte> handle;
  for (int r = 0; r < 2; ++r) {
    auto reference =
        BlockPool::Create(*cpu, SpecOf(LayoutKind::kPerLayerHnd, MemoryKind::kHost, ctx_par, r));
    ASSERT_TRUE(reference.ok());
    const int64_t tpb = kShape.tokens_per_block;
    for (size_t i = 0; i < ctx_blocks.size(); ++i) {
      ASSERT_TRUE(FillBlock(*reference, id,
                            {ctx_blocks[i], int64_t(i) * tpb,
                             std::min<int64_t>(tpb, tokens - int64_t(i) * tpb)})
                      .ok());
    }
    auto h = ctx[r]->BeginLayerWise(id, ctx_blocks, tokens);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    handle = *h;
    CopyRegions(ctx_pools[r], *reference, eng[r].stream);  // "prefill" on the engine's stream
    for (int32_t l = 0; l < ctx_pools[r].slice().layer_count; ++l) {
      cudaEvent_t e = nullptr;
      ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
      ASSERT_EQ(cudaEventRecord(e, eng[r].stream), cudaSuccess);
      events.push_back(e);
      auto wrapped = dev->WrapEvent(e);
      ASSERT_TRUE(wrapped.ok()) << wrapped.status().ToString();
      ASSERT_TRUE(
          ctx[r]->MarkLayerReadyOn(id, l, std::shared_ptr<Event>(std::move(*wrapped))).ok());
    }
  }
  ASSERT_TRUE((*gen)->Fetch(handle, gen_blocks, 0).ok());
  for (auto& c : ctx) {
    auto s = c->Poll(1, Soon());
    ASSERT_EQ(s.size(), 1u);
    EXPECT_EQ(s[0].state, TransferState::kComplete) << s[0].reason.ToString();
  }
  auto s = (*gen)->Poll(1, Soon());
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].state, TransferState::kComplete) << s[0].reason.ToString();
  auto out = BlockPool::Create(*cpu, SpecOf(LayoutKind::kBlockMajor, MemoryKind::kHost));
  ASSERT_TRUE(out.ok());
  CopyRegions(*out, *gen_pool, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const int64_t tpb = kShape.tokens_per_block;
  for (size_t i = 0; i < gen_blocks.size(); ++i) {
    auto r = CheckBlock(
        *out, id,
        {gen_blocks[i], int64_t(i) * tpb, std::min<int64_t>(tpb, tokens - int64_t(i) * tpb)});
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r->has_value()) << "block " << i << ": " << (*r)->ToString();
  }
  ctx.clear();
  for (cudaEvent_t e : events) cudaEventDestroy(e);
}

TEST(WrappedCudaNative, BadHandlesAreRefusedNamingThem) {
  SKIP_WITHOUT_GPU();
  auto dev = std::move(OpenDevice("cuda:0").value());
  auto null_stream = dev->WrapStream(nullptr);
  ASSERT_FALSE(null_stream.ok());
  EXPECT_NE(null_stream.status().message().find("null stream"), std::string_view::npos);
  EXPECT_EQ(dev->WrapEvent(nullptr).status().code(), StatusCode::kInvalidArgument);
  // A region on another GPU ordinal is refused before anything is touched.
  Engine eng;
  PoolSpec spec = SpecOf(LayoutKind::kBlockMajor, MemoryKind::kDevice);
  void* p = nullptr;
  const int64_t bytes = kShape.BytesPerToken() * kShape.tokens_per_block * kBlocks;
  ASSERT_EQ(cudaMalloc(&p, static_cast<size_t>(bytes)), cudaSuccess);
  eng.tensors.push_back(p);
  ExternalRegion region{p, bytes, MemoryKind::kDevice, 1, {}, {}};
  auto pool = BlockPool::Wrap(*dev, spec, std::span(&region, 1));
  ASSERT_FALSE(pool.ok());
  EXPECT_NE(pool.status().message().find("device 1"), std::string_view::npos)
      << pool.status().ToString();
  if (internal::CudaDeviceCount() < 2) return;
  // A stream of cuda:1 wrapped on cuda:0; an event of cuda:1 recorded by a cuda:0 stream.
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  cudaStream_t other = nullptr;
  cudaEvent_t other_event = nullptr;
  ASSERT_EQ(cudaStreamCreate(&other), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&other_event), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto foreign = dev->WrapStream(other);
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.status().message().find("belongs to cuda:1"), std::string_view::npos)
      << foreign.status().ToString();
  auto ev = dev->WrapEvent(other_event);
  ASSERT_TRUE(ev.ok()) << ev.status().ToString();
  auto mine = std::move(dev->CreateStream().value());
  Status rec = mine->Record(**ev);
  EXPECT_FALSE(rec.ok());
  cudaGetLastError();
  cudaStreamDestroy(other);
  cudaEventDestroy(other_event);
}

}  // namespace
}  // namespace kvferry::testing

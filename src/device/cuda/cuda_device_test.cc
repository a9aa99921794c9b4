// CUDA-specific tests, beside the shared device conformance suite: both copy paths of CopyBatch
// (gather kernel and copy engine) against the CPU device byte for byte, the partial-block copy
// pattern of KV offload, the descriptor ring under pressure, and opening devices that are absent.
// Tests that need a GPU skip themselves when none is present.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "device/cuda_entry.h"
#include "device/device_conformance.h"
#include "device/peer_memory.h"
#include "kvferry/config.h"
#include "testing/cuda_copy_test_support.h"

namespace kvferry::testing {

std::unique_ptr<Device> DeviceUnderTest() {
  if (internal::CudaDeviceCount() == 0) return nullptr;
  auto d = OpenDevice("cuda:0");
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return d.ok() ? std::move(d).value() : nullptr;
}

namespace {

using copy_test::CpuReference;
using copy_test::ExpectSame;
using copy_test::Extent;
using copy_test::FillPattern;
using copy_test::KnobOverride;
using copy_test::Plan;
using copy_test::Rebase;
using copy_test::Soon;
using std::chrono::milliseconds;

constexpr const char* kThresholdKnob = "cuda.copy_kernel_threshold";

// Random 2-D descriptors of 16 B .. 1 MiB in total, at unaligned offsets and pitches, writing
// disjoint destination ranges (so the result does not depend on the order of the copies).
Plan RandomPlan(uint32_t seed, int count) {
  std::mt19937_64 rng(seed);
  Plan p;
  p.src_size = 8 << 20;
  size_t dst_off = 0;
  for (int i = 0; i < count; ++i) {
    size_t total = size_t{16} << (rng() % 17);  // 16 B .. 1 MiB
    size_t rows = rng() % 3 == 0 ? 1 : 1 + rng() % 64;
    size_t bytes = std::max<size_t>(1, total / rows) + (rng() % 4 == 0 ? rng() % 7 : 0);
    if (rng() % 3 == 0) bytes = (bytes + 15) / 16 * 16;  // some fully aligned rows
    size_t dpitch = bytes + (rng() % 2 ? 0 : rng() % 48);
    size_t spitch = bytes + (rng() % 2 ? 0 : rng() % 48);
    if (rng() % 4 == 0) dpitch = (dpitch + 15) / 16 * 16, spitch = (spitch + 15) / 16 * 16;
    size_t sext = Extent(rows, bytes, spitch), dext = Extent(rows, bytes, dpitch);
    size_t soff = rng() % (p.src_size - sext);
    if (rng() % 3 == 0) soff &= ~size_t{15};
    dst_off += rng() % 40;
    if (rng() % 3 == 0) dst_off = (dst_off + 15) / 16 * 16;
    p.descs.push_back(CopyDesc{reinterpret_cast<void*>(dst_off),
                               reinterpret_cast<const void*>(soff), bytes, rows, dpitch, spitch});
    dst_off += dext;
  }
  p.dst_size = dst_off + 64;
  return p;
}

// Sets the kernel threshold for the streams created while it lives. Threshold 0 sends every
// descriptor to the copy engine, narrow-row 2-D ones included.
class ThresholdOverride {
 public:
  explicit ThresholdOverride(int64_t v) : threshold_(kThresholdKnob, std::to_string(v)) {
    if (v == 0) min_row_.emplace("cuda.copy_engine_min_row_bytes", "0");
  }

 private:
  KnobOverride threshold_;
  std::optional<KnobOverride> min_row_;
};

constexpr int64_t kAllKernel = int64_t{1} << 40;  // every reachable descriptor to the kernel
constexpr int64_t kAllCopyEngine = 0;             // every descriptor to the copy engine

class CudaDeviceTest : public copy_test::GpuCopyTest {
 protected:
  // Runs `p` on the GPU with source and destination of the given kinds; returns the destination.
  std::vector<std::byte> RunOnGpu(const Plan& p, uint32_t seed, MemoryKind src_kind,
                                  MemoryKind dst_kind, int64_t threshold) {
    ThresholdOverride t(threshold);
    return RunPlan(p, seed, src_kind, dst_kind);
  }
};

TEST(CudaEntry, AbsentDeviceIsUnavailable) {
  EXPECT_TRUE(internal::CudaCompiledIn());
  auto d = OpenDevice("cuda:99");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(d.status().message().find("cuda:99"), std::string_view::npos) << d.status().ToString();
}

TEST(CudaEntry, VersionAndCount) {
  std::string v = internal::CudaVersionString();
  EXPECT_EQ(v.rfind("runtime ", 0), 0u) << v;
  int n = internal::CudaDeviceCount();
  EXPECT_GE(n, 0);
  EXPECT_EQ(ListDevices().size(), static_cast<size_t>(n) + 1);
  if (n == 0) {
    EXPECT_EQ(OpenDevice("cuda").status().code(), StatusCode::kUnavailable);
  }
}

TEST_F(CudaDeviceTest, InfoDescribesTheGpu) {
  EXPECT_EQ(dev_->info().platform, "cuda");
  EXPECT_GT(dev_->info().memory_bytes, 0);
  EXPECT_FALSE(dev_->info().name.empty());
}

TEST_F(CudaDeviceTest, BothBatchPathsMatchTheCpuDevice) {
  struct Kinds {
    MemoryKind src, dst;
  };
  const Kinds kinds[] = {{MemoryKind::kDevice, MemoryKind::kDevice},
                         {MemoryKind::kPinnedHost, MemoryKind::kDevice},
                         {MemoryKind::kDevice, MemoryKind::kPinnedHost},
                         {MemoryKind::kHost, MemoryKind::kDevice},
                         {MemoryKind::kDevice, MemoryKind::kHost}};
  for (uint32_t seed : {1u, 2u, 3u}) {
    Plan p = RandomPlan(seed, 150);
    std::vector<std::byte> want = CpuReference(p, seed);
    for (const Kinds& k : kinds) {
      for (int64_t threshold : {kAllKernel, kAllCopyEngine, int64_t{65536}}) {
        std::string what =
            "seed " + std::to_string(seed) + " " + std::string(MemoryKindName(k.src)) + "->" +
            std::string(MemoryKindName(k.dst)) + " threshold " + std::to_string(threshold);
        ExpectSame(want, RunOnGpu(p, seed, k.src, k.dst, threshold), what);
      }
    }
  }
}

// The other routing knobs: small fragments of one or both directions on the copy engine (one
// cudaMemcpyBatchAsync), one copy-engine call per fragment, a gather grid of one block, narrow
// 2-D rows kept on the kernel whatever their total, every 2-D fragment on the copy engine as one
// cudaMemcpy2DAsync (none listed row by row). Every variant is byte-identical to the CPU.
TEST_F(CudaDeviceTest, RoutingVariantsMatchTheCpuDevice) {
  struct Variant {
    const char* knob;
    const char* value;
  };
  const Variant variants[] = {{"cuda.copy_engine_directions", "both"},
                              {"cuda.copy_engine_directions", "h2d"},
                              {"cuda.copy_engine_directions", "d2h"},
                              {"cuda.batch_copies", "false"},
                              {"cuda.gather_max_blocks", "1"},
                              {"cuda.copy_engine_min_row_bytes", "1099511627776"},
                              {"cuda.copy_engine_list_row_bytes", "1099511627776"}};
  const MemoryKind kinds[][2] = {{MemoryKind::kPinnedHost, MemoryKind::kDevice},
                                 {MemoryKind::kDevice, MemoryKind::kPinnedHost},
                                 {MemoryKind::kDevice, MemoryKind::kDevice}};
  for (uint32_t seed : {11u, 12u}) {
    Plan p = RandomPlan(seed, 200);
    std::vector<std::byte> want = CpuReference(p, seed);
    for (const Variant& v : variants) {
      KnobOverride o(v.knob, v.value);
      for (const auto& k : kinds) {
        for (int64_t threshold : {int64_t{1} << 20, int64_t{4096}}) {
          std::string what = "seed " + std::to_string(seed) + " " + v.knob + "=" + v.value + " " +
                             std::string(MemoryKindName(k[0])) + "->" +
                             std::string(MemoryKindName(k[1])) + " threshold " +
                             std::to_string(threshold);
          ExpectSame(want, RunOnGpu(p, seed, k[0], k[1], threshold), what);
        }
      }
    }
  }
}

// Partial reuse: the first N tokens of every (layer, kv, head) plane of block-major blocks
// [layer][kv][head][token][dim], copied from a device pool into host blocks of the same layout
// and into a packed staging buffer.
TEST_F(CudaDeviceTest, PartialBlockCopyEveryDtype) {
  const size_t layers = 3, kv = 2, heads = 4, tokens = 32;
  const size_t planes = layers * kv * heads;
  for (size_t elem : {1, 2, 4}) {
    for (size_t head_dim : {128, 7}) {
      const size_t pitch = tokens * head_dim * elem, block = planes * pitch;
      for (size_t n : {size_t{1}, size_t{5}, tokens - 1, tokens}) {
        Plan p;
        p.src_size = 4 * block;
        // Blocks 2 and 0 of the pool: same layout in dst blocks 0, 1; packed after them.
        size_t packed = 2 * block, bytes = n * head_dim * elem;
        for (size_t b : {size_t{2}, size_t{0}}) {
          size_t k = b == 2 ? 0 : 1;
          p.descs.push_back({reinterpret_cast<void*>(k * block),
                             reinterpret_cast<const void*>(b * block), bytes, planes, pitch,
                             pitch});
          p.descs.push_back({reinterpret_cast<void*>(packed),
                             reinterpret_cast<const void*>(b * block), bytes, planes, bytes,
                             pitch});
          packed += planes * bytes;
        }
        p.dst_size = packed;
        uint32_t seed = static_cast<uint32_t>(elem * 1000 + head_dim * 10 + n);
        std::vector<std::byte> want = CpuReference(p, seed);
        for (int64_t threshold : {kAllKernel, kAllCopyEngine}) {
          for (MemoryKind dst : {MemoryKind::kPinnedHost, MemoryKind::kDevice}) {
            std::string what = "elem " + std::to_string(elem) + " head_dim " +
                               std::to_string(head_dim) + " N " + std::to_string(n) +
                               " threshold " + std::to_string(threshold) + " dst " +
                               std::string(MemoryKindName(dst));
            ExpectSame(want, RunOnGpu(p, seed, MemoryKind::kDevice, dst, threshold), what);
          }
        }
      }
    }
  }
}

// Many batches queued behind a held stream: the descriptor ring must grow rather than reuse
// slices the kernel has not read yet, and every batch must land. The gate opens from another
// thread: growing allocates pinned memory, which CUDA may make wait for the queued work.
TEST_F(CudaDeviceTest, DescriptorRingUnderPressure) {
  ThresholdOverride t(kAllKernel);
  const size_t kFrag = 64, kBatches = 40, kPerBatch = 1000;  // 80k descriptors > initial ring
  const size_t n = kBatches * kPerBatch * kFrag;
  Buffer src = Alloc(MemoryKind::kPinnedHost, n), dst = Alloc(MemoryKind::kPinnedHost, n);
  Buffer dev = Alloc(MemoryKind::kDevice, n);
  FillPattern(src.data(), n, 77);
  std::memset(dst.data(), 0, n);
  auto s = NewStream();
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  ASSERT_TRUE(s->HostCallback([open] { open.wait(); }).ok());
  std::thread opener([&gate] {
    std::this_thread::sleep_for(milliseconds(300));
    gate.set_value();
  });
  std::vector<CopyDesc> batch(kPerBatch);
  for (size_t b = 0; b < kBatches; ++b) {
    for (size_t i = 0; i < kPerBatch; ++i) {
      size_t f = b * kPerBatch + i, g = (f * 7919) % (kBatches * kPerBatch);  // permuted
      batch[i] = CopyDesc{dev.data() + g * kFrag, src.data() + f * kFrag, kFrag};
    }
    EXPECT_TRUE(s->CopyBatch(batch).ok());
  }
  for (size_t b = 0; b < kBatches; ++b) {
    for (size_t i = 0; i < kPerBatch; ++i) {
      size_t f = b * kPerBatch + i, g = (f * 7919) % (kBatches * kPerBatch);
      batch[i] = CopyDesc{dst.data() + f * kFrag, dev.data() + g * kFrag, kFrag};
    }
    EXPECT_TRUE(s->CopyBatch(batch).ok());
  }
  opener.join();
  Status st = s->Synchronize(Soon());
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), n), 0);
}

TEST_F(CudaDeviceTest, RejectsRowsWiderThanPitch) {
  Buffer a = Alloc(MemoryKind::kDevice, 4096), b = Alloc(MemoryKind::kDevice, 4096);
  auto s = NewStream();
  CopyDesc bad{a.data(), b.data(), 100, 4, 64, 128};
  EXPECT_EQ(s->CopyBatch({&bad, 1}).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(s->Synchronize(Soon()).ok());
}

// Peer memory: an interior region of an allocation exports (a handle naming the allocation and
// the offset); the exporting process maps its own handle to the region itself; host memory and
// a region running past its allocation are refused. (Another process maps it by CUDA IPC: the
// UCX selftest and bench transfer rows of scripts/gpu-check run that.)
TEST_F(CudaDeviceTest, ExportsDeviceRegionsAndMapsItsOwnHandle) {
  Buffer a = Alloc(MemoryKind::kDevice, 1 << 20);
  auto h = dev_->ExportMemory(a.data() + 4096, 8192, MemoryKind::kDevice);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  auto m = dev_->ImportMemory(*h);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->data(), a.data() + 4096);
  EXPECT_EQ((*m)->size(), 8192u);
  EXPECT_EQ(dev_->ExportMemory(a.data() + 4096, 1 << 20, MemoryKind::kDevice).status().code(),
            StatusCode::kInvalidArgument);
  Buffer host = Alloc(MemoryKind::kPinnedHost, 4096);
  EXPECT_EQ(dev_->ExportMemory(host.data(), 4096, MemoryKind::kPinnedHost).status().code(),
            StatusCode::kInvalidArgument);
  auto cpu = OpenCpuDevice();
  std::vector<std::byte> mine(64);
  auto cpu_handle = cpu->ExportMemory(mine.data(), mine.size(), MemoryKind::kHost);
  ASSERT_TRUE(cpu_handle.ok());
  EXPECT_EQ(dev_->ImportMemory(*cpu_handle).status().code(), StatusCode::kUnavailable);
}

// Issue 29: the exporting process mapped its own handle's raw address and length. Now only the
// region it exported, exactly as registered under the handle's token.
TEST_F(CudaDeviceTest, OwnHandleMapsOnlyTheExportedRegion) {
  Buffer a = Alloc(MemoryKind::kDevice, 1 << 20);
  Buffer b = Alloc(MemoryKind::kDevice, 1 << 20);
  auto h = dev_->ExportMemory(a.data() + 4096, 8192, MemoryKind::kDevice);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  const PeerHandle good = DecodePeerHandle(*h).value();
  std::vector<PeerHandle> forged(3, good);
  forged[0].address = reinterpret_cast<uintptr_t>(b.data());
  forged[1].bytes = 1 << 19;
  forged[2].export_token ^= 1;
  for (const PeerHandle& f : forged) {
    auto st = dev_->ImportMemory(EncodePeerHandle(f)).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  }
  ASSERT_TRUE(dev_->ImportMemory(*h).ok());
}

// The exporter of the cross-process test below: this binary run again with KVFERRY_IPC_CHILD set
// (CUDA does not survive fork). Prints its handle of 8 KiB at offset 4 KiB of a 1 MiB allocation
// as hex, then waits until the file named by KVFERRY_IPC_CHILD exists (30 s at most).
TEST(CudaIpcChild, Export) {
  const char* done = std::getenv("KVFERRY_IPC_CHILD");
  if (done == nullptr)
    GTEST_SKIP() << "run by CudaDeviceTest.PeerHandleMapsOnlyInsideItsAllocation";
  auto dev = OpenDevice("cuda:0");
  ASSERT_TRUE(dev.ok());
  auto a = (*dev)->Allocate(MemoryKind::kDevice, 1 << 20);
  ASSERT_TRUE(a.ok());
  auto h = (*dev)->ExportMemory(a->data() + 4096, 8192, MemoryKind::kDevice);
  ASSERT_TRUE(h.ok());
  std::string hex;
  for (std::byte x : *h) hex += fmt::format("{:02x}", static_cast<int>(x));
  std::printf("HANDLE %s\n", hex.c_str());
  std::fflush(stdout);
  for (int i = 0; i < 3000 && access(done, F_OK) != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

// Issue 29: a CUDA IPC handle from another process was mapped at its declared offset and size
// without a check against the allocation it opens. Now a region past the allocation is refused
// (its size from cuMemGetAddressRange), and the genuine handle maps.
TEST_F(CudaDeviceTest, PeerHandleMapsOnlyInsideItsAllocation) {
  const std::string done = fmt::format("/tmp/kvferry-ipc-child-{}", getpid());
  std::remove(done.c_str());
  const std::string cmd = fmt::format(
      "KVFERRY_IPC_CHILD={} /proc/{}/exe --gtest_filter=CudaIpcChild.Export 2>&1", done, getpid());
  FILE* child = popen(cmd.c_str(), "r");
  ASSERT_NE(child, nullptr);
  std::vector<std::byte> handle;
  char line[4096];
  while (handle.empty() && std::fgets(line, sizeof line, child) != nullptr) {
    std::string text(line);
    if (text.rfind("HANDLE ", 0) != 0) continue;
    for (size_t i = 7; i + 1 < text.size() && std::isxdigit(text[i]); i += 2)
      handle.push_back(static_cast<std::byte>(std::stoi(text.substr(i, 2), nullptr, 16)));
  }
  EXPECT_FALSE(handle.empty()) << "the exporting child printed no handle";
  if (!handle.empty()) {
    PeerHandle h = DecodePeerHandle(handle).value();
    auto with = [&](uint64_t offset, uint64_t bytes) {
      PeerHandle f = h;
      f.bytes = bytes;
      for (int i = 0; i < 8; ++i) f.payload[4 + i] = static_cast<std::byte>(offset >> (8 * i));
      return dev_->ImportMemory(EncodePeerHandle(f)).status();
    };
    EXPECT_EQ(with((1 << 20) - 4096, 8192).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(with(4096, 1 << 20).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(with(uint64_t{1} << 62, 8192).code(), StatusCode::kInvalidArgument);
    auto m = dev_->ImportMemory(handle);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
  }
  std::fclose(std::fopen(done.c_str(), "w"));
  pclose(child);
  std::remove(done.c_str());
}

}  // namespace
}  // namespace kvferry::testing

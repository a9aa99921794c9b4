// The gather kernel's second grid dimension (cuda_kernels.cu): a batch of few descriptors with
// many rows (TP2 -> TP4 head slices: one descriptor per block, 64 rows of 16 KiB) spreads its rows
// over every block up to the cap. Checked byte for byte against the CPU device for aligned,
// unaligned, single-row and narrow-row descriptors under several caps, and timed beside one
// contiguous device copy of the same bytes (the same-run baseline). Skips without a GPU.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvferry/config.h"
#include "kvferry/device.h"
#include "testing/cuda_copy_test_support.h"

namespace kvferry {
namespace {

using copy_test::CpuReference;
using copy_test::ExpectSame;
using copy_test::KnobOverride;
using copy_test::Plan;
using copy_test::Rebase;
using copy_test::Soon;

size_t Extent(const CopyDesc& c, bool dst) {
  return copy_test::Extent(c.rows, c.bytes, dst ? c.dst_pitch : c.src_pitch);
}

// `count` descriptors of `rows` rows of `bytes` each; the source interleaves them (a context
// rank's block holds twice the heads a generation rank takes), the destination packs them.
Plan HeadSliced(int count, size_t rows, size_t bytes, size_t skew) {
  Plan p;
  const size_t src_pitch = 2 * bytes + skew, dst_pitch = bytes + skew;
  for (int i = 0; i < count; ++i) {
    CopyDesc c{};
    c.src = reinterpret_cast<const void*>(p.src_size + skew);
    c.dst = reinterpret_cast<void*>(p.dst_size + skew);
    c.bytes = bytes;
    c.rows = rows;
    c.src_pitch = src_pitch;
    c.dst_pitch = dst_pitch;
    p.descs.push_back(c);
    p.src_size += Extent(c, false) + skew + 16;
    p.dst_size += Extent(c, true) + skew + 16;
  }
  return p;
}

class GatherGridTest : public copy_test::GpuCopyTest {
 protected:
  // Runs `p` device to device on the kernel (threshold past any batch) and returns the result.
  std::vector<std::byte> RunOnGpu(const Plan& p, uint32_t seed) {
    KnobOverride kernel("cuda.copy_kernel_threshold", "1099511627776");
    KnobOverride narrow("cuda.copy_engine_min_row_bytes", "1099511627776");
    return RunPlan(p, seed, MemoryKind::kDevice, MemoryKind::kDevice);
  }
};

TEST_F(GatherGridTest, FewDescriptorsSplitOverTheGridMatchTheCpuDevice) {
  struct Case {
    const char* name;
    int count;
    size_t rows, bytes, skew;
  };
  const Case cases[] = {
      {"head slices, aligned", 4, 64, 16 << 10, 0},
      {"head slices, unaligned", 3, 64, (16 << 10) + 3, 5},
      {"one long row, aligned", 1, 1, 3 << 20, 0},
      {"one long row, unaligned", 2, 1, (3 << 20) + 7, 3},
      {"narrow rows, aligned", 5, 1000, 64, 0},
      {"narrow rows, aligned, many", 2, 40000, 48, 0},
      {"narrow rows, unaligned", 2, 777, 37, 1},
      // Rows of 512 B to 2 KiB are walked flat with the narrow ones (vLLM NHD -> HND).
      {"512 B rows, aligned", 3, 500, 512, 0},
      {"1040 B rows (65 vectors), aligned", 2, 333, 1040, 0},
      {"2032 B rows, aligned", 2, 129, 2032, 0},
      {"2 KiB rows, aligned", 2, 129, 2048, 0},
  };
  uint32_t seed = 100;
  for (const Case& c : cases) {
    Plan p = HeadSliced(c.count, c.rows, c.bytes, c.skew);
    std::vector<std::byte> want = CpuReference(p, ++seed);
    for (const char* cap : {"0", "1", "7", "64", "264"}) {
      KnobOverride blocks("cuda.gather_max_blocks", cap);
      ExpectSame(want, RunOnGpu(p, seed), fmt::format("{}, gather_max_blocks {}", c.name, cap));
    }
  }
}

// TP2 -> TP4 of a Llama-3-8B block-major pool: 64 blocks, each 64 rows (layer, kv) of 16 KiB
// (two of a context rank's four heads), 64 MiB in one batch, timed beside one contiguous
// cudaMemcpy of the same bytes (device to device, same stream).
TEST_F(GatherGridTest, HeadSlicedBatchBesideOneContiguousCopy) {
  Plan p = HeadSliced(64, 64, 16 << 10, 0);
  const size_t bytes = 64 * 64 * (16 << 10);
  KnobOverride kernel("cuda.copy_kernel_threshold", "1099511627776");
  Buffer src = Alloc(MemoryKind::kDevice, p.src_size);
  Buffer dst = Alloc(MemoryKind::kDevice, p.dst_size);
  auto s = dev_->CreateStream();
  ASSERT_TRUE(s.ok());
  const std::vector<CopyDesc> descs = Rebase(p, dst.data(), src.data());
  auto time_gbps = [&](auto&& enqueue) {
    constexpr int kIters = 20;
    EXPECT_TRUE(enqueue().ok());  // warm-up
    EXPECT_TRUE((*s)->Synchronize(Soon()).ok());
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kIters; ++i) EXPECT_TRUE(enqueue().ok());
    EXPECT_TRUE((*s)->Synchronize(Soon()).ok());
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return kIters * static_cast<double>(bytes) / secs / 1e9;
  };
  const double contiguous = time_gbps([&] { return (*s)->Copy(dst.data(), src.data(), bytes); });
  double one_per_desc = 0;
  {
    // The grid before it had a second dimension: one block per descriptor.
    KnobOverride blocks("cuda.gather_max_blocks", "64");
    auto old = dev_->CreateStream();
    ASSERT_TRUE(old.ok());
    std::swap(*s, *old);
    one_per_desc = time_gbps([&] { return (*s)->CopyBatch(descs); });
    std::swap(*s, *old);
  }
  const double split = time_gbps([&] { return (*s)->CopyBatch(descs); });
  // The same bytes as one tall descriptor (consecutive blocks merged by the peer-memory sender).
  Plan tall_plan = HeadSliced(1, 64 * 64, 16 << 10, 0);
  Buffer tall_src = Alloc(MemoryKind::kDevice, tall_plan.src_size);
  Buffer tall_dst = Alloc(MemoryKind::kDevice, tall_plan.dst_size);
  const std::vector<CopyDesc> tall_descs = Rebase(tall_plan, tall_dst.data(), tall_src.data());
  const double tall = time_gbps([&] { return (*s)->CopyBatch(tall_descs); });
  std::printf(
      "head-sliced 64 MiB (64 descriptors x 64 rows x 16 KiB), device to device: gather kernel "
      "%.0f GB/s (one block per descriptor: %.0f GB/s; one descriptor of 4096 rows: %.0f GB/s) "
      "beside one cudaMemcpy of the same bytes %.0f GB/s: ratio %.2f\n",
      split, one_per_desc, tall, contiguous, split / contiguous);
  EXPECT_GT(split, 0);
  EXPECT_GT(contiguous, 0);
}

}  // namespace
}  // namespace kvferry

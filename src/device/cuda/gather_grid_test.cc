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

#include "device/cuda_entry.h"
#include "kvferry/config.h"
#include "kvferry/device.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

Deadline Soon() { return DeadlineIn(milliseconds(30000)); }

// Copies with offsets in place of addresses.
struct Plan {
  std::vector<CopyDesc> descs;
  size_t src_size = 0, dst_size = 0;
};

size_t Extent(const CopyDesc& c, bool dst) {
  const size_t pitch = dst ? c.dst_pitch : c.src_pitch;
  return c.rows <= 1 ? c.bytes : (c.rows - 1) * pitch + c.bytes;
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

std::vector<CopyDesc> Rebase(const Plan& p, std::byte* dst, const std::byte* src) {
  std::vector<CopyDesc> out = p.descs;
  for (CopyDesc& c : out) {
    c.dst = dst + reinterpret_cast<uintptr_t>(c.dst);
    c.src = src + reinterpret_cast<uintptr_t>(c.src);
  }
  return out;
}

void FillPattern(std::byte* p, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(rng());
}

class KnobOverride {
 public:
  KnobOverride(std::string name, const std::string& value) : name_(std::move(name)) {
    Status st = Config::Global().Set(name_, value);
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  ~KnobOverride() { EXPECT_TRUE(Config::Global().Reset(name_).ok()); }

 private:
  std::string name_;
};

class GatherGridTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (internal::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA GPU present";
    auto d = OpenDevice("cuda:0");
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    dev_ = std::move(d).value();
  }
  Buffer Alloc(MemoryKind k, size_t n) {
    auto b = dev_->Allocate(k, n);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    return b.ok() ? std::move(b).value() : Buffer();
  }

  static std::vector<std::byte> CpuReference(const Plan& p, uint32_t seed) {
    auto cpu = OpenCpuDevice();
    auto src = cpu->Allocate(MemoryKind::kHost, p.src_size);
    auto dst = cpu->Allocate(MemoryKind::kHost, p.dst_size);
    EXPECT_TRUE(src.ok() && dst.ok());
    FillPattern(src->data(), p.src_size, seed);
    std::memset(dst->data(), 0xEE, p.dst_size);
    auto s = cpu->CreateStream();
    EXPECT_TRUE((*s)->CopyBatch(Rebase(p, dst->data(), src->data())).ok());
    EXPECT_TRUE((*s)->Synchronize(Soon()).ok());
    return std::vector<std::byte>(dst->data(), dst->data() + p.dst_size);
  }

  // Runs `p` device to device on the kernel (threshold past any batch) and returns the result.
  std::vector<std::byte> RunOnGpu(const Plan& p, uint32_t seed) {
    KnobOverride kernel("cuda.copy_kernel_threshold", "1099511627776");
    KnobOverride narrow("cuda.copy_engine_min_row_bytes", "1099511627776");
    auto s = dev_->CreateStream();
    EXPECT_TRUE(s.ok());
    Buffer host_src = Alloc(MemoryKind::kPinnedHost, p.src_size);
    Buffer host_dst = Alloc(MemoryKind::kPinnedHost, p.dst_size);
    Buffer src = Alloc(MemoryKind::kDevice, p.src_size);
    Buffer dst = Alloc(MemoryKind::kDevice, p.dst_size);
    FillPattern(host_src.data(), p.src_size, seed);
    EXPECT_TRUE((*s)->Copy(src.data(), host_src.data(), p.src_size).ok());
    EXPECT_TRUE((*s)->Fill(dst.data(), 0xEE, p.dst_size).ok());
    Status st = (*s)->CopyBatch(Rebase(p, dst.data(), src.data()));
    EXPECT_TRUE(st.ok()) << st.ToString();
    EXPECT_TRUE((*s)->Copy(host_dst.data(), dst.data(), p.dst_size).ok());
    st = (*s)->Synchronize(Soon());
    EXPECT_TRUE(st.ok()) << st.ToString();
    return std::vector<std::byte>(host_dst.data(), host_dst.data() + p.dst_size);
  }

  std::unique_ptr<Device> dev_;
};

void ExpectSame(const std::vector<std::byte>& want, const std::vector<std::byte>& got,
                const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  if (std::memcmp(want.data(), got.data(), want.size()) == 0) return;
  size_t i = 0;
  while (want[i] == got[i]) ++i;
  ADD_FAILURE() << what << ": first difference at byte " << i << " of " << want.size();
}

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
      {"narrow rows, unaligned", 2, 777, 37, 1},
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
  std::printf(
      "head-sliced 64 MiB (64 descriptors x 64 rows x 16 KiB), device to device: gather kernel "
      "%.0f GB/s (one block per descriptor: %.0f GB/s) beside one cudaMemcpy of the same bytes "
      "%.0f GB/s: ratio %.2f\n",
      split, one_per_desc, contiguous, split / contiguous);
  EXPECT_GT(split, 0);
  EXPECT_GT(contiguous, 0);
}

}  // namespace
}  // namespace kvferry

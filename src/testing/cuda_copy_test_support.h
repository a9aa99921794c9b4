// What the CUDA copy tests share (cuda_device_test.cc, gather_grid_test.cc): copy plans with
// offsets in place of addresses, the CPU device's result of a plan (the reference every device
// must match byte for byte), knob overrides, and a fixture that opens cuda:0 (skipping without a
// GPU) and runs a plan on it.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "device/cuda_entry.h"
#include "kvferry/config.h"
#include "kvferry/device.h"

namespace kvferry::copy_test {

inline Deadline Soon() { return DeadlineIn(std::chrono::milliseconds(30000)); }

// Descriptors with offsets in place of addresses; Rebase() turns them into real copies.
struct Plan {
  std::vector<CopyDesc> descs;
  size_t src_size = 0;
  size_t dst_size = 0;
};

inline std::vector<CopyDesc> Rebase(const Plan& p, std::byte* dst, const std::byte* src) {
  std::vector<CopyDesc> out = p.descs;
  for (CopyDesc& c : out) {
    c.dst = dst + reinterpret_cast<uintptr_t>(c.dst);
    c.src = src + reinterpret_cast<uintptr_t>(c.src);
  }
  return out;
}

// Bytes a descriptor side spans: `rows` rows of `bytes`, `pitch` apart.
inline size_t Extent(size_t rows, size_t bytes, size_t pitch) {
  return rows <= 1 ? bytes : (rows - 1) * pitch + bytes;
}

inline void FillPattern(std::byte* p, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(rng());
}

// The CPU device's result of the plan: what every other device must produce.
inline std::vector<std::byte> CpuReference(const Plan& p, uint32_t seed) {
  auto cpu = OpenCpuDevice();
  auto src = cpu->Allocate(MemoryKind::kHost, p.src_size);
  auto dst = cpu->Allocate(MemoryKind::kHost, p.dst_size);
  EXPECT_TRUE(src.ok() && dst.ok());
  FillPattern(src->data(), p.src_size, seed);
  std::memset(dst->data(), 0xEE, p.dst_size);
  auto s = cpu->CreateStream();
  EXPECT_TRUE(s.ok());
  EXPECT_TRUE((*s)->CopyBatch(Rebase(p, dst->data(), src->data())).ok());
  EXPECT_TRUE((*s)->Synchronize(Soon()).ok());
  return std::vector<std::byte>(dst->data(), dst->data() + p.dst_size);
}

inline void ExpectSame(const std::vector<std::byte>& want, const std::vector<std::byte>& got,
                       const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  if (std::memcmp(want.data(), got.data(), want.size()) == 0) return;
  size_t i = 0;
  while (want[i] == got[i]) ++i;
  ADD_FAILURE() << what << ": first difference at byte " << i << " of " << want.size();
}

// Sets a knob for the streams created while it lives; resets it when it goes.
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

// Opens cuda:0 (skips without a GPU) and runs plans on it.
class GpuCopyTest : public ::testing::Test {
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
  std::unique_ptr<Stream> NewStream() {
    auto s = dev_->CreateStream();
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  // Runs `p` on a new stream with source and destination of the given kinds (filled through
  // pinned host memory) and returns the destination.
  std::vector<std::byte> RunPlan(const Plan& p, uint32_t seed, MemoryKind src_kind,
                                 MemoryKind dst_kind) {
    auto s = NewStream();
    Buffer host_src = Alloc(MemoryKind::kPinnedHost, p.src_size);
    Buffer host_dst = Alloc(MemoryKind::kPinnedHost, p.dst_size);
    Buffer src = Alloc(src_kind, p.src_size), dst = Alloc(dst_kind, p.dst_size);
    FillPattern(host_src.data(), p.src_size, seed);
    EXPECT_TRUE(s->Copy(src.data(), host_src.data(), p.src_size).ok());
    EXPECT_TRUE(s->Fill(dst.data(), 0xEE, p.dst_size).ok());
    Status st = s->CopyBatch(Rebase(p, dst.data(), src.data()));
    EXPECT_TRUE(st.ok()) << st.ToString();
    EXPECT_TRUE(s->Copy(host_dst.data(), dst.data(), p.dst_size).ok());
    st = s->Synchronize(Soon());
    EXPECT_TRUE(st.ok()) << st.ToString();
    return std::vector<std::byte>(host_dst.data(), host_dst.data() + p.dst_size);
  }

  std::unique_ptr<Device> dev_;
};

}  // namespace kvferry::copy_test

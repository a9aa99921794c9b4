// Stream::Digest on the device under test (the CPU device in cpu_device_test, the CUDA device in
// cuda_device_test) equals the host's digest of the same bytes (DigestOnHost, itself checked
// against libxxhash in run_digest_test.cc), for random runs in device memory; and its speed, beside
// a copy of the same bytes on the same stream (DIGEST| lines).
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "device/device_conformance.h"
#include "device/run_digest.h"

namespace kvferry::testing {
namespace {

using std::chrono::milliseconds;

class DigestConformance : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = DeviceUnderTest();
    if (!device_) GTEST_SKIP() << "no device of this kind present";
    auto s = device_->CreateStream();
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    stream_ = std::move(s).value();
  }
  Buffer Alloc(MemoryKind kind, size_t n) {
    auto b = device_->Allocate(kind, n);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    return b.ok() ? std::move(b).value() : Buffer();
  }
  // The device's digests of `runs` (addresses in `dev`) into pinned memory.
  std::vector<uint64_t> DeviceDigests(const std::vector<DigestRun>& runs) {
    const size_t n = DigestSegmentCount(runs);
    Buffer out = Alloc(MemoryKind::kPinnedHost, std::max<size_t>(n, 1) * 8);
    auto* p = reinterpret_cast<uint64_t*>(out.data());
    EXPECT_TRUE(stream_->Digest(runs, p).ok());
    EXPECT_TRUE(stream_->Synchronize(DeadlineIn(milliseconds(20000))).ok());
    return std::vector<uint64_t>(p, p + n);
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
};

TEST_F(DigestConformance, EqualsTheHostDigestOfTheSameBytes) {
  const size_t n = 4 << 20;
  std::mt19937_64 rng(21);
  Buffer host = Alloc(MemoryKind::kPinnedHost, n), dev = Alloc(MemoryKind::kDevice, n);
  for (size_t i = 0; i < n; ++i) host.data()[i] = std::byte(rng());
  ASSERT_TRUE(stream_->Copy(dev.data(), host.data(), n).ok());
  static constexpr size_t kWidths[] = {1,   6,    8,    31,   32,    40,    128,
                                       256, 2048, 4096, 4100, 16384, 100000};
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<DigestRun> on_dev, on_host;
    const int count = 1 + static_cast<int>(rng() % 8);
    for (int i = 0; i < count; ++i) {
      const size_t bytes = kWidths[rng() % std::size(kWidths)];
      const size_t rows = 1 + rng() % 40;
      const size_t pitch = bytes + rng() % 300;
      const size_t span = (rows - 1) * pitch + bytes;
      if (span >= n) continue;
      const size_t at = rng() % (n - span);
      on_dev.push_back(DigestRun{dev.data() + at, bytes, rows, pitch});
      on_host.push_back(DigestRun{host.data() + at, bytes, rows, pitch});
    }
    std::vector<uint64_t> want(DigestSegmentCount(on_host));
    internal::DigestOnHost(on_host, want.data());
    ASSERT_EQ(DeviceDigests(on_dev), want) << "trial " << trial;
  }
  // The same bytes at a 1 MiB contiguous run: the chunk digests agree too.
  const DigestRun d{dev.data() + 3, 1 << 20, 1, 0}, h{host.data() + 3, 1 << 20, 1, 0};
  std::vector<uint64_t> want(DigestSegmentCount({&h, 1}));
  internal::DigestOnHost({&h, 1}, want.data());
  EXPECT_EQ(internal::CombineDigests(DeviceDigests({d})), internal::CombineDigests(want));
}

// Digest speed over a contiguous region and over head-sliced rows (256 of every 1024 bytes, a
// TP2 -> TP4 piece), beside a device-to-device copy of the same bytes on the same stream.
TEST_F(DigestConformance, ThroughputBesideACopy) {
  const bool gpu = device_->info().platform != "cpu";
  const size_t n = gpu ? size_t{1} << 30 : size_t{64} << 20;
  Buffer a = Alloc(MemoryKind::kDevice, n), b = Alloc(MemoryKind::kDevice, n);
  ASSERT_TRUE(stream_->Fill(a.data(), 0x3C, n).ok());
  const size_t segs = n / kDigestSegmentBytes;
  Buffer out = Alloc(MemoryKind::kPinnedHost, segs * 8);
  auto seconds = [&](auto&& enqueue) {
    double best = 1e9;
    for (int i = 0; i < 4; ++i) {
      EXPECT_TRUE(stream_->Synchronize(DeadlineIn(milliseconds(60000))).ok());
      const auto t0 = Clock::now();
      EXPECT_TRUE(enqueue().ok());
      EXPECT_TRUE(stream_->Synchronize(DeadlineIn(milliseconds(60000))).ok());
      best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return best;
  };
  const double copy_s = seconds([&] { return stream_->Copy(b.data(), a.data(), n); });
  struct Shape {
    const char* name;
    DigestRun run;
    size_t bytes;
  };
  const Shape shapes[] = {{"contiguous", {a.data(), n, 1, 0}, n},
                          {"rows256of1024", {a.data(), 256, n / 1024, 1024}, n / 4}};
  for (const Shape& s : shapes) {
    const double digest_s = seconds([&] {
      return stream_->Digest({&s.run, 1}, reinterpret_cast<uint64_t*>(out.data()));
    });
    const double gbps = s.bytes / digest_s / 1e9, copy_gbps = n / copy_s / 1e9;
    std::printf("DIGEST| device=%s shape=%s bytes=%zu digest_gbps=%.1f copy_gbps=%.1f ratio=%.2f\n",
                device_->info().platform.c_str(), s.name, s.bytes, gbps, copy_gbps,
                gbps / copy_gbps);
    EXPECT_GT(gbps, 0);
  }
  if (gpu) return;
  // On the CPU, the host path the transceiver takes for host pools (DigestOnHost, on this thread)
  // beside version 4's checksum of the same rows (XXH3-64 streamed row by row), taken in turn so
  // both see the same cache and load; without the stream, whose thread spins while idle.
  stream_.reset();
  for (const Shape& s : shapes) {
    std::vector<uint64_t> digests(DigestSegmentCount({&s.run, 1}));
    double host_s = 1e9, v4_s = 1e9;
    uint64_t v4 = 0;
    for (int i = 0; i < 5; ++i) {
      auto t0 = Clock::now();
      internal::DigestOnHost({&s.run, 1}, digests.data());
      host_s = std::min(host_s, std::chrono::duration<double>(Clock::now() - t0).count());
      t0 = Clock::now();
      XXH3_state_t* st = XXH3_createState();
      XXH3_64bits_reset(st);
      for (size_t r = 0; r < s.run.rows; ++r)
        XXH3_64bits_update(st, static_cast<const std::byte*>(s.run.data) + r * s.run.pitch,
                           s.run.bytes);
      v4 = XXH3_64bits_digest(st);
      XXH3_freeState(st);
      v4_s = std::min(v4_s, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::printf(
        "DIGEST| device=cpu shape=%s host_digest_gbps=%.1f v4_xxh3_gbps=%.1f ratio=%.2f "
        "(%016llx)\n",
        s.name, s.bytes / host_s / 1e9, s.bytes / v4_s / 1e9, v4_s / host_s,
        static_cast<unsigned long long>(v4 ^ internal::CombineDigests(digests)));
  }
}

}  // namespace
}  // namespace kvferry::testing

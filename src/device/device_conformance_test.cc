// The device conformance suite: every Device implementation must pass it. Only memory of kind
// kHost / kPinnedHost is touched by the CPU here; device memory is reached through streams, so
// the same body runs on the CPU device and on a GPU.
#include "device/device_conformance.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <future>
#include <numeric>
#include <thread>
#include <vector>

namespace kvferry::testing {
namespace {

using std::chrono::milliseconds;

class DeviceConformance : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = DeviceUnderTest();
    if (!device_) GTEST_SKIP() << "no device of this kind present";
  }

  Buffer Alloc(MemoryKind kind, size_t n) {
    auto b = device_->Allocate(kind, n);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    return b.ok() ? std::move(b).value() : Buffer();
  }
  std::unique_ptr<Stream> NewStream() {
    auto s = device_->CreateStream();
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  std::unique_ptr<Event> NewEvent() {
    auto e = device_->CreateEvent();
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(e).value() : nullptr;
  }
  static void Pattern(Buffer& b, uint32_t seed) {
    auto* p = reinterpret_cast<uint32_t*>(b.data());
    for (size_t i = 0; i < b.size() / 4; ++i) p[i] = seed * 2654435761u + static_cast<uint32_t>(i);
  }
  static Deadline Soon() { return DeadlineIn(milliseconds(20000)); }

  std::unique_ptr<Device> device_;
};

TEST_F(DeviceConformance, AllocatesEveryMemoryKind) {
  for (MemoryKind k : {MemoryKind::kDevice, MemoryKind::kPinnedHost, MemoryKind::kHost}) {
    auto b = device_->Allocate(k, 12345);
    ASSERT_TRUE(b.ok()) << MemoryKindName(k) << ": " << b.status().ToString();
    EXPECT_EQ(b->size(), 12345u);
    EXPECT_EQ(b->kind(), k);
    EXPECT_NE(b->data(), nullptr);
  }
  EXPECT_EQ(device_->Allocate(MemoryKind::kFile, 10).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->Allocate(MemoryKind::kDevice, 0).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(DeviceConformance, BufferMovesOwnership) {
  Buffer a = Alloc(MemoryKind::kPinnedHost, 64);
  std::byte* p = a.data();
  Buffer b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.data(), p);
  b.Reset();
  EXPECT_FALSE(b);
}

TEST_F(DeviceConformance, RoundTripThroughDeviceMemory) {
  const size_t n = 8 << 20;
  Buffer src = Alloc(MemoryKind::kPinnedHost, n), dst = Alloc(MemoryKind::kHost, n);
  Buffer dev = Alloc(MemoryKind::kDevice, n);
  Pattern(src, 7);
  auto s = NewStream();
  ASSERT_TRUE(s->Copy(dev.data(), src.data(), n).ok());
  ASSERT_TRUE(s->Copy(dst.data(), dev.data(), n).ok());
  ASSERT_TRUE(s->Synchronize(Soon()).ok());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), n), 0);
  EXPECT_TRUE(s->Query());
}

TEST_F(DeviceConformance, OneStreamRunsInOrder) {
  const size_t n = 1 << 20;
  Buffer dev = Alloc(MemoryKind::kDevice, n);
  Buffer a = Alloc(MemoryKind::kPinnedHost, n), b = Alloc(MemoryKind::kPinnedHost, n);
  auto s = NewStream();
  ASSERT_TRUE(s->Fill(dev.data(), 0x11, n).ok());
  ASSERT_TRUE(s->Copy(a.data(), dev.data(), n).ok());
  ASSERT_TRUE(s->Fill(dev.data(), 0x22, n).ok());
  ASSERT_TRUE(s->Copy(b.data(), dev.data(), n).ok());
  ASSERT_TRUE(s->Synchronize(Soon()).ok());
  for (size_t i = 0; i < n; i += 4097) {
    ASSERT_EQ(std::to_integer<int>(a.data()[i]), 0x11);
    ASSERT_EQ(std::to_integer<int>(b.data()[i]), 0x22);
  }
}

TEST_F(DeviceConformance, ManyOperationsInFlight) {
  const size_t kOps = 4096, kChunk = 256;
  Buffer src = Alloc(MemoryKind::kPinnedHost, kOps * kChunk),
         dst = Alloc(MemoryKind::kPinnedHost, kOps * kChunk);
  Buffer dev = Alloc(MemoryKind::kDevice, kOps * kChunk);
  Pattern(src, 3);
  std::memset(dst.data(), 0, dst.size());
  auto s = NewStream();
  // Reverse order chunk copies, each a separate operation.
  for (size_t i = 0; i < kOps; ++i) {
    ASSERT_TRUE(
        s->Copy(dev.data() + (kOps - 1 - i) * kChunk, src.data() + i * kChunk, kChunk).ok());
  }
  for (size_t i = 0; i < kOps; ++i) {
    ASSERT_TRUE(
        s->Copy(dst.data() + i * kChunk, dev.data() + (kOps - 1 - i) * kChunk, kChunk).ok());
  }
  ASSERT_TRUE(s->Synchronize(Soon()).ok());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.size()), 0);
}

TEST_F(DeviceConformance, CrossStreamWaitOrdersWork) {
  const size_t n = 4 << 20;
  Buffer dev = Alloc(MemoryKind::kDevice, n), out = Alloc(MemoryKind::kPinnedHost, n);
  Buffer src = Alloc(MemoryKind::kPinnedHost, n);
  Pattern(src, 11);
  auto producer = NewStream(), consumer = NewStream();
  auto ready = NewEvent();
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  // The producer is held back until the consumer's work is queued, so only the event orders them.
  ASSERT_TRUE(producer->HostCallback([open] { open.wait(); }).ok());
  ASSERT_TRUE(producer->Copy(dev.data(), src.data(), n).ok());
  ASSERT_TRUE(producer->Record(*ready).ok());
  ASSERT_TRUE(consumer->Wait(*ready).ok());
  ASSERT_TRUE(consumer->Copy(out.data(), dev.data(), n).ok());
  EXPECT_FALSE(ready->Query());
  EXPECT_FALSE(consumer->Query());
  gate.set_value();
  ASSERT_TRUE(consumer->Synchronize(Soon()).ok());
  EXPECT_TRUE(ready->Query());
  EXPECT_EQ(std::memcmp(src.data(), out.data(), n), 0);
}

TEST_F(DeviceConformance, EventDeadlineAndUnrecordedEvent) {
  auto s = NewStream();
  auto e = NewEvent();
  EXPECT_TRUE(e->Query()) << "an event never recorded counts as complete";
  EXPECT_TRUE(e->Synchronize(Soon()).ok());
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  ASSERT_TRUE(s->HostCallback([open] { open.wait(); }).ok());
  ASSERT_TRUE(s->Record(*e).ok());
  EXPECT_FALSE(e->Query());
  EXPECT_EQ(e->Synchronize(DeadlineIn(milliseconds(30))).code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s->Synchronize(DeadlineIn(milliseconds(30))).code(), StatusCode::kDeadlineExceeded);
  gate.set_value();
  EXPECT_TRUE(e->Synchronize(Soon()).ok());
  EXPECT_TRUE(s->Synchronize(Soon()).ok());
}

TEST_F(DeviceConformance, WaitCapturesTheRecordAtCallTime) {
  // Re-recording after a Wait must not make the waiting stream wait for the later work.
  auto a = NewStream(), b = NewStream();
  auto e = NewEvent();
  ASSERT_TRUE(a->Record(*e).ok());
  ASSERT_TRUE(a->Synchronize(Soon()).ok());
  ASSERT_TRUE(b->Wait(*e).ok());
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  ASSERT_TRUE(a->HostCallback([open] { open.wait(); }).ok());
  ASSERT_TRUE(a->Record(*e).ok());
  EXPECT_TRUE(b->Synchronize(Soon()).ok());
  gate.set_value();
  EXPECT_TRUE(a->Synchronize(Soon()).ok());
}

TEST_F(DeviceConformance, HostCallbacksRunInStreamOrder) {
  auto s = NewStream();
  std::vector<int> order;
  std::mutex mu;
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(s->HostCallback([&, i] {
                   std::lock_guard lock(mu);
                   order.push_back(i);
                 }).ok());
  }
  ASSERT_TRUE(s->Synchronize(Soon()).ok());
  std::vector<int> want(100);
  std::iota(want.begin(), want.end(), 0);
  EXPECT_EQ(order, want);
}

TEST_F(DeviceConformance, CopyBatchScatteredFragments) {
  // Fragments of 16 B .. 64 KiB gathered from a source into a permuted destination.
  const size_t n = 16 << 20;
  Buffer src = Alloc(MemoryKind::kPinnedHost, n), dev = Alloc(MemoryKind::kDevice, n);
  Buffer back = Alloc(MemoryKind::kPinnedHost, n), dev2 = Alloc(MemoryKind::kDevice, n);
  Pattern(src, 5);
  std::memset(back.data(), 0, n);
  std::vector<CopyDesc> up, across, down;
  size_t off = 0;
  uint32_t x = 1;
  while (true) {
    x = x * 1664525u + 1013904223u;
    size_t len = size_t{16} << (x >> 28) % 13;  // 16 B .. 64 KiB
    if (off + len > n / 2) break;
    up.push_back({dev.data() + off, src.data() + off, len});
    // Across: move each fragment to the mirror position in the upper half of dev2.
    across.push_back({dev2.data() + n - off - len, dev.data() + off, len});
    down.push_back({back.data() + off, dev2.data() + n - off - len, len});
    off += len + 64;
  }
  auto s = NewStream();
  ASSERT_TRUE(s->CopyBatch(up).ok());
  ASSERT_TRUE(s->CopyBatch(across).ok());
  ASSERT_TRUE(s->CopyBatch(down).ok());
  up.clear();  // the descriptor arrays were consumed at enqueue time
  across.clear();
  ASSERT_TRUE(s->Synchronize(Soon()).ok());
  for (const CopyDesc& d : down) {
    size_t o = static_cast<const std::byte*>(d.dst) - back.data();
    ASSERT_EQ(std::memcmp(back.data() + o, src.data() + o, d.bytes), 0) << "fragment at " << o;
  }
  EXPECT_GT(down.size(), 100u);
}

TEST_F(DeviceConformance, CopyBatchPlanesTransposeHeadsAndTokens) {
  // An HND block [head][token][dim] to NHD [token][head][dim] and back, one descriptor per block:
  // planes are heads, rows tokens; the destination planes interleave (plane pitch = one row).
  // Rows of 1024 bytes (the kernel's warp per row), 256 (its flat aligned walk) and 6 (its
  // unaligned one); blocks of one token too (planes of a single row).
  for (const auto& [row, tokens] :
       {std::pair<size_t, size_t>{1024, 16}, {256, 16}, {6, 16}, {256, 1}, {6, 1}}) {
    const size_t heads = 8, blocks = 3, block = heads * tokens * row;
    const size_t n = blocks * block;
    Buffer src = Alloc(MemoryKind::kPinnedHost, n), back = Alloc(MemoryKind::kPinnedHost, n);
    Buffer nhd = Alloc(MemoryKind::kDevice, n), hnd = Alloc(MemoryKind::kDevice, n);
    Pattern(src, 17);
    std::memset(back.data(), 0, n);
    std::vector<CopyDesc> to_nhd, to_hnd;
    for (size_t b = 0; b < blocks; ++b) {
      // HND: head h, token t at h * tokens * row + t * row; NHD: at t * heads * row + h * row.
      to_nhd.push_back({nhd.data() + b * block, src.data() + b * block, row, tokens, heads * row,
                        row, heads, row, tokens * row});
      to_hnd.push_back({back.data() + b * block, nhd.data() + b * block, row, tokens, row,
                        heads * row, heads, tokens * row, row});
    }
    auto s = NewStream();
    ASSERT_TRUE(s->CopyBatch(to_nhd).ok());
    ASSERT_TRUE(s->CopyBatch(to_hnd).ok());
    Buffer mid = Alloc(MemoryKind::kPinnedHost, n);
    ASSERT_TRUE(s->Copy(mid.data(), nhd.data(), n).ok());
    ASSERT_TRUE(s->Synchronize(Soon()).ok());
    EXPECT_EQ(std::memcmp(back.data(), src.data(), n), 0) << "rows of " << row << " bytes";
    for (size_t b = 0; b < blocks; ++b) {
      for (size_t h = 0; h < heads; ++h) {
        for (size_t t = 0; t < tokens; ++t) {
          ASSERT_EQ(std::memcmp(mid.data() + b * block + (t * heads + h) * row,
                                src.data() + b * block + (h * tokens + t) * row, row),
                    0)
              << "block " << b << " head " << h << " token " << t << ", rows of " << row;
        }
      }
    }
  }
}

TEST_F(DeviceConformance, Copy2DStridedRows) {
  const size_t rows = 64, width = 100, spitch = 256, dpitch = 128;
  Buffer src = Alloc(MemoryKind::kPinnedHost, rows * spitch),
         dst = Alloc(MemoryKind::kPinnedHost, rows * dpitch);
  Buffer dev = Alloc(MemoryKind::kDevice, rows * dpitch);
  Pattern(src, 9);
  std::memset(dst.data(), 0xEE, dst.size());
  auto s = NewStream();
  ASSERT_TRUE(s->Fill(dev.data(), 0xEE, rows * dpitch).ok());
  ASSERT_TRUE(s->Copy2D(dev.data(), dpitch, src.data(), spitch, width, rows).ok());
  ASSERT_TRUE(s->Copy(dst.data(), dev.data(), rows * dpitch).ok());
  ASSERT_TRUE(s->Synchronize(Soon()).ok());
  for (size_t r = 0; r < rows; ++r) {
    ASSERT_EQ(std::memcmp(dst.data() + r * dpitch, src.data() + r * spitch, width), 0);
    ASSERT_EQ(std::to_integer<int>(dst.data()[r * dpitch + width]), 0xEE);
  }
  EXPECT_FALSE(s->Copy2D(dev.data(), 10, src.data(), spitch, 20, 1).ok());
}

TEST_F(DeviceConformance, DestroyingAStreamDrainsIt) {
  const size_t n = 1 << 20;
  Buffer src = Alloc(MemoryKind::kPinnedHost, n), dst = Alloc(MemoryKind::kPinnedHost, n);
  Pattern(src, 13);
  {
    auto s = NewStream();
    for (int i = 0; i < 16; ++i) ASSERT_TRUE(s->Copy(dst.data(), src.data(), n).ok());
  }
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), n), 0);
}

}  // namespace
}  // namespace kvferry::testing

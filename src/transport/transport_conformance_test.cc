// The transport conformance suite: every transport must pass it (see transport_conformance.h).
// Side 0 mostly sends, side 1 mostly receives; every wait has a deadline.
#include "transport/transport_conformance.h"

#include <gtest/gtest.h>
#include <poll.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace kvferry::testing {
namespace {

using std::chrono::milliseconds;

Deadline Soon() { return DeadlineIn(milliseconds(20000)); }

std::vector<std::byte> Pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<std::byte>(x >> 24);
  }
  return v;
}

std::vector<std::byte> Bytes(const std::string& s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

std::string Text(const std::vector<std::byte>& b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

std::unique_ptr<TransportOp> MustPost(StatusOr<std::unique_ptr<TransportOp>> op) {
  EXPECT_TRUE(op.ok()) << op.status().ToString();
  return op.ok() ? std::move(op).value() : nullptr;
}

// Waits for a control message; nullopt at the deadline.
std::optional<ControlMessage> AwaitControl(Transport& t, Deadline deadline) {
  while (Clock::now() < deadline) {
    if (auto m = t.PollControl()) return m;
    t.Progress();
  }
  return std::nullopt;
}

class TransportConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { harness_ = MakeHarness(GetParam()); }
  void Run(const std::function<void(Side&)>& body) {
    if (!harness_) GTEST_SKIP() << GetParam() << " is not available";
    harness_->Run(body);
  }
  std::unique_ptr<Harness> harness_;
};

TEST_P(TransportConformance, ControlMessagesBothWaysInOrder) {
  Run([](Side& s) {
    Transport& t = s.transport();
    constexpr int kCount = 200;
    for (int i = 0; i < kCount; ++i) {
      std::string m = std::to_string(s.index()) + ":" + std::to_string(i);
      if (i == kCount - 1) m += std::string(5000, 'x');  // a larger one, still in order
      ASSERT_TRUE(t.SendControl(s.other(), Bytes(m)).ok());
    }
    const Deadline deadline = Soon();
    for (int i = 0; i < kCount; ++i) {
      auto m = AwaitControl(t, deadline);
      ASSERT_TRUE(m.has_value()) << "control message " << i << " never arrived";
      EXPECT_EQ(m->from, s.other());
      std::string want = std::to_string(1 - s.index()) + ":" + std::to_string(i);
      if (i == kCount - 1) want += std::string(5000, 'x');
      ASSERT_EQ(Text(m->bytes), want);
    }
    s.Sync();
  });
}

TEST_P(TransportConformance, DataOfEverySizeWithRecvBeforeAndAfterSend) {
  Run([](Side& s) {
    Transport& t = s.transport();
    const size_t sizes[] = {1, 7, 4096, 65537, size_t{1} << 20, size_t{64} << 20};
    uint64_t tag = 100;
    for (size_t n : sizes) {
      for (bool recv_first : {true, false}) {
        ++tag;
        const auto want = Pattern(n, static_cast<uint32_t>(tag));
        std::unique_ptr<TransportOp> op;
        std::vector<std::byte> got;
        if (s.index() == 1) {
          got.assign(n + 16, std::byte{0});
          if (recv_first)
            op = MustPost(t.Recv(s.other(), tag, got.data(), got.size(), MemoryKind::kHost));
          s.Sync();
          if (!recv_first) {
            s.Sync();
            op = MustPost(t.Recv(s.other(), tag, got.data(), got.size(), MemoryKind::kHost));
          }
        } else {
          s.Sync();
          op = MustPost(t.Send(s.other(), tag, want.data(), n, MemoryKind::kHost));
          if (!recv_first) s.Sync();
        }
        ASSERT_NE(op, nullptr);
        ASSERT_TRUE(WaitOp(t, *op, Soon()).ok())
            << "size " << n << " recv_first " << recv_first << ": " << op->status().ToString();
        if (s.index() == 1) {
          ASSERT_EQ(op->bytes(), n);
          ASSERT_EQ(std::memcmp(got.data(), want.data(), n), 0) << "size " << n;
        }
      }
    }
    s.Sync();
  });
}

TEST_P(TransportConformance, ManyOpsInFlightMatchByTag) {
  Run([](Side& s) {
    Transport& t = s.transport();
    constexpr int kOps = 300;
    constexpr size_t kBytes = 8192;
    std::vector<std::vector<std::byte>> bufs(kOps);
    std::vector<std::unique_ptr<TransportOp>> ops(kOps);
    auto post_recv = [&](int i) {
      bufs[i].assign(kBytes, std::byte{0});
      ops[i] = MustPost(t.Recv(s.other(), 5000 + i, bufs[i].data(), kBytes, MemoryKind::kHost));
    };
    if (s.index() == 1) {
      for (int i = kOps - 1; i >= kOps / 2; --i) post_recv(i);  // half before, reversed
      s.Sync();
      for (int i = 0; i < kOps / 2; ++i) post_recv(i);  // half after the sends
    } else {
      for (int i = 0; i < kOps; ++i) bufs[i] = Pattern(kBytes, 5000 + i);
      s.Sync();
      for (int i = 0; i < kOps; ++i) {
        ops[i] = MustPost(t.Send(s.other(), 5000 + i, bufs[i].data(), kBytes, MemoryKind::kHost));
      }
    }
    const Deadline deadline = Soon();
    for (int i = 0; i < kOps; ++i) {
      ASSERT_NE(ops[i], nullptr);
      ASSERT_TRUE(WaitOp(t, *ops[i], deadline).ok()) << i << ": " << ops[i]->status().ToString();
      if (s.index() == 1) {
        ASSERT_EQ(bufs[i], Pattern(kBytes, 5000 + i)) << "op " << i;
      }
    }
    s.Sync();
  });
}

TEST_P(TransportConformance, MessageLargerThanReceiveBufferFails) {
  Run([](Side& s) {
    Transport& t = s.transport();
    for (size_t n : {size_t{1000}, size_t{1} << 20}) {  // eager and rendezvous sizes
      const uint64_t tag = 7000 + n;
      auto data = Pattern(n, 3);
      std::unique_ptr<TransportOp> op;
      if (s.index() == 1) {
        std::vector<std::byte> small(n / 4);
        op = MustPost(t.Recv(s.other(), tag, small.data(), small.size(), MemoryKind::kHost));
        s.Sync();
        ASSERT_NE(op, nullptr);
        Status st = WaitOp(t, *op, Soon());
        EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << n << ": " << st.ToString();
        s.Sync();
      } else {
        s.Sync();
        op = MustPost(t.Send(s.other(), tag, data.data(), n, MemoryKind::kHost));
        ASSERT_NE(op, nullptr);
        // The sender's op ends (its status is transport-specific); it must not hang.
        Status st = WaitOp(t, *op, Soon());
        EXPECT_NE(st.code(), StatusCode::kDeadlineExceeded) << n;
        s.Sync();
      }
    }
    // The transport still works afterwards.
    auto data = Pattern(4096, 9);
    std::vector<std::byte> got(4096);
    auto op = s.index() == 1
                  ? MustPost(t.Recv(s.other(), 7999, got.data(), got.size(), MemoryKind::kHost))
                  : MustPost(t.Send(s.other(), 7999, data.data(), data.size(), MemoryKind::kHost));
    ASSERT_NE(op, nullptr);
    ASSERT_TRUE(WaitOp(t, *op, Soon()).ok()) << op->status().ToString();
    if (s.index() == 1) {
      EXPECT_EQ(got, data);
    }
    s.Sync();
  });
}

TEST_P(TransportConformance, CancelPendingReceive) {
  Run([](Side& s) {
    Transport& t = s.transport();
    std::vector<std::byte> buf(4096);
    auto op = MustPost(t.Recv(s.other(), 8000, buf.data(), buf.size(), MemoryKind::kHost));
    ASSERT_NE(op, nullptr);
    t.Progress();
    EXPECT_FALSE(op->Done());
    t.Cancel(*op);
    Status st = WaitOp(t, *op, Soon());
    EXPECT_EQ(st.code(), StatusCode::kCancelled) << st.ToString();
    t.Cancel(*op);  // no-op on a done op
    s.Sync();
    // The same tag still works: the cancelled receive swallows nothing.
    auto data = Pattern(4096, 1);
    auto op2 = s.index() == 1
                   ? MustPost(t.Recv(s.other(), 8000, buf.data(), buf.size(), MemoryKind::kHost))
                   : MustPost(t.Send(s.other(), 8000, data.data(), data.size(), MemoryKind::kHost));
    ASSERT_NE(op2, nullptr);
    ASSERT_TRUE(WaitOp(t, *op2, Soon()).ok()) << op2->status().ToString();
    if (s.index() == 1) {
      EXPECT_EQ(buf, data);
    }
    s.Sync();
  });
}

TEST_P(TransportConformance, PeerGoneFailsPendingOpsWithinDeadline) {
  Run([](Side& s) {
    if (!s.CanDie()) GTEST_SKIP() << "this harness can't kill a peer";
    if (s.index() == 1) {
      s.Sync();
      s.Die();
      return;
    }
    Transport& t = s.transport();
    std::vector<std::byte> in(4096), out(8 << 20);
    auto recv = MustPost(t.Recv(s.other(), 9000, in.data(), in.size(), MemoryKind::kHost));
    auto send = MustPost(t.Send(s.other(), 9001, out.data(), out.size(), MemoryKind::kHost));
    ASSERT_NE(recv, nullptr);
    ASSERT_NE(send, nullptr);
    s.Sync();
    const auto start = Clock::now();
    const Deadline deadline = DeadlineIn(milliseconds(10000));
    EXPECT_EQ(WaitOp(t, *recv, deadline).code(), StatusCode::kUnavailable)
        << recv->status().ToString();
    EXPECT_EQ(WaitOp(t, *send, deadline).code(), StatusCode::kUnavailable)
        << send->status().ToString();
    // Later ops fail at once (or when posted), and control too.
    auto late = MustPost(t.Recv(s.other(), 9002, in.data(), in.size(), MemoryKind::kHost));
    if (late) {
      EXPECT_EQ(WaitOp(t, *late, DeadlineIn(milliseconds(5000))).code(), StatusCode::kUnavailable);
    }
    std::printf("[ info ] pending ops failed %lld ms after the peer died\n",
                static_cast<long long>(
                    std::chrono::duration_cast<milliseconds>(Clock::now() - start).count()));
  });
}

TEST_P(TransportConformance, ConnectToGarbageIsAClearError) {
  Run([](Side& s) {
    Transport& t = s.transport();
    const std::string self = t.LocalAddress();
    std::string flipped = self;
    flipped.back() = flipped.back() == '1' ? '2' : '1';
    for (const std::string& a : {std::string(), std::string("garbage"), self + "99999",
                                 std::string("ucx1:00ff"), flipped}) {
      if (a == self) continue;
      auto p = t.Connect(a, DeadlineIn(milliseconds(2000)));
      if (p.ok()) {
        // Only a flipped digit may name another live transport (inproc, mpi: the other side).
        EXPECT_EQ(a, flipped) << "'" << a << "' connected";
        continue;
      }
      EXPECT_TRUE(p.status().code() == StatusCode::kInvalidArgument ||
                  p.status().code() == StatusCode::kUnavailable)
          << p.status().ToString();
      EXPECT_FALSE(p.status().message().empty());
    }
    s.Sync();
  });
}

// A progress thread with nothing to drive sleeps on WakeupFd after ArmWakeup (the transceiver's
// ProgressWakeup) and must wake when a peer's control message comes: side 1 arms, says so, and
// side 0 answers a while later. MPI and NIXL have no such fd: their progress threads poll.
TEST_P(TransportConformance, WakeupFdSignalsAControlMessage) {
  const std::string name = GetParam();
  Run([&](Side& s) {
    Transport& t = s.transport();
    if (name == "mpi" || name == "nixl") {
      EXPECT_EQ(t.WakeupFd(), -1);
      EXPECT_FALSE(t.ArmWakeup());
      return;
    }
    ASSERT_GE(t.WakeupFd(), 0) << name << " offers no wakeup fd";
    if (s.index() == 1) {
      ASSERT_TRUE(t.SendControl(s.other(), Bytes("armed")).ok());
      const Deadline deadline = Soon();
      while (!t.ArmWakeup()) {  // the send's own events first
        ASSERT_LT(Clock::now(), deadline) << "never armed";
        t.Progress();
      }
      pollfd p{t.WakeupFd(), POLLIN, 0};
      ASSERT_EQ(poll(&p, 1, 20000), 1) << name << ": no wake-up for a control message in 20 s";
      auto m = AwaitControl(t, Soon());
      ASSERT_TRUE(m.has_value());
      EXPECT_EQ(Text(m->bytes), "wake");
    } else {
      auto m = AwaitControl(t, Soon());
      ASSERT_TRUE(m.has_value());
      EXPECT_EQ(Text(m->bytes), "armed");
      std::this_thread::sleep_for(milliseconds(200));  // side 1 sleeps on its fd by then
      ASSERT_TRUE(t.SendControl(s.other(), Bytes("wake")).ok());
    }
    s.Sync();
  });
}

TEST_P(TransportConformance, OneSidedPutThenFlush) {
  Run([](Side& s) {
    Transport& t = s.transport();
    if (!t.caps().one_sided) {
      EXPECT_EQ(t.RegisterMemory(&s, 8, MemoryKind::kHost).status().code(),
                StatusCode::kUnavailable);
      return;
    }
    constexpr size_t kChunk = size_t{4} << 20, kChunks = 4;
    if (s.index() == 1) {
      std::vector<std::byte> region(kChunk * kChunks);
      auto reg = t.RegisterMemory(region.data(), region.size(), MemoryKind::kHost);
      ASSERT_TRUE(reg.ok()) << reg.status().ToString();
      std::vector<std::byte> msg(8);
      const uint64_t addr = (*reg)->address();
      std::memcpy(msg.data(), &addr, 8);
      auto key = (*reg)->PackedKey();
      msg.insert(msg.end(), key.begin(), key.end());
      ASSERT_TRUE(t.SendControl(s.other(), msg).ok());
      auto done = AwaitControl(t, Soon());
      ASSERT_TRUE(done.has_value());
      EXPECT_EQ(Text(done->bytes), "flushed");
      for (size_t c = 0; c < kChunks; ++c) {
        ASSERT_EQ(std::memcmp(region.data() + c * kChunk, Pattern(kChunk, 40 + c).data(), kChunk),
                  0)
            << "chunk " << c;
      }
      s.Sync();
      return;
    }
    auto m = AwaitControl(t, Soon());
    ASSERT_TRUE(m.has_value());
    uint64_t addr = 0;
    std::memcpy(&addr, m->bytes.data(), 8);
    std::span<const std::byte> key(m->bytes.data() + 8, m->bytes.size() - 8);
    std::vector<std::vector<std::byte>> src;
    std::vector<std::unique_ptr<TransportOp>> ops;
    for (size_t c = 0; c < kChunks; ++c) {
      src.push_back(Pattern(kChunk, 40 + c));
      ops.push_back(MustPost(
          t.Put(s.other(), src.back().data(), kChunk, MemoryKind::kHost, addr + c * kChunk, key)));
    }
    auto flush = MustPost(t.Flush(s.other()));
    ASSERT_NE(flush, nullptr);
    for (auto& op : ops) ASSERT_TRUE(WaitOp(t, *op, Soon()).ok()) << op->status().ToString();
    ASSERT_TRUE(WaitOp(t, *flush, Soon()).ok()) << flush->status().ToString();
    ASSERT_TRUE(t.SendControl(s.other(), Bytes("flushed")).ok());
    s.Sync();
  });
}

// How a refused one-sided call shows: the call fails, or its op does (inproc).
StatusCode Refusal(Transport& t, StatusOr<std::unique_ptr<TransportOp>>& op) {
  if (!op.ok()) return op.status().code();
  return WaitOp(t, **op, Soon()).code();
}

// A put or get outside the registration its key describes is refused locally, before any byte
// moves; so is a key that is not one; the bytes around the registration stay untouched.
TEST_P(TransportConformance, OneSidedOutsideRegistrationIsRefused) {
  Run([](Side& s) {
    Transport& t = s.transport();
    if (!t.caps().one_sided) GTEST_SKIP() << t.caps().name << " has no one-sided operations";
    constexpr size_t kRegion = 64 << 10, kGuard = 4096;
    if (s.index() == 1) {
      // Registered: the middle of a larger buffer, whose guard bytes must stay as they are.
      std::vector<std::byte> buf(kRegion + 2 * kGuard, std::byte{0xAB});
      auto reg = t.RegisterMemory(buf.data() + kGuard, kRegion, MemoryKind::kDevice);
      ASSERT_TRUE(reg.ok()) << reg.status().ToString();
      std::vector<std::byte> msg(8);
      const uint64_t addr = (*reg)->address();
      std::memcpy(msg.data(), &addr, 8);
      auto key = (*reg)->PackedKey();
      msg.insert(msg.end(), key.begin(), key.end());
      ASSERT_TRUE(t.SendControl(s.other(), msg).ok());
      auto done = AwaitControl(t, Soon());
      ASSERT_TRUE(done.has_value());
      EXPECT_EQ(Text(done->bytes), "flushed");
      for (size_t i = 0; i < kGuard; ++i) {
        ASSERT_EQ(buf[i], std::byte{0xAB}) << "guard byte " << i << " before the region";
        ASSERT_EQ(buf[kGuard + kRegion + i], std::byte{0xAB}) << "guard byte " << i << " after";
      }
      EXPECT_EQ(std::memcmp(buf.data() + kGuard + kRegion - 8, Pattern(8, 77).data(), 8), 0);
      s.Sync();
      return;
    }
    auto m = AwaitControl(t, Soon());
    ASSERT_TRUE(m.has_value());
    uint64_t addr = 0;
    std::memcpy(&addr, m->bytes.data(), 8);
    std::span<const std::byte> key(m->bytes.data() + 8, m->bytes.size() - 8);
    std::vector<std::byte> src(kRegion + 16, std::byte{0xCD});
    struct Range {
      uint64_t at;
      size_t bytes;
    };
    for (Range r : {Range{addr - 1, 8}, Range{addr + kRegion - 7, 8}, Range{addr, kRegion + 1},
                    Range{addr + kRegion, 1}, Range{addr - kGuard, 16}, Range{~uint64_t{0}, 2}}) {
      auto put = t.Put(s.other(), src.data(), r.bytes, MemoryKind::kHost, r.at, key);
      EXPECT_EQ(Refusal(t, put), StatusCode::kInvalidArgument)
          << r.bytes << " bytes at offset " << static_cast<int64_t>(r.at - addr);
      auto get = t.Get(s.other(), src.data(), r.bytes, MemoryKind::kHost, r.at, key);
      const StatusCode g = Refusal(t, get);
      EXPECT_TRUE(g == StatusCode::kInvalidArgument || g == StatusCode::kUnavailable)
          << get.status().ToString();
    }
    std::vector<std::byte> junk(key.begin(), key.end());
    junk[0] = std::byte{'x'};
    auto bad = t.Put(s.other(), src.data(), 8, MemoryKind::kHost, addr, junk);
    EXPECT_EQ(Refusal(t, bad), StatusCode::kInvalidArgument);
    bad = t.Put(s.other(), src.data(), 8, MemoryKind::kHost, addr, key.first(3));
    EXPECT_EQ(Refusal(t, bad), StatusCode::kInvalidArgument);
    // The last bytes of the region are fine, by put and by get.
    const auto want = Pattern(8, 77);
    auto put =
        MustPost(t.Put(s.other(), want.data(), 8, MemoryKind::kHost, addr + kRegion - 8, key));
    ASSERT_NE(put, nullptr);
    ASSERT_TRUE(WaitOp(t, *put, Soon()).ok()) << put->status().ToString();
    auto flush = MustPost(t.Flush(s.other()));
    ASSERT_NE(flush, nullptr);
    ASSERT_TRUE(WaitOp(t, *flush, Soon()).ok()) << flush->status().ToString();
    std::vector<std::byte> back(8);
    auto get = t.Get(s.other(), back.data(), 8, MemoryKind::kHost, addr + kRegion - 8, key);
    if (get.ok()) {
      ASSERT_TRUE(WaitOp(t, **get, Soon()).ok()) << (*get)->status().ToString();
      EXPECT_EQ(back, want);
    } else {
      EXPECT_EQ(get.status().code(), StatusCode::kUnavailable) << get.status().ToString();
    }
    ASSERT_TRUE(t.SendControl(s.other(), Bytes("flushed")).ok());
    s.Sync();
  });
}

TEST_P(TransportConformance, RejectsBadArguments) {
  Run([](Side& s) {
    Transport& t = s.transport();
    char b[8];
    EXPECT_FALSE(t.Send(12345, 1, b, 8, MemoryKind::kHost).ok());
    EXPECT_FALSE(t.Send(s.other(), 1, b, 8, MemoryKind::kFile).ok());
    if (t.caps().tag_bits < 64) {
      EXPECT_FALSE(
          t.Send(s.other(), uint64_t{1} << t.caps().tag_bits, b, 8, MemoryKind::kHost).ok());
    }
    EXPECT_FALSE(t.SendControl(12345, {}).ok());
    s.Sync();
  });
}

INSTANTIATE_TEST_SUITE_P(All, TransportConformance, ::testing::ValuesIn(HarnessNames()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kvferry::testing

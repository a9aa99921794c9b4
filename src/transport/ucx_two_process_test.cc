// UCX between two processes: this test forks and execs ucx_peer_helper, passing it this
// transport's address on the command line; the helper connects and says "ready", and this side
// learns its PeerId from that first control message (connect-back).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kvferry/config.h"
#include "kvferry/transport.h"
#include "testing/bandwidth.h"
#include "testing/ucx_child_for_test.h"
#include "transport/ucx_address.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

using testing::Bytes;
using testing::Child;

class UcxTwoProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    TransportOptions o;
    o.name = "ucx";
    auto made = CreateTransport(o);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    t_ = std::move(made).value();
  }
  // Waits for the child's first control message; returns its PeerId.
  PeerId AwaitReady(const std::string& want = "ready") {
    const Deadline deadline = DeadlineIn(milliseconds(20000));
    while (Clock::now() < deadline) {
      if (auto m = t_->PollControl()) {
        EXPECT_EQ(std::string(reinterpret_cast<const char*>(m->bytes.data()), m->bytes.size()),
                  want);
        return m->from;
      }
    }
    ADD_FAILURE() << "child never said " << want;
    return kAnyPeer;
  }
  std::unique_ptr<Transport> t_;
};

TEST_F(UcxTwoProcess, Moves64MiBThereAndBack) {
  const auto start = Clock::now();
  Child child("echo", t_->LocalAddress());
  const PeerId peer = AwaitReady();
  ASSERT_NE(peer, kAnyPeer);
  const size_t n = size_t{64} << 20;
  std::vector<std::byte> out(n), back(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 131) ^ (i >> 12));
  auto s = std::move(t_->Send(peer, 1, out.data(), n, MemoryKind::kHost)).value();
  auto r = std::move(t_->Recv(peer, 2, back.data(), n, MemoryKind::kHost)).value();
  const Deadline deadline = DeadlineIn(milliseconds(30000));
  ASSERT_TRUE(WaitOp(*t_, *s, deadline).ok()) << s->status().ToString();
  ASSERT_TRUE(WaitOp(*t_, *r, deadline).ok()) << r->status().ToString();
  EXPECT_EQ(r->bytes(), n);
  EXPECT_TRUE(out == back);
  ASSERT_TRUE(t_->SendControl(peer, Bytes("exit")).ok());
  const Deadline exit_deadline = DeadlineIn(milliseconds(10000));
  while (Clock::now() < exit_deadline && t_->Progress()) {
  }
  t_->Progress();
  EXPECT_EQ(child.Wait(exit_deadline), 0);
  std::printf("[ info ] 64 MiB there and back, with process start: %.0f ms\n",
              std::chrono::duration<double, std::milli>(Clock::now() - start).count());
}

TEST_F(UcxTwoProcess, KilledPeerFailsPendingOpsWithinDeadline) {
  Child child("hang", t_->LocalAddress());
  const PeerId peer = AwaitReady();
  ASSERT_NE(peer, kAnyPeer);
  std::vector<std::byte> in(4096), out(8 << 20);
  auto r = std::move(t_->Recv(peer, 5, in.data(), in.size(), MemoryKind::kHost)).value();
  auto s = std::move(t_->Send(peer, 6, out.data(), out.size(), MemoryKind::kHost)).value();
  for (int i = 0; i < 100; ++i) t_->Progress();
  ASSERT_EQ(kill(child.pid(), SIGKILL), 0);
  child.Wait(DeadlineIn(milliseconds(5000)));
  const auto start = Clock::now();
  const Deadline deadline = DeadlineIn(milliseconds(20000));
  EXPECT_EQ(WaitOp(*t_, *s, deadline).code(), StatusCode::kUnavailable) << s->status().ToString();
  EXPECT_EQ(WaitOp(*t_, *r, deadline).code(), StatusCode::kUnavailable) << r->status().ToString();
  std::printf("[ info ] ops failed %.0f ms after SIGKILL of the peer\n",
              std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  EXPECT_EQ(t_->SendControl(peer, Bytes("x")).code(), StatusCode::kUnavailable);
}

// A process that crashed before we connect to it (the address a crashed context rank left in
// its handle): Connect, or the first ops after it, fail with kUnavailable within the deadline.
TEST_F(UcxTwoProcess, ConnectingToAKilledPeerFailsWithinDeadline) {
  Child child("hangaddr", t_->LocalAddress());
  std::string address;
  const Deadline ready = DeadlineIn(milliseconds(20000));
  while (address.empty() && Clock::now() < ready) {
    if (auto m = t_->PollControl()) {
      address.assign(reinterpret_cast<const char*>(m->bytes.data()), m->bytes.size());
    }
  }
  ASSERT_FALSE(address.empty());
  ASSERT_EQ(kill(child.pid(), SIGKILL), 0);
  child.Wait(DeadlineIn(milliseconds(5000)));
  TransportOptions o;
  o.name = "ucx";
  auto fresh = std::move(CreateTransport(o)).value();
  const auto start = Clock::now();
  auto peer = fresh->Connect(address, DeadlineIn(milliseconds(2000)));
  Status st = peer.status();
  if (peer.ok()) {
    char buf[64] = {};
    auto r = std::move(fresh->Recv(*peer, 1, buf, sizeof(buf), MemoryKind::kHost)).value();
    (void)fresh->SendControl(*peer, Bytes("hello?"));
    st = WaitOp(*fresh, *r, DeadlineIn(milliseconds(10000)));
  }
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  std::printf("[ info ] connecting to a killed peer failed after %.0f ms: %s\n",
              std::chrono::duration<double, std::milli>(Clock::now() - start).count(),
              st.ToString().c_str());
}

// The default configuration (ucx.error_mode=split) moves data over the fastest transports (not
// TCP on one host) and still notices a SIGKILLed peer: its control endpoint fails, and that
// fails the puts and flushes pending on its data endpoint, and every later one, within the
// deadline.
TEST_F(UcxTwoProcess, KilledPeerFailsPendingPutsAndFlushes) {
  Child child("hangreg", t_->LocalAddress());
  const PeerId peer = AwaitReady();
  ASSERT_NE(peer, kAnyPeer);
  std::optional<ControlMessage> key;
  const Deadline key_deadline = DeadlineIn(milliseconds(20000));
  while (!key && Clock::now() < key_deadline) key = t_->PollControl();
  ASSERT_TRUE(key.has_value());
  uint64_t addr = 0;
  std::memcpy(&addr, key->bytes.data(), 8);
  const std::vector<std::byte> rkey(key->bytes.begin() + 8, key->bytes.end());
  std::vector<std::byte> src(size_t{4} << 20, std::byte{5});
  // A first put and flush succeed, over a transport other than TCP.
  auto put = t_->Put(peer, src.data(), src.size(), MemoryKind::kHost, addr, rkey);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  auto flush = std::move(t_->Flush(peer)).value();
  ASSERT_TRUE(WaitOp(*t_, *flush, DeadlineIn(milliseconds(20000))).ok())
      << flush->status().ToString();
  const std::string path = t_->DescribePeer(peer);
  std::printf("[ info ] default config, peer on this host: %s\n", path.c_str());
  EXPECT_EQ(path.find("data tcp"), std::string::npos) << path;
  ASSERT_EQ(kill(child.pid(), SIGKILL), 0);
  child.Wait(DeadlineIn(milliseconds(5000)));
  const auto start = Clock::now();
  const Deadline deadline = DeadlineIn(milliseconds(20000));
  // Keep putting until the transport notices; every op must end, the last ones kUnavailable.
  Status last;
  std::vector<std::unique_ptr<TransportOp>> ops;
  while (Clock::now() < deadline) {
    auto p = t_->Put(peer, src.data(), src.size(), MemoryKind::kHost, addr, rkey);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    ops.push_back(std::move(p).value());
    auto f = std::move(t_->Flush(peer)).value();
    last = WaitOp(*t_, *f, deadline);
    if (!last.ok()) break;
  }
  EXPECT_EQ(last.code(), StatusCode::kUnavailable) << last.ToString();
  for (auto& op : ops) {
    Status st = WaitOp(*t_, *op, deadline);
    EXPECT_TRUE(st.ok() || st.code() == StatusCode::kUnavailable) << st.ToString();
  }
  auto late =
      std::move(t_->Put(peer, src.data(), src.size(), MemoryKind::kHost, addr, rkey)).value();
  EXPECT_EQ(WaitOp(*t_, *late, deadline).code(), StatusCode::kUnavailable);
  std::printf("[ info ] puts failed %.0f ms after SIGKILL of the peer (%zu puts in between)\n",
              std::chrono::duration<double, std::milli>(Clock::now() - start).count(), ops.size());
}

#ifndef KVFERRY_UCX_PERFTEST
#define KVFERRY_UCX_PERFTEST "ucx_perftest"
#define KVFERRY_UCX_LIBDIR ""
#endif

// The baseline, measured in the same run: ucx_perftest (from the libucx-cu13 wheel, the UCX
// kvferry links) put bandwidth with 4 MiB messages between two processes on loopback. Returns
// GB/s, or a negative number when ucx_perftest is missing or failed.
double PerftestPutGBps() {
  const std::string port = std::to_string(20000 + getpid() % 20000);
  const std::string args = " -t ucp_put_bw -s 4194304 -n 500 -p " + port;
  const std::string perftest =
      std::string("env LD_LIBRARY_PATH='") + KVFERRY_UCX_LIBDIR + "' " + KVFERRY_UCX_PERFTEST;
  if (std::system(("timeout 10 " + perftest + " -h > /dev/null 2>&1").c_str()) != 0) return -1;
  const std::string server = "timeout 30 " + perftest + args + " > /dev/null 2>&1 &";
  if (std::system(server.c_str()) != 0) return -1;
  std::this_thread::sleep_for(milliseconds(500));
  FILE* f = popen(("timeout 30 " + perftest + " localhost" + args + " 2>&1").c_str(), "r");
  if (f == nullptr) return -1;
  char line[512];
  double mbps = -1;
  while (std::fgets(line, sizeof(line), f)) {
    double v[8];
    int it = 0;
    if (std::sscanf(line, "Final: %d %lf %lf %lf %lf %lf", &it, &v[0], &v[1], &v[2], &v[3],
                    &v[4]) == 6) {
      mbps = v[4];  // overall bandwidth, MB/s (ucx_perftest's MB is 2^20 bytes)
    }
  }
  pclose(f);
  return mbps < 0 ? -1 : mbps * 1048576.0 / 1e9;
}

// Raw UCX bandwidth between two processes for the same bytes the benchmarks move; printed for
// each error mode (split, the default: data over shared memory / CMA, control over TCP; peer:
// everything over TCP; none: like split without crash detection), with the transports used.
void RunBandwidth(const std::string& mode) {
  ASSERT_TRUE(Config::Global().Set("ucx.error_mode", mode).ok());
  setenv("KVFERRY_UCX_ERROR_MODE", mode.c_str(), 1);
  TransportOptions o;
  o.name = "ucx";
  auto made = CreateTransport(o);
  (void)Config::Global().Reset("ucx.error_mode");
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  Transport& t = **made;
  BandwidthParams p;  // 4 MiB messages, 8 in flight
  p.total_bytes = mode == "peer" ? size_t{256} << 20 : size_t{512} << 20;
  Child child("bw", t.LocalAddress(), std::to_string(p.total_bytes >> 20));
  unsetenv("KVFERRY_UCX_ERROR_MODE");
  const Deadline deadline = DeadlineIn(milliseconds(60000));
  std::optional<ControlMessage> ready, key;
  while (!key && Clock::now() < deadline) {
    auto m = t.PollControl();
    if (m && !ready) {
      ready = std::move(m);
    } else if (m) {
      key = std::move(m);
    }
  }
  ASSERT_TRUE(key.has_value());
  const PeerId peer = key->from;
  uint64_t addr = 0;
  std::memcpy(&addr, key->bytes.data(), 8);
  std::span<const std::byte> rkey(key->bytes.data() + 8, key->bytes.size() - 8);
  std::vector<std::byte> src(size_t{64} << 20, std::byte{7});
  auto reg = t.RegisterMemory(src.data(), src.size(), MemoryKind::kHost);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  auto put = MeasurePutBandwidth(t, peer, src.data(), src.size(), MemoryKind::kHost, addr,
                                 size_t{64} << 20, rkey, p, deadline);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  // Cache-hot, like ucx_perftest: one 4 MiB buffer on each side, rewritten every time.
  auto hot = MeasurePutBandwidth(t, peer, src.data(), p.message_bytes, MemoryKind::kHost, addr,
                                 p.message_bytes, rkey, p, deadline);
  ASSERT_TRUE(hot.ok()) << hot.status().ToString();
  auto send = SendBandwidth(t, peer, src.data(), src.size(), MemoryKind::kHost, uint64_t{1} << 40,
                            p, deadline);
  ASSERT_TRUE(send.ok()) << send.status().ToString();
  std::printf(
      "[ info ] ucx.error_mode=%s, two processes, 4 MiB messages x8 in flight, %zu MiB: "
      "put %.2f GB/s (64 MiB buffers; %.2f GB/s with one cache-hot 4 MiB buffer), tag send "
      "%.2f GB/s; %s\n",
      mode.c_str(), p.total_bytes >> 20, put->GBps(), hot->GBps(), send->GBps(),
      t.DescribePeer(peer).c_str());
  ASSERT_TRUE(t.SendControl(peer, Bytes("exit")).ok());
  for (int i = 0; i < 1000; ++i) t.Progress();
  EXPECT_EQ(child.Wait(DeadlineIn(milliseconds(10000))), 0);
}

// Issue 29: a worker address with its first byte changed made UCX abort the process that
// connected to it (ucs_assertv_always on the address version), through a forged handle or a hello.
// Connect now refuses every such address before UCX sees it; the check runs in a child process so
// that a regression shows as a failed test, not as the end of this binary.
TEST_F(UcxTwoProcess, ConnectRefusesWorkerAddressesWithTheirFirstByteChanged) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const UcxWorkerAddresses mine = std::move(DecodeUcxWorkerAddresses(t_->LocalAddress())).value();
  EXPECT_EXIT(
      {
        TransportOptions o;
        o.name = "ucx";
        auto other = std::move(CreateTransport(o)).value();
        int refused = 0;
        for (int v = 0; v < 256; ++v) {
          for (bool data_worker : {false, true}) {
            UcxWorkerAddresses bad = mine;
            std::vector<uint8_t>& w = data_worker ? bad.data : bad.control;
            if (w[0] == v) continue;
            w[0] = static_cast<uint8_t>(v);
            auto peer = other->Connect(EncodeUcxWorkerAddresses(bad), DeadlineIn(milliseconds(1)));
            if (peer.status().code() == StatusCode::kInvalidArgument) ++refused;
          }
        }
        std::fprintf(stderr, "refused %d of 510\n", refused);
        std::exit(refused == 510 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "refused 510 of 510");
}

// The structural check itself, on this UCX's own address: every truncation, every appended
// byte and every change of the header byte (address version and flags) is refused; the address
// itself passes.
TEST_F(UcxTwoProcess, AddressShapeRefusesTruncatedExtendedAndForeignHeaders) {
  const UcxWorkerAddresses mine = std::move(DecodeUcxWorkerAddresses(t_->LocalAddress())).value();
  auto shape = UcxAddressShape::Learn(mine.control);
  std::string hex;
  for (uint8_t b : mine.control) hex += fmt::format(" {:02x}", b);
  ASSERT_TRUE(shape.ok()) << shape.status().ToString() << ";" << hex;
  ASSERT_TRUE(shape->Check(mine.control).ok());
  ASSERT_TRUE(shape->Check(mine.data).ok());
  for (size_t n = 0; n < mine.control.size(); ++n) {
    std::span<const uint8_t> cut(mine.control.data(), n);
    EXPECT_EQ(shape->Check(cut).code(), StatusCode::kInvalidArgument) << n << " bytes";
  }
  for (int v = 0; v < 256; ++v) {
    std::vector<uint8_t> longer = mine.control;
    longer.push_back(static_cast<uint8_t>(v));
    EXPECT_EQ(shape->Check(longer).code(), StatusCode::kInvalidArgument) << "appended " << v;
    std::vector<uint8_t> changed = mine.control;
    if (changed[0] == v) continue;
    changed[0] = static_cast<uint8_t>(v);
    EXPECT_EQ(shape->Check(changed).code(), StatusCode::kInvalidArgument) << "header " << v;
  }
  std::printf("[ info ] this UCX's control worker address: %zu bytes, header %02x %02x\n",
              mine.control.size(), mine.control[0], mine.control[1]);
}

// A hello is the first message of a sender; its address used to be connected to at once (a
// ucp_ep_create on bytes anyone may send). One carrying a corrupted address is dropped, this rank
// neither crashes nor delivers it, and it goes on serving the next peer.
TEST_F(UcxTwoProcess, HelloWithACorruptAddressIsDroppedAndTheRankServesOn) {
  Child bad("badhello", t_->LocalAddress());
  int bad_exit = -1;
  const Deadline deadline = DeadlineIn(milliseconds(20000));
  const Deadline settle = DeadlineIn(milliseconds(500));
  while (Clock::now() < deadline && (bad_exit < 0 || Clock::now() < settle)) {
    if (auto m = t_->PollControl()) ADD_FAILURE() << "a forged hello was delivered";
    if (bad_exit < 0) bad_exit = bad.Wait(DeadlineIn(milliseconds(0)));
  }
  EXPECT_EQ(bad_exit, 0) << "the helper could not send its hello";
  Child good("hang", t_->LocalAddress());
  const PeerId peer = AwaitReady();
  ASSERT_NE(peer, kAnyPeer);
  EXPECT_TRUE(t_->SendControl(peer, Bytes("still here")).ok());
}

// UCX takes SIGHUP when libucs loads (UCX_DEBUG_SIGNO: raise the log level) and so swallowed the
// hangup that ends a process; a rank process with a UCX transport now dies of it.
TEST_F(UcxTwoProcess, SighupEndsARankProcess) {
  Child child("hang", t_->LocalAddress());
  ASSERT_NE(AwaitReady(), kAnyPeer);
  ASSERT_EQ(kill(child.pid(), SIGHUP), 0);
  EXPECT_EQ(child.Wait(DeadlineIn(milliseconds(10000))), 128 + SIGHUP);
}

TEST(UcxTwoProcessBandwidth, PerftestBaseline) {
  const double gbps = PerftestPutGBps();
  if (gbps < 0) GTEST_SKIP() << "ucx_perftest not installed or failed";
  std::printf(
      "[ info ] baseline: ucx_perftest ucp_put_bw, 4 MiB messages, two processes: "
      "%.2f GB/s\n",
      gbps);
}
TEST(UcxTwoProcessBandwidth, PutAndSend4MiBMessagesErrorModeSplit) { RunBandwidth("split"); }
TEST(UcxTwoProcessBandwidth, PutAndSend4MiBMessagesErrorModePeer) { RunBandwidth("peer"); }
TEST(UcxTwoProcessBandwidth, PutAndSend4MiBMessagesErrorModeNone) { RunBandwidth("none"); }

}  // namespace
}  // namespace kvferry

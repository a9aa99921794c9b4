// UCX between two processes on one GPU (label gpu; skipped without one): GPU memory registered
// in a child process (ucx_peer_helper cuda), put into from GPU memory here over the default
// configuration, every byte checked by hash; then raw put bandwidth with many puts in flight
// (the library's baseline for bench transfer) beside one device-to-device copy of the same bytes
// in this process, same run, and the UCX transports the endpoint uses.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/transport.h"
#include "kvferry/ucx_info.h"
#include "testing/bandwidth.h"
#include "testing/ucx_child_for_test.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

using testing::Bytes;
using testing::Child;

std::string Text(const ControlMessage& m) {
  return {reinterpret_cast<const char*>(m.bytes.data()), m.bytes.size()};
}

uint32_t Fnv1a(const std::vector<std::byte>& v) {
  uint32_t h = 2166136261u;
  for (std::byte b : v) h = (h ^ static_cast<uint8_t>(b)) * 16777619u;
  return h;
}

std::optional<ControlMessage> Await(Transport& t, Deadline deadline) {
  while (Clock::now() < deadline) {
    if (auto m = t.PollControl()) return m;
  }
  return std::nullopt;
}

TEST(UcxCuda, PutGpuToGpuBetweenProcesses) {
  auto dev = OpenDevice("cuda:0");
  if (!dev.ok()) GTEST_SKIP() << "no GPU: " << dev.status().ToString();
  auto info = QueryUcxRuntime();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  std::printf("[ info ] %s\n", DescribeUcxRuntime(*info).c_str());
  TransportOptions o;
  o.name = "ucx";
  o.device_memory_is_host = false;
  auto made = CreateTransport(o);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  Transport& t = **made;
  ASSERT_TRUE(t.caps().device_memory)
      << "UCX offers no CUDA memory here: " << DescribeUcxRuntime(*info);

  Child child("cuda", t.LocalAddress());
  const Deadline deadline = DeadlineIn(milliseconds(60000));
  auto ready = Await(t, deadline);
  ASSERT_TRUE(ready.has_value());
  const PeerId peer = ready->from;
  auto key_msg = Await(t, deadline);
  ASSERT_TRUE(key_msg.has_value());
  uint64_t addr = 0;
  std::memcpy(&addr, key_msg->bytes.data(), 8);
  const std::vector<std::byte> rkey(key_msg->bytes.begin() + 8, key_msg->bytes.end());

  constexpr size_t kBytes = size_t{64} << 20;
  std::vector<std::byte> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<std::byte>((i * 131) ^ (i >> 11));
  auto src = (*dev)->Allocate(MemoryKind::kDevice, kBytes);
  auto copy_dst = (*dev)->Allocate(MemoryKind::kDevice, kBytes);
  ASSERT_TRUE(src.ok() && copy_dst.ok());
  auto stream = std::move((*dev)->CreateStream()).value();
  ASSERT_TRUE(stream->Copy(src->data(), pattern.data(), kBytes).ok());
  ASSERT_TRUE(stream->Synchronize(deadline).ok());
  auto reg = t.RegisterMemory(src->data(), kBytes, MemoryKind::kDevice);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();

  // Every byte, by hash of the child's copy to its host.
  auto put = t.Put(peer, src->data(), kBytes, MemoryKind::kDevice, addr, rkey);
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  auto flush = std::move(t.Flush(peer)).value();
  ASSERT_TRUE(WaitOp(t, **put, deadline).ok()) << (*put)->status().ToString();
  ASSERT_TRUE(WaitOp(t, *flush, deadline).ok()) << flush->status().ToString();
  ASSERT_TRUE(t.SendControl(peer, Bytes("check")).ok());
  auto hash = Await(t, deadline);
  ASSERT_TRUE(hash.has_value());
  EXPECT_EQ(Text(*hash), std::to_string(Fnv1a(pattern)));
  const std::string path = t.DescribePeer(peer);
  std::printf("[ info ] default config, GPU peer on this GPU: %s\n", path.c_str());
  EXPECT_NE(path.find("cuda_ipc"), std::string::npos) << path;

  // Same run: one device-to-device copy of 64 MiB in this process (best of 5).
  auto copy = BestCopyGBps(*stream, copy_dst->data(), src->data(), kBytes, 5, deadline);
  ASSERT_TRUE(copy.ok()) << copy.status().ToString();
  const double copy_gbps = *copy;
  for (size_t msg : {size_t{4} << 20, size_t{64} << 20}) {
    BandwidthParams p;
    p.message_bytes = msg;
    p.window = 32;
    p.total_bytes = size_t{8} << 30;
    auto bw = MeasurePutBandwidth(t, peer, src->data(), kBytes, MemoryKind::kDevice, addr, kBytes,
                                  rkey, p, deadline);
    ASSERT_TRUE(bw.ok()) << bw.status().ToString();
    std::printf(
        "[ info ] GPU to GPU between two processes, one GPU: UCX put %zu MiB messages x%d in "
        "flight, 8 GiB: %.1f GB/s; one cudaMemcpy D2D of 64 MiB in one process: %.1f GB/s "
        "(ratio %.2f); %s\n",
        msg >> 20, p.window, bw->GBps(), copy_gbps, bw->GBps() / copy_gbps, bw->transports.c_str());
  }
  ASSERT_TRUE(t.SendControl(peer, Bytes("exit")).ok());
  for (int i = 0; i < 1000; ++i) t.Progress();
  EXPECT_EQ(child.Wait(DeadlineIn(milliseconds(10000))), 0);
}

}  // namespace
}  // namespace kvferry

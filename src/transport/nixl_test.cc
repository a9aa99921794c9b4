// NIXL loaded at run time: where it is found, what is refused, what `kvferry info` reports.
// Tests that need NIXL itself are skipped (saying why) where it can't be loaded.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "kvferry/config.h"
#include "kvferry/nixl_info.h"
#include "kvferry/transport.h"
#include "transport/nixl_api.h"
#include "transport/nixl_wire.h"

namespace kvferry::nixl_detail {
namespace {

// Restores a knob when the test ends.
struct KnobGuard {
  std::string name;
  ~KnobGuard() { (void)Config::Global().Reset(name); }
};

TEST(NixlRuntime, ReportsVersionPluginsAndBackendOrWhyNot) {
  auto info = QueryNixlRuntime();
  if (!info.ok()) {
    EXPECT_EQ(info.status().code(), StatusCode::kUnavailable);
    EXPECT_FALSE(info.status().message().empty());
    GTEST_SKIP() << info.status().ToString();
  }
  EXPECT_EQ(info->version.rfind("1.5.", 0), 0u) << info->version;
  EXPECT_NE(info->library_path.find("libnixl_capi.so"), std::string::npos);
  EXPECT_NE(std::find(info->plugins.begin(), info->plugins.end(), "UCX"), info->plugins.end());
  EXPECT_EQ(info->backend, "UCX");
  EXPECT_TRUE(info->backend_status.ok()) << info->backend_status.ToString();
}

TEST(NixlRuntime, AMissingLibraryIsUnavailableNamingIt) {
  KnobGuard g{"nixl.library"};
  ASSERT_TRUE(Config::Global().Set("nixl.library", "/nonexistent/nixl").ok());
  auto api = LoadNixl();
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(api.status().message().find("/nonexistent/nixl"), std::string::npos);
  TransportOptions o;
  o.name = "nixl";
  auto t = CreateTransport(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(t.status().message().find("/nonexistent/nixl"), std::string::npos);
}

TEST(NixlRuntime, AnUnknownBackendIsUnavailable) {
  if (auto api = LoadNixl(); !api.ok()) GTEST_SKIP() << api.status().ToString();
  KnobGuard g{"nixl.backend"};
  ASSERT_TRUE(Config::Global().Set("nixl.backend", "NO_SUCH_PLUGIN").ok());
  auto info = QueryNixlRuntime();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->backend_status.code(), StatusCode::kUnavailable);
  EXPECT_NE(info->backend_status.message().find("NO_SUCH_PLUGIN"), std::string::npos);
  TransportOptions o;
  o.name = "nixl";
  EXPECT_EQ(CreateTransport(o).status().code(), StatusCode::kUnavailable);
}

std::vector<std::byte> Bytes(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

TEST(NixlWire, AddressKeyAndNotificationRoundTrip) {
  NixlAddress a{"kvferry-1-abc", Bytes("metadata bytes")};
  auto back = DecodeNixlAddress(EncodeNixlAddress(a));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->agent, a.agent);
  EXPECT_EQ(back->metadata, a.metadata);
  NixlKey k{"kvferry-1-abc", 0x1000, 4096, Bytes("partial")};
  auto kb = DecodeNixlKey(EncodeNixlKey(k));
  ASSERT_TRUE(kb.ok()) << kb.status().ToString();
  EXPECT_EQ(kb->agent, k.agent);
  EXPECT_EQ(kb->base, k.base);
  EXPECT_EQ(kb->size, k.size);
  EXPECT_EQ(kb->metadata, k.metadata);
  EXPECT_EQ(kb->mem, kMemDram);
  EXPECT_EQ(EncodeNixlKey(k)[3], std::byte{'1'});  // host memory: version 1, as before
  // GPU memory: version 2, with NIXL's memory type and device id.
  NixlKey v{"kvferry-1-abc", 0x7f0000000000, 1 << 20, Bytes("vram md"), kMemVram, 3};
  auto vb = DecodeNixlKey(EncodeNixlKey(v));
  ASSERT_TRUE(vb.ok()) << vb.status().ToString();
  EXPECT_EQ(EncodeNixlKey(v)[3], std::byte{'2'});
  EXPECT_EQ(vb->mem, kMemVram);
  EXPECT_EQ(vb->device, 3u);
  EXPECT_EQ(vb->base, v.base);
  EXPECT_EQ(vb->metadata, v.metadata);
  auto msg = NixlNotifHeader(kData, "nixl1:00", 7, 10, 4);
  for (std::byte b : Bytes("abcdef")) msg.push_back(b);
  auto n = DecodeNixlNotif(msg);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(n->kind, kData);
  EXPECT_EQ(n->hello_address, "nixl1:00");
  EXPECT_EQ(n->tag, 7u);
  EXPECT_EQ(n->total, 10u);
  EXPECT_EQ(n->offset, 4u);
  EXPECT_EQ(n->payload.size(), 6u);
}

// Every truncation and a corrupted byte anywhere: an error or a value, never a read past the end
// (ASan builds check that), never an exception.
TEST(NixlWire, TruncatedOrCorruptInputIsAnError) {
  const std::string addr = EncodeNixlAddress({"agent", Bytes("md")});
  for (size_t n = 0; n < addr.size(); ++n) {
    EXPECT_FALSE(DecodeNixlAddress(addr.substr(0, n)).ok()) << n;
  }
  EXPECT_FALSE(DecodeNixlAddress(addr + "00").ok());
  EXPECT_FALSE(DecodeNixlAddress("nixl1:zz").ok());
  EXPECT_FALSE(DecodeNixlAddress("ucx1:00ff").ok());
  const auto key = EncodeNixlKey({"agent", 64, 128, Bytes("md")});
  for (size_t n = 0; n < key.size(); ++n) {
    EXPECT_FALSE(DecodeNixlKey(std::span(key).first(n)).ok()) << n;
  }
  auto wrap = EncodeNixlKey({"agent", ~uint64_t{0} - 4, 128, Bytes("md")});
  EXPECT_FALSE(DecodeNixlKey(wrap).ok());
  const auto vram = EncodeNixlKey({"agent", 64, 128, Bytes("md"), kMemVram, 1});
  for (size_t n = 0; n < vram.size(); ++n) {
    EXPECT_FALSE(DecodeNixlKey(std::span(vram).first(n)).ok()) << n;
  }
  auto bad_mem = vram;
  bad_mem[4 + 4 + 5 + 8 + 8] = std::byte{7};  // the memory type: neither DRAM nor VRAM
  auto refused = DecodeNixlKey(bad_mem);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("memory type 7"), std::string::npos)
      << refused.status().ToString();
  auto data = NixlNotifHeader(kData, "", 1, 4, 2);
  for (std::byte b : Bytes("abc")) data.push_back(b);  // 3 bytes at offset 2 of 4: too long
  EXPECT_FALSE(DecodeNixlNotif(data).ok());
  for (size_t n = 0; n < 25; ++n) (void)DecodeNixlNotif(std::span(data).first(n));
  std::vector<std::byte> unknown = {std::byte{9}};
  EXPECT_FALSE(DecodeNixlNotif(unknown).ok());
}

StatusOr<std::unique_ptr<Transport>> MakeNixl() {
  TransportOptions o;
  o.name = "nixl";
  return CreateTransport(o);
}

// A remote agent's metadata that does not parse, or that names another agent than its address
// does: a clear error at Connect, no crash in NIXL, and the transport still works.
TEST(NixlTransport, BadRemoteMetadataIsAClearError) {
  auto made_a = MakeNixl();
  if (!made_a.ok()) GTEST_SKIP() << made_a.status().ToString();
  auto made_b = MakeNixl();
  ASSERT_TRUE(made_b.ok()) << made_b.status().ToString();
  auto& a = *made_a;
  auto& b = *made_b;
  auto real = DecodeNixlAddress(b->LocalAddress());
  ASSERT_TRUE(real.ok());
  const Deadline soon = DeadlineIn(std::chrono::milliseconds(2000));
  auto p = a->Connect(EncodeNixlAddress({real->agent, Bytes("garbage")}), soon);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << p.status().ToString();
  EXPECT_NE(p.status().message().find("is not NIXL metadata"), std::string::npos)
      << p.status().ToString();
  // A damaged record: NIXL refuses it (its C API can't say why: a dead agent reads the same).
  // Cut before its connection info ends (a record cut after it leaves NIXL connected to that
  // agent, refusing its good metadata later: a third agent shows that case below).
  for (size_t cut : {size_t{12}, real->metadata.size() / 2}) {
    std::vector<std::byte> md(real->metadata.begin(), real->metadata.begin() + cut);
    p = a->Connect(EncodeNixlAddress({real->agent, md}), soon);
    ASSERT_FALSE(p.ok()) << cut;
    EXPECT_EQ(p.status().code(), StatusCode::kUnavailable) << p.status().ToString();
    EXPECT_NE(p.status().message().find("does not load"), std::string::npos)
        << p.status().ToString();
  }
  p = a->Connect(EncodeNixlAddress({"someone-else", real->metadata}), soon);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("another instance"), std::string::npos)
      << p.status().ToString();
  {
    auto c = MakeNixl();
    ASSERT_TRUE(c.ok());
    auto cm = DecodeNixlAddress((*c)->LocalAddress());
    ASSERT_TRUE(cm.ok());
    cm->metadata.pop_back();
    p = a->Connect(EncodeNixlAddress(*cm), soon);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), StatusCode::kUnavailable) << p.status().ToString();
  }
  // The real address still connects, and a key whose metadata does not parse is refused.
  auto ok = a->Connect(b->LocalAddress(), soon);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  std::vector<std::byte> region(4096);
  auto reg = b->RegisterMemory(region.data(), region.size(), MemoryKind::kHost);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  auto key = DecodeNixlKey((*reg)->PackedKey());
  ASSERT_TRUE(key.ok());
  key->metadata = Bytes("not metadata");
  const auto bad = EncodeNixlKey(*key);
  std::vector<std::byte> src(64);
  auto put = a->Put(*ok, src.data(), src.size(), MemoryKind::kHost, (*reg)->address(), bad);
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), StatusCode::kInvalidArgument) << put.status().ToString();
  // A key of another agent is refused before NIXL sees it.
  key = DecodeNixlKey((*reg)->PackedKey());
  key->agent = "someone-else";
  put = a->Put(*ok, src.data(), src.size(), MemoryKind::kHost, (*reg)->address(),
               EncodeNixlKey(*key));
  ASSERT_FALSE(put.ok());
  EXPECT_EQ(put.status().code(), StatusCode::kInvalidArgument) << put.status().ToString();
}

std::optional<ControlMessage> AwaitControl(Transport& t, Deadline deadline) {
  while (Clock::now() < deadline) {
    if (auto m = t.PollControl()) return m;
    t.Progress();
  }
  return std::nullopt;
}

// The child of NixlCrash.CrashedPeerFailsPendingOps (run by it, skipped otherwise): connects to
// the address in NIXL_TEST_PEER, says hello, and dies by SIGKILL when told (no bye).
TEST(NixlCrashChild, Run) {
  const char* peer = getenv("NIXL_TEST_PEER");
  if (peer == nullptr) GTEST_SKIP() << "run by NixlCrash.CrashedPeerFailsPendingOps";
  auto t = MakeNixl();
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto p = (*t)->Connect(peer, DeadlineIn(std::chrono::milliseconds(5000)));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_TRUE((*t)->SendControl(*p, Bytes("hello")).ok());
  auto m = AwaitControl(**t, DeadlineIn(std::chrono::milliseconds(20000)));
  ASSERT_TRUE(m.has_value());
  const char* death = getenv("NIXL_TEST_DEATH");
  kill(getpid(), death && std::string(death) == "stop" ? SIGSTOP : SIGKILL);
}

// A peer that crashes (SIGKILL: no bye) or hangs (SIGSTOP) fails this side's pending receive
// naming it: a crash by a ping that fails (NIXL's UCX sees the connection reset), a hung peer by
// silence after nixl.peer_timeout_ms. NIXL itself would never time either out.
class NixlCrash : public ::testing::TestWithParam<std::string> {};

TEST_P(NixlCrash, CrashedPeerFailsPendingOps) {
  const std::string mode = GetParam().substr(0, GetParam().find('|'));
  const std::string death = GetParam().substr(GetParam().find('|') + 1);
  KnobGuard params{"nixl.backend_params"};
  ASSERT_TRUE(Config::Global().Set("nixl.backend_params", mode).ok());
  KnobGuard g{"nixl.peer_timeout_ms"};
  ASSERT_TRUE(Config::Global().Set("nixl.peer_timeout_ms", "1000").ok());
  auto t = MakeNixl();
  if (!t.ok()) GTEST_SKIP() << t.status().ToString();
  const std::string address = (*t)->LocalAddress();
  const pid_t pid = fork();
  if (pid == 0) {
    setenv("NIXL_TEST_PEER", address.c_str(), 1);
    setenv("KVFERRY_NIXL_PEER_TIMEOUT_MS", "1000", 1);
    setenv("KVFERRY_NIXL_BACKEND_PARAMS", mode.c_str(), 1);
    setenv("NIXL_TEST_DEATH", death.c_str(), 1);
    execl("/proc/self/exe", "nixl_test", "--gtest_filter=NixlCrashChild.Run", nullptr);
    _exit(127);
  }
  ASSERT_GT(pid, 0);
  struct Reap {
    pid_t pid;
    ~Reap() {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  } reap{pid};
  auto hello = AwaitControl(**t, DeadlineIn(std::chrono::milliseconds(20000)));
  ASSERT_TRUE(hello.has_value()) << "the child never said hello";
  const PeerId child = hello->from;
  char buf[64];
  auto recv = (*t)->Recv(child, 42, buf, sizeof(buf), MemoryKind::kHost);
  ASSERT_TRUE(recv.ok()) << recv.status().ToString();
  ASSERT_TRUE((*t)->SendControl(child, Bytes("die")).ok());
  const auto start = Clock::now();
  Status st = WaitOp(**t, **recv, DeadlineIn(std::chrono::milliseconds(10000)));
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_LT(ms, 4000);  // 1 s of silence, a ping period, and a loaded machine
  if (death == "stop") {
    EXPECT_GE(ms, 900) << "a stopped peer is noticed by its silence";
  }
  std::printf("[ info ] the pending receive failed %lld ms after the peer was told to die\n",
              static_cast<long long>(ms));
  // Later operations to it fail at once.
  EXPECT_FALSE((*t)->SendControl(child, Bytes("x")).ok());
}

INSTANTIATE_TEST_SUITE_P(Deaths, NixlCrash,
                         ::testing::Values("ucx_error_handling_mode=peer|kill",
                                           "ucx_error_handling_mode=none|kill",
                                           "ucx_error_handling_mode=peer|stop"),
                         [](const auto& info) {
                           std::string n = info.param.substr(info.param.find('=') + 1);
                           n[n.find('|')] = '_';
                           return n;
                         });

}  // namespace
}  // namespace kvferry::nixl_detail
